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

The registry maps a backend name to a built kernel. A backend's spec names its
adapter (``BackendSpec.kernel``, a lazy ``"module:factory"`` string built on
first :func:`get_kernel`); third-party kernels come in through
:func:`register_kernel`, which overrides the spec's adapter.
:func:`kernel_source` says which of the two serves a backend, or that none
does: sparse backends ship no adapter (their kernels need layout metadata this
convention does not carry), and :func:`get_kernel` returns ``None`` for them.
A registration change is a registry change (:func:`attnres.backends.kernels_changed`):
the resolver, which checks that a layer that will run gets a backend with a
kernel, forgets its cached answers.

Adapters import nothing from attnres outside this package; the registry reads
the backend catalogue (:mod:`attnres.backends`, which imports no torch).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, Union

from attnres._states import KernelSource
from attnres.backends import BUILTIN_SPECS, kernels_changed, lookup_spec, registered_backends
from attnres.backends import Backend as _Backend
from attnres.errors import ArgumentTypeError, InvalidArgumentError
from attnres.kernels._common import KernelUnavailableError, keeps_empty_keys

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "SPARSE_BACKENDS",
    "KernelFn",
    "KernelSource",
    "KernelUnavailableError",
    "VarlenKernelFn",
    "clear_kernel_cache",
    "get_kernel",
    "kernel_names",
    "kernel_source",
    "register_kernel",
    "specialized",
    "unregister_kernel",
]

#: ``attention(q, k, v, attn_mask, causal, scale) -> out`` (see the module docstring).
KernelFn = Callable[
    ["Tensor", "Tensor", "Tensor", Union["Tensor", None], bool, float | None], "Tensor"
]


class VarlenKernelFn(Protocol):
    """``attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
    scale, **options) -> out`` over packed ``(total_tokens, heads, head_size)`` tensors
    (:func:`attnres.kernels.fa.make_varlen_kernel`); ``options``: the backend's
    validated options (issue 23, ``BackendSpec.options``), only when set.

    A kernel that also takes ``seqused_q``/``seqused_k`` keywords (FA3's and
    FA4's meaning: sequence ``i`` is the ``seqused[i]`` tokens from
    ``cu_seqlens[i]`` on) says so with an attribute ``takes_seqused = True``
    (:class:`attnres.kernels._common.VarlenAdapter` sets it from the package
    function's signature); the key-padding route then hands it a batch whose
    valid tokens are one run per row where it lies (docs/masks.md)."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        scale: float | None,
        /,
        **options: Any,
    ) -> Tensor: ...


#: Sparse backends of the built-in catalogue (derived from ``BackendSpec.sparse``):
#: they ship no dense adapter, ``get_kernel`` answers ``None``.
SPARSE_BACKENDS: frozenset[str] = frozenset(s.name for s in BUILTIN_SPECS if s.sparse)

_lock = threading.Lock()
# name -> a kernel given to register_kernel (a callable or a lazy "module:factory")
_entries: dict[str, KernelFn | str] = {}
# name -> the spec adapter removed with unregister_kernel (a spec registered
# afterwards with another adapter is served again: the removal was of the old one)
_removed: dict[str, str | None] = {}
# (name, lazy entry) -> the kernel built from it: a spec replaced with another
# adapter string (register_backend(..., replace=True)) is another key
_built: dict[tuple[str, str], KernelFn] = {}


def _spec_adapter(key: str) -> str | None:
    """The adapter the registered spec of ``key`` names, if any."""
    spec = lookup_spec(_Backend(key)) if key else None
    return None if spec is None else spec.kernel


def _entry(key: str) -> KernelFn | str | None:
    """What serves ``key``: a registration, else the spec's adapter (caller holds _lock)."""
    entry = _entries.get(key)
    if entry is not None or _is_removed(key):
        return entry
    return _spec_adapter(key)


def _is_removed(key: str) -> bool:
    """Whether ``key``'s current spec adapter was removed with unregister_kernel."""
    return key in _removed and _removed[key] == _spec_adapter(key)


def _forget_built(key: str) -> None:
    """Drop what was built for ``key`` (caller holds _lock): a registration builds anew."""
    for built in [b for b in _built if b[0] == key]:
        del _built[built]


def _key(backend_name: str) -> str:
    if not isinstance(backend_name, str):
        raise ArgumentTypeError(f"backend_name must be a str, got {type(backend_name).__name__}")
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
        raise InvalidArgumentError("backend_name must not be empty")
    if isinstance(fn, str):
        module, sep, factory = fn.partition(":")
        if not (module and sep and factory):
            raise InvalidArgumentError(
                f"a lazy kernel must be 'package.module:factory', got {fn!r}"
            )
    elif not callable(fn):
        raise ArgumentTypeError(
            f"fn must be a kernel callable or a 'module:factory' string, got {fn!r}"
        )
    with _lock:
        current = _entry(key)
        if current is not None and not replace and not (key not in _entries and fn == current):
            # (registering the adapter that serves the name already is no change)
            raise InvalidArgumentError(
                f"a kernel is already registered for backend {key!r}; "
                "pass replace=True to override it"
            )
        # (a removed adapter stays removed under the registration: unregistering
        # it later brings back what served the name before it, nothing more)
        _entries[key] = fn
        _forget_built(key)
    kernels_changed()


def unregister_kernel(backend_name: str) -> None:
    """Forget the kernel of ``backend_name``; unknown names are ignored.

    A kernel given to :func:`register_kernel` is forgotten, and what served the
    name before it serves again: a built-in adapter it replaced
    (``replace=True``) is restored, never deleted with it. With no registration,
    the spec's own adapter is removed; it can be put back with
    ``register_kernel(name, "attnres.kernels.<module>:make_kernel")`` (its
    :func:`kernel_source` is then ``builtin`` again).
    """
    key = _key(backend_name)
    with _lock:
        if _entries.pop(key, None) is None:
            _removed[key] = _spec_adapter(key)
        _forget_built(key)
    kernels_changed()


def get_kernel(backend_name: str) -> KernelFn | None:
    """The kernel for ``backend_name``, built on first use and cached.

    ``None`` for a sparse backend and for a name without an adapter. A kernel
    whose package cannot be imported raises :class:`KernelUnavailableError`
    (an ``ImportError``) naming the package and how to install it; the failure
    is not cached.
    """
    key = _key(backend_name)
    with _lock:
        entry = _entry(key)
        built = None if not isinstance(entry, str) else _built.get((key, entry))
    if entry is None or not isinstance(entry, str):
        return entry
    if built is not None:
        return built
    module_name, _, factory_name = entry.partition(":")
    factory: Callable[[], KernelFn] = getattr(importlib.import_module(module_name), factory_name)
    # issue 30: every adapter answers a call with no keys as torch SDPA does
    kernel = keeps_empty_keys(factory())
    with _lock:
        if _entry(key) == entry:  # not replaced while we were building
            kernel = _built.setdefault((key, entry), kernel)
    return kernel


def specialized(
    kernel: KernelFn,
    causal: bool,
    scale: float | None,
    gqa: bool,
    *,
    softcap: float = 0.0,
    window: tuple[int, int] | None = None,
    options: tuple[tuple[str, object], ...] = (),
) -> Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]:
    """``kernel`` with a layer's fixed settings bound: ``fn(q, k, v, attn_mask)``.

    ``softcap`` (0: off) and ``window`` (``None``: off) reach the kernel as
    keyword arguments, and only when set; so do ``options``, the backend's
    validated options (issue 23, ``BackendSpec.options``), bound here once.
    """
    if softcap or window is not None or options:
        features: dict[str, object] = dict(options)
        if softcap:
            features["softcap"] = softcap
        if window is not None:
            features["window"] = window
        general: Callable[..., Tensor] = kernel

        def call_with_features(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
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


def kernel_source(backend_name: str) -> KernelSource:
    """Whether a kernel serves ``backend_name`` in this process, and whose.

    ``registered``: a kernel given to :func:`register_kernel` (one that
    re-registers the spec's own adapter string counts as ``builtin``);
    ``builtin``: the adapter the backend's spec names; ``none``: no kernel (a
    sparse backend, a plugin backend registered without one, or an adapter
    removed with :func:`unregister_kernel`). Nothing is imported: a ``builtin``
    kernel whose package is missing is the platform check's business.
    """
    key = _key(backend_name)
    with _lock:
        entry = _entries.get(key)
        removed = _is_removed(key)
    adapter = _spec_adapter(key)
    if entry is not None:
        return KernelSource.BUILTIN if entry == adapter else KernelSource.REGISTERED
    if removed or adapter is None:
        return KernelSource.NONE
    return KernelSource.BUILTIN


def kernel_names() -> tuple[str, ...]:
    """The backend names that have a kernel (registered or named by a spec), sorted."""
    with _lock:
        named = {
            s.name
            for s in registered_backends()
            if s.kernel is not None and not _is_removed(s.name)
        }
        return tuple(sorted(named | set(_entries)))


def clear_kernel_cache() -> None:
    """Drop the kernels built from lazy entries; the next :func:`get_kernel` imports again.

    For tests, and for a process that installs a kernel package after startup. It
    is a registry change (:func:`attnres.backends.kernels_changed`): every cache
    that holds a kernel (the layers' construction memos, per-request and
    training bindings) is invalidated with it, so a layer built afterwards never
    runs a kernel built before. Layers built earlier keep the kernel they bound.
    """
    with _lock:
        _built.clear()
    kernels_changed()
