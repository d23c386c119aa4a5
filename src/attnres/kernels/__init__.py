"""Kernel adapters: one small module per attention-kernel family, and their registry.

Every adapter exposes ``make_kernel() -> KernelFn``. ``make_kernel`` imports the
kernel package (lazily: importing :mod:`attnres.kernels` imports no optional
package) and returns a function bound to the imported kernel, so a call does no
import, lookup or dispatch of its own. The calling convention is fixed::

    attention(q, k, v, attn_mask, causal, scale) -> Tensor
    # q: (batch, seq_q, heads_q, head_size)
    # k, v: (batch, seq_kv, heads_kv, head_size), heads_q % heads_kv == 0
    # attn_mask: None, or torch SDPA semantics (bool: True takes part; float: added),
    #            broadcastable to (batch, heads_q, seq_q, seq_kv)
    # causal: top-left aligned, like SDPA's is_causal; scale: None = 1/sqrt(head_size)
    # returns (batch, seq_q, heads_q, head_size) in q's dtype

A kernel whose backend implements ``softcap`` or ``sliding_window`` also takes
them as keyword arguments, passed only to layers that use them (so a kernel
without them keeps the six-argument convention)::

    attention(q, k, v, attn_mask, causal, scale, softcap=30.0)  # scores -> 30 * tanh(scores / 30)
    attention(q, k, v, attn_mask, causal, scale, window=(left, right))
    # query i sees keys i - left .. i + right (-1: unbounded), top-left aligned like causal

A kernel may also carry a ``specialize(causal, scale, gqa)`` attribute that
returns ``attention(q, k, v, attn_mask) -> Tensor`` with the layer's fixed
settings bound (no per-call argument plumbing); :func:`specialized` uses it when
present and otherwise wraps the general kernel. ``gqa`` says whether the layer
has fewer key/value heads than query heads.

The registry maps a backend name to a built kernel. Built-in adapters are
registered by name as ``"module:factory"`` strings and built on first
:func:`get_kernel`; third-party kernels come in through :func:`register_kernel`.
Sparse backends have no adapter here (their kernels need layout metadata this
convention does not carry): :func:`get_kernel` returns ``None`` for them.

Kernels import nothing from attnres outside this package.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Union

from attnres.kernels._common import KernelUnavailableError

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "SPARSE_BACKENDS",
    "KernelFn",
    "KernelUnavailableError",
    "VarlenKernelFn",
    "clear_kernel_cache",
    "get_kernel",
    "kernel_names",
    "register_kernel",
    "specialized",
    "unregister_kernel",
]

#: ``attention(q, k, v, attn_mask, causal, scale) -> out`` (see the module docstring).
KernelFn = Callable[
    ["Tensor", "Tensor", "Tensor", Union["Tensor", None], bool, float | None], "Tensor"
]

#: ``attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
#: scale) -> out`` over packed ``(total_tokens, heads, head_size)`` tensors
#: (:func:`attnres.kernels.fa.make_varlen_kernel`).
VarlenKernelFn = Callable[
    ["Tensor", "Tensor", "Tensor", "Tensor", "Tensor", int, int, bool, float | None],
    "Tensor",
]

#: Sparse backends of the catalogue: no dense adapter, ``get_kernel`` answers ``None``.
SPARSE_BACKENDS: frozenset[str] = frozenset(
    {"sliding_tile_attn", "video_sparse_attn", "vmoba_attn", "sparse_video_gen_2_attn"}
)

_BUILTIN: dict[str, str] = {
    "torch_sdpa": "attnres.kernels.torch_sdpa:make_kernel",
    "eager": "attnres.kernels.eager:make_kernel",
    "torch_cudnn_sdpa": "attnres.kernels.torch_cudnn_sdpa:make_kernel",
    "flex_attention": "attnres.kernels.flex_attention:make_kernel",
    "fa": "attnres.kernels.fa:make_kernel",
    "fa3": "attnres.kernels.fa3:make_kernel",
    "fa4": "attnres.kernels.fa4:make_kernel",
    "sage_attn": "attnres.kernels.sage_attn:make_kernel",
    "xformers": "attnres.kernels.xformers:make_kernel",
    "aiter": "attnres.kernels.aiter:make_kernel",
}

_lock = threading.Lock()
# name -> a kernel callable, or a lazy "module:factory" string
_entries: dict[str, KernelFn | str] = dict(_BUILTIN)
# name -> the kernel built from a lazy entry
_built: dict[str, KernelFn] = {}


def _key(backend_name: str) -> str:
    if not isinstance(backend_name, str):
        raise TypeError(f"backend_name must be a str, got {type(backend_name).__name__}")
    return backend_name.strip().lower().replace("-", "_")


def register_kernel(backend_name: str, fn: KernelFn | str, *, replace: bool = False) -> None:
    """Register the kernel for ``backend_name`` (matched case-insensitively).

    ``fn`` is either a callable following the calling convention, or a lazy
    ``"package.module:factory"`` string whose zero-argument factory returns one
    (imported on the first :func:`get_kernel`). Registering a name that already
    has a kernel is a ``ValueError`` unless ``replace=True``.
    """
    key = _key(backend_name)
    if not key:
        raise ValueError("backend_name must not be empty")
    if isinstance(fn, str):
        module, sep, factory = fn.partition(":")
        if not (module and sep and factory):
            raise ValueError(f"a lazy kernel must be 'package.module:factory', got {fn!r}")
    elif not callable(fn):
        raise TypeError(f"fn must be a kernel callable or a 'module:factory' string, got {fn!r}")
    with _lock:
        if key in _entries and not replace:
            raise ValueError(
                f"a kernel is already registered for backend {key!r}; "
                "pass replace=True to override it"
            )
        _entries[key] = fn
        _built.pop(key, None)


def unregister_kernel(backend_name: str) -> None:
    """Forget the kernel of ``backend_name``; unknown names are ignored.

    A built-in adapter can be put back with
    ``register_kernel(name, "attnres.kernels.<module>:make_kernel")``.
    """
    key = _key(backend_name)
    with _lock:
        _entries.pop(key, None)
        _built.pop(key, None)


def get_kernel(backend_name: str) -> KernelFn | None:
    """The kernel for ``backend_name``, built on first use and cached.

    ``None`` for a sparse backend and for a name without an adapter. A kernel
    whose package cannot be imported raises :class:`KernelUnavailableError`
    (an ``ImportError``) naming the package and how to install it; the failure
    is not cached.
    """
    key = _key(backend_name)
    with _lock:
        entry = _entries.get(key)
        built = _built.get(key)
    if entry is None or not isinstance(entry, str):
        return entry
    if built is not None:
        return built
    module_name, _, factory_name = entry.partition(":")
    factory: Callable[[], KernelFn] = getattr(importlib.import_module(module_name), factory_name)
    kernel = factory()
    with _lock:
        if _entries.get(key) == entry:  # not replaced while we were building
            kernel = _built.setdefault(key, kernel)
    return kernel


def specialized(
    kernel: KernelFn,
    causal: bool,
    scale: float | None,
    gqa: bool,
    *,
    softcap: float = 0.0,
    window: tuple[int, int] | None = None,
) -> Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]:
    """``kernel`` with a layer's fixed settings bound: ``fn(q, k, v, attn_mask)``.

    ``softcap`` (0: off) and ``window`` (``None``: off) reach the kernel as
    keyword arguments, and only when set.
    """
    if softcap or window is not None:
        features: dict[str, object] = {}
        if softcap:
            features["softcap"] = softcap
        if window is not None:
            features["window"] = window
        general: Callable[..., Tensor] = kernel

        def call_with_features(
            q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None
        ) -> Tensor:
            return general(q, k, v, attn_mask, causal, scale, **features)

        return call_with_features
    specialize = getattr(kernel, "specialize", None)
    if specialize is not None:
        bound: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
        bound = specialize(causal, scale, gqa)
        return bound

    def call(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
        return kernel(q, k, v, attn_mask, causal, scale)

    return call


def kernel_names() -> tuple[str, ...]:
    """The backend names that have a kernel (built or lazy), sorted."""
    with _lock:
        return tuple(sorted(_entries))


def clear_kernel_cache() -> None:
    """Drop the kernels built from lazy entries; the next :func:`get_kernel` imports again.

    For tests, and for a process that installs a kernel package after startup.
    """
    with _lock:
        _built.clear()
