"""aiter adapter through amd-aiter 0.1.7.post2.dev18's own ``aiter/ops/mha.py``.

Stubbed below it: the prebuilt compiled module (``aiter.jit.aiter_`` ->
stubs/aiter_.py, whose functions ``compile_ops`` type-checks against their
pybind11 signature lines as it does the real ones), ROCm's ``hipconfig``
(stubs/rocm, read at import for the HIP version), and the Triton compiler and
pandas, which other aiter modules import at package import (mha uses neither).
``GPU_ARCHS=gfx942`` answers aiter's own architecture query (rocminfo).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _real import close, grads_close, key_padding, qkv, reference
from conftest import STUBS, load_dists

from attnres._varlen import padded_kernel


@pytest.fixture(scope="module", autouse=True)
def amd_aiter() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in ("GPU_ARCHS", "ROCM_HOME")}
    os.environ["GPU_ARCHS"] = "gfx942"
    os.environ["ROCM_HOME"] = str(Path(STUBS) / "rocm")
    with load_dists("amd-aiter"):
        import _stub_modules
        import aiter_

        _stub_modules.install(["triton", "pandas"], {"triton": "3.3.0"})
        sys.modules["aiter.jit.aiter_"] = aiter_  # what aiter.jit.core imports beside aiter_.so
        try:
            import aiter
            from aiter.jit import core

            assert core.PREBUILD_KERNELS and aiter.flash_attn_func.__module__ == "aiter.ops.mha"
            yield
        finally:
            _stub_modules.uninstall()
            _mend_op_names()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _mend_op_names() -> None:
    """aiter's ``torch_guard`` passes ``define`` a schema already qualified
    (``aiter::name(...)``), so its ``Library`` records ``aiter::aiter::name``,
    which torch's clean-up of the library at interpreter exit cannot split (a
    ``ValueError`` traceback after the run). The names are recorded as torch
    records its own, so the clean-up runs; what the ops do is unchanged."""
    for module in [sys.modules.get(n) for n in ("aiter.jit.utils.torch_guard", "torch_guard")]:
        names = getattr(getattr(module, "aiter_lib", None), "_op_defs", None)
        for name in [n for n in names or () if n.count("::") > 1]:
            names.discard(name)
            names.add(name.replace("aiter::aiter::", "aiter::", 1))


def _adapters() -> tuple[Any, Any]:
    from attnres.kernels import aiter

    return aiter.make_kernel(), aiter.make_varlen_kernel()


@pytest.mark.parametrize(
    ("shape", "causal", "window"),
    [({}, False, None), ({}, True, None), ({"heads_kv": 2}, True, None),
     ({"seq_q": 5, "seq_kv": 11}, False, None), ({"size": 40}, False, None), ({}, False, (3, 1))],
)  # fmt: skip
def test_dense_forward(shape: dict[str, int], causal: bool, window: tuple[int, int] | None) -> None:
    dense, _ = _adapters()
    q, k, v = qkv(**shape)
    extra = {} if window is None else {"window": window}
    close(
        dense(q, k, v, None, causal, 0.3, **extra),
        reference(q, k, v, None, causal, 0.3, window=window),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_through_varlen(causal: bool) -> None:
    dense, varlen = _adapters()
    kernel = padded_kernel("aiter", dense, lambda: varlen)
    q, k, v = qkv(batch=3, heads_kv=2)
    mask = key_padding(3, 9, [9, 4, 6])
    want = reference(q, k, v, mask, causal, None)
    if causal:
        want = want * mask[:, 0, 0, :, None, None]
    close(kernel(q, k, v, mask, causal, None), want)


def test_backward() -> None:
    """aiter's FlashAttnFunc asserts return_lse whenever an input requires grad
    (issue 31): the adapter asks for the lse, so training runs."""
    dense, _ = _adapters()
    q, k, v = qkv(heads_kv=2, grad=True)
    grads_close(
        lambda: dense(q, k, v, None, True, None),
        lambda a, b, c: reference(a, b, c, None, True, None),
        (q, k, v),
    )


def test_backward_through_varlen() -> None:
    dense, varlen = _adapters()
    kernel = padded_kernel("aiter", dense, lambda: varlen)
    q, k, v = qkv(batch=2, grad=True)
    mask = key_padding(2, 9, [9, 5])
    grads_close(
        lambda: kernel(q, k, v, mask, False, None),
        lambda a, b, c: reference(a, b, c, mask, False, None),
        (q, k, v),
    )


def test_the_wrapper_itself_refuses_grad_without_return_lse() -> None:
    """What the adapter must avoid, seen in aiter's own code."""
    import aiter

    q, k, v = qkv(grad=True)
    with pytest.raises(AssertionError):
        aiter.flash_attn_func(q, k, v)
    assert isinstance(aiter.flash_attn_func(q.detach(), k.detach(), v.detach()), torch.Tensor)


def test_a_missing_return_lse_fails_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter as it was (no return_lse): aiter's own forward asserts it as
    soon as an input requires grad, and the backward tests fail."""
    from attnres.kernels import aiter

    monkeypatch.setattr(aiter, "takes_keywords", lambda fn, *names: False)
    with pytest.raises(AssertionError):
        test_backward()
    with pytest.raises(AssertionError):
        test_backward_through_varlen()


def test_int64_cu_seqlens_fail_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnres.kernels import _common

    monkeypatch.setattr(_common, "_int32", lambda cu: cu.long())
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        test_key_padding_through_varlen(False)
