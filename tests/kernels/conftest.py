"""Adapters against the kernel packages' real Python wrappers (``make test-kernels``).

``make test-kernels`` downloads the kernel distributions from the package
registry (``pip download --no-deps``), unpacks their Python files into
``$ATTNRES_KERNEL_DISTS/<project>/`` (tests/kernels/build_env.py) and runs this
folder with that variable set. Only the compiled layer below each wrapper is
ours: tests/kernels/stubs/ (see its modules' headers). Without the variable the
run stops with an error rather than pass or skip anything.

Each test module loads its distributions with :func:`load_dists` (module
scope): their folders and the stubs go first on ``sys.path`` and every module
of those packages is dropped from ``sys.modules`` before and after, so
flash-attn 2.8.3's own ``flash_attn.cute`` and flash-attn-4's never meet.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# torch's dynamo reads Triton's presence once, at its import (a stub's dtype among
# its constant types breaks every later torch.compile in the process): imported
# here, before any stub stands in for triton
import torch._dynamo.utils  # noqa: F401  # isort: skip

STUBS = Path(__file__).parent / "stubs"
#: the top-level modules the distributions and stubs bring (purged between modules)
PACKAGES = (
    "flash_attn", "flash_attn_2_cuda", "flash_attn_interface", "flash_attn_3", "aiter", "aiter_",
    "xformers", "sageattention", "triton", "cutlass", "quack", "cuda", "tvm_ffi", "einops",
    "_kernel_reference", "_stub_modules", "chip_info", "cpp_extension", "file_baton",
    "torch_guard", "torch_npu",
)  # fmt: skip


def dists_root() -> Path:
    root = os.environ.get("ATTNRES_KERNEL_DISTS")
    if not root or not Path(root).is_dir():
        pytest.exit(
            "tests/kernels needs the kernel distributions: run `make test-kernels` "
            "(ATTNRES_KERNEL_DISTS is unset or not a folder)",
            returncode=3,
        )
    return Path(root)


def _purge() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]
    _forget_triton()


def _forget_triton() -> None:
    """Drop what torch cached about Triton while a stub stood in for it: its
    ``torch.utils._triton`` probes (``has_triton_package``, ``has_triton``, ...)
    are memoized, and a True cached under the stub makes every later
    ``torch.compile`` in the process import ``triton.backends`` and fail."""
    from torch.utils import _triton

    for value in vars(_triton).values():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()


@contextmanager
def load_dists(*projects: str, stubs: tuple[str, ...] = ()) -> Iterator[None]:
    """``projects`` (folders under the dists root) and the stubs on ``sys.path``;
    ``stubs``: subfolders of the stubs that shadow a real top-level name
    (``fa3``: the ``flash_attn_3`` package, which xformers probes too)."""
    root = dists_root()
    paths = [str(root / p) for p in projects] + [str(STUBS / s) for s in stubs] + [str(STUBS)]
    for path in paths:
        if not Path(path).is_dir():
            pytest.exit(f"missing kernel distribution folder {path}: rerun make test-kernels", 3)
    _purge()
    sys.path[:0] = paths
    try:
        yield
    finally:
        for path in paths:
            sys.path.remove(path)
        _purge()
