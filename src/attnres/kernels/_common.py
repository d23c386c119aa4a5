"""Helpers shared by the kernel adapters (private).

Nothing here imports torch or any kernel package (``import attnres.kernels``
stays light): the kernel packages are imported inside ``make_kernel()``, and the
per-call helpers work through the methods of the tensors they are given.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

# re-exported: attnres.errors holds every exception
from attnres.errors import ArgumentTypeError, InvalidArgumentError, KernelUnavailableError

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "KernelUnavailableError",
    "VarlenAdapter",
    "causal_alignment_error",
    "flash_call",
    "flash_style_kernel",
    "flash_varlen_call",
    "import_kernel_package",
    "keeps_empty_keys",
    "kernel_function",
    "mask_with_causal",
    "no_keys_output",
    "no_mask_error",
    "require_attribute",
    "sdpa_style_mask",
    "takes_keywords",
    "unsupported_feature_error",
    "varlen_style_kernel",
    "window_keep",
    "with_window",
]


def import_kernel_package(module: str, *, backend: str, install: str) -> ModuleType:
    """Import ``module`` for ``backend``, or raise :class:`KernelUnavailableError`.

    Any import-time fault counts: a missing package (``ImportError``), a build
    against another torch (``ImportError``/``OSError`` "undefined symbol"), or a
    package whose import raises ``RuntimeError`` (no GPU, bad driver).
    """
    try:
        return importlib.import_module(module)
    except (ImportError, OSError, RuntimeError) as exc:
        raise KernelUnavailableError(
            f"attention backend {backend!r} needs the Python package {module!r}, which "
            f"cannot be imported ({type(exc).__name__}: {exc}). Install it with: {install}",
            name=module,
        ) from exc


def kernel_function(package: str, name: str, *, backend: str, install: str, hint: str) -> Any:
    """``name`` of the kernel package ``package`` (:func:`import_kernel_package`,
    then :func:`require_attribute` with ``hint``)."""
    module = import_kernel_package(package, backend=backend, install=install)
    return require_attribute(module, name, backend=backend, hint=hint)


def require_attribute(module: ModuleType, attribute: str, *, backend: str, hint: str) -> Any:
    """``module.attribute``, or :class:`KernelUnavailableError` explaining ``hint``."""
    value = getattr(module, attribute, None)
    if value is None:
        raise KernelUnavailableError(
            f"attention backend {backend!r}: the imported module {module.__name__!r} has no "
            f"{attribute!r}. {hint}",
            name=module.__name__,
        )
    return value


def no_mask_error(backend: str, detail: str) -> InvalidArgumentError:
    """The error an adapter raises when a kernel cannot take ``attn_mask``."""
    return InvalidArgumentError(
        f"attention backend {backend!r} does not support attn_mask ({detail}); "
        "resolve the layer with the attn_mask requirement so that a backend that "
        "implements attention masks (torch_sdpa, flex_attention, xformers, eager) is chosen"
    )


def causal_alignment_error(backend: str, seq_q: int, seq_kv: int) -> InvalidArgumentError:
    """The error for a causal mask or sliding window with ``seq_q != seq_kv`` on a
    bottom-right kernel."""
    return InvalidArgumentError(
        f"attention backend {backend!r} aligns its causal mask and sliding window to the "
        f"bottom-right corner when seq_q != seq_kv (here {seq_q} != {seq_kv}), while attnres "
        "layers use the top-left alignment of torch SDPA's is_causal; refusing to return "
        "different numbers. Use torch_sdpa, flex_attention, xformers or eager for this layer"
    )


def unsupported_feature_error(backend: str, feature: str) -> InvalidArgumentError:
    """The error for ``softcap`` or ``window`` given to a kernel that has no such argument."""
    requirement = {"softcap": "softcap", "window": "sliding_window"}[feature]
    return InvalidArgumentError(
        f"attention backend {backend!r} does not take {feature} (the kernel has no such "
        f"argument); resolve the layer with the {requirement} requirement so that a backend "
        f"that implements it is chosen"
    )


#: What a flash-style kernel call receives: q, k, v, causal, scale, softcap (0.0:
#: off) and window ((left, right), -1 unbounded; None: off), then the backend's
#: options (issue 23; only those its spec declares) as keyword arguments.
FlashCall = Callable[..., Any]


def flash_style_kernel(
    backend: str,
    mask_detail: str,
    call: FlashCall,
    *,
    takes: frozenset[str] = frozenset(),
) -> Callable[..., Tensor]:
    """The adapter shape shared by the flash-attn family, aiter and SageAttention.

    They take (batch, seq, heads, head_size) as is, take no SDPA-style mask, and
    align a causal mask (and a sliding window) bottom-right when lengths differ,
    so the adapter refuses these cases rather than return other numbers.
    ``call(q, k, v, causal, scale, softcap, window)`` is the kernel call; a tuple
    result (``(out, lse)`` in some releases) is unwrapped to ``out``. ``takes``
    names the optional features the kernel has arguments for (``"softcap"``,
    ``"window"``); any other one given is a ``ValueError``. Other keyword
    arguments are the backend's options (``BackendSpec.options``, checked when
    the layer was built) and go to ``call`` as they are.
    """

    def attention(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
        scale: float | None, *, softcap: float = 0.0, window: tuple[int, int] | None = None,
        **options: Any,
    ) -> Tensor:  # fmt: skip
        if attn_mask is not None:
            raise no_mask_error(backend, mask_detail)
        if softcap and "softcap" not in takes:
            raise unsupported_feature_error(backend, "softcap")
        if window is not None and "window" not in takes:
            raise unsupported_feature_error(backend, "window")
        if (causal or window is not None) and q.shape[1] != k.shape[1]:
            raise causal_alignment_error(backend, q.shape[1], k.shape[1])
        result = call(q, k, v, causal, scale, softcap, window, **options)
        out: Tensor = result[0] if isinstance(result, tuple) else result
        return out

    return attention


#: What a varlen kernel call receives: packed q, k, v, int32 contiguous
#: cu_seqlens_q/k, max_seqlen_q/k as ints, causal, scale, and the backend's
#: options as keyword arguments (issue 23; only those its spec declares).
VarlenCall = Callable[..., Any]


def _int32(cu: Tensor) -> Tensor:
    """``cu`` as contiguous int32 (what flash-attn requires), without importing torch."""
    if str(cu.dtype) != "torch.int32":
        cu = cu.int()
    return cu if cu.is_contiguous() else cu.contiguous()


def takes_keywords(fn: Callable[..., Any], *names: str) -> bool:
    """Whether ``fn``'s signature names every one of ``names`` (False when it cannot
    be read, as for some compiled functions): what a package's function takes,
    observed rather than tabled."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in names)


class VarlenAdapter:
    """The varlen calling convention (:data:`attnres.kernels.VarlenKernelFn`) over
    ``call``: packed (total, heads, head_size) tensors, cumulative sequence
    lengths of shape (sequences + 1,) in any integer dtype (passed on as
    contiguous int32), the longest lengths, ``causal`` (bottom-right per
    sequence, the kernels' own) and ``scale``; keyword arguments are the
    backend's options (issue 23), passed on. A tuple result is unwrapped.

    ``takes_seqused``: the package's function takes ``seqused_q``/``seqused_k``
    (FlashAttention-3 and -4): sequence ``i`` is then the ``seqused[i]`` tokens
    from ``cu_seqlens[i]`` on, so a padded batch flattened to (batch * seq,
    heads, head_size) is served where it lies, with no gather (the span route
    of :mod:`attnres._varlen`). They are passed (as contiguous int32) only
    when given, and refused by an adapter whose function has no such
    arguments."""

    __slots__ = ("_call", "takes_seqused")

    def __init__(self, call: VarlenCall, *, takes_seqused: bool = False) -> None:
        self._call = call
        self.takes_seqused = takes_seqused

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
        max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float | None, /, *,
        seqused_q: Tensor | None = None, seqused_k: Tensor | None = None, **options: Any,
    ) -> Tensor:  # fmt: skip
        if seqused_q is not None or seqused_k is not None:
            if not self.takes_seqused:
                raise ArgumentTypeError("this varlen kernel takes no seqused_q/seqused_k")
            for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
                if used is not None:
                    options[name] = _int32(used)
        result = self._call(
            q, k, v, _int32(cu_seqlens_q), _int32(cu_seqlens_k), int(max_seqlen_q),
            int(max_seqlen_k), causal, scale, **options,
        )  # fmt: skip
        out: Tensor = result[0] if isinstance(result, tuple) else result
        return out


def varlen_style_kernel(call: VarlenCall, *, takes_seqused: bool = False) -> VarlenAdapter:
    """The :class:`VarlenAdapter` over ``call`` (``takes_seqused``: ``call`` passes
    ``seqused_q``/``seqused_k`` keywords on to a function that takes them)."""
    return VarlenAdapter(call, takes_seqused=takes_seqused)


def flash_feature_kwargs(
    softcap: float, window: tuple[int, int] | None, *, unbounded: int | None = -1
) -> dict[str, Any]:
    """The flash-style ``softcap=`` and ``window_size=`` keywords, only when set.

    Passed only when asked for: flash-attn before 2.6 has no ``softcap``
    keyword. ``unbounded`` is how the package spells an unbounded window side
    (-1 in flash-attn 2/3 and aiter, ``None`` in FA4).
    """
    extra: dict[str, Any] = {}
    if window is not None:
        left, right = window
        extra["window_size"] = (
            unbounded if left < 0 else left,
            unbounded if right < 0 else right,
        )
    if softcap:
        extra["softcap"] = softcap
    return extra


def flash_call(
    function: Callable[..., Any], *, unbounded: int | None = -1, **fixed: Any
) -> FlashCall:
    """The :data:`FlashCall` over a flash-attn style ``function(q, k, v,
    softmax_scale=, causal=, window_size=, softcap=, ...)``: the ``fixed`` keywords
    (``dropout_p=0.0``, ``return_lse=True``) and the backend's options are passed as
    they are, ``softcap`` and ``window`` only when set (:func:`flash_feature_kwargs`,
    ``unbounded`` as there)."""

    def call(
        q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, softcap: float,
        window: tuple[int, int] | None, **options: Any,
    ) -> Any:  # fmt: skip
        extra = flash_feature_kwargs(softcap, window, unbounded=unbounded)
        return function(q, k, v, softmax_scale=scale, causal=causal, **fixed, **extra, **options)

    return call


def flash_varlen_call(function: Callable[..., Any], **fixed: Any) -> VarlenCall:
    """The :data:`VarlenCall` over a flash-attn style ``function(q, k, v,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=,
    causal=, ...)``: the lengths positionally, the rest by keyword, with the
    ``fixed`` keywords and the backend's options as they are."""

    def call(
        q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
        causal: bool, scale: float | None, **options: Any,
    ) -> Any:  # fmt: skip
        return function(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal, **fixed,
            **options,
        )  # fmt: skip

    return call


def mask_with_causal(attn_mask: Tensor, seq_q: int, seq_kv: int) -> Tensor:
    """Fold a top-left causal mask into ``attn_mask`` (SDPA semantics kept).

    A boolean mask stays boolean (``True`` takes part); a float mask gets
    ``-inf`` above the diagonal. The result broadcasts like the input, with its
    last two dimensions widened to ``(seq_q, seq_kv)``. Tensor methods only: no
    import on this per-call path.
    """
    keep = attn_mask.new_ones((seq_q, seq_kv)).bool().tril()
    if attn_mask.is_floating_point():
        return attn_mask.masked_fill(~keep, float("-inf"))
    return attn_mask & keep


def window_keep(like: Tensor, seq_q: int, seq_kv: int, window: tuple[int, int]) -> Tensor:
    """The (seq_q, seq_kv) boolean mask of a sliding window, top-left aligned.

    Query ``i`` keeps keys ``i - left .. i + right`` (``-1``: unbounded on that
    side), on the diagonal SDPA's ``is_causal`` uses. Built with ``like``'s
    methods (its device): no import on this per-call path.
    """
    left, right = window
    keep = like.new_ones((seq_q, seq_kv)).bool()
    if right >= 0:
        keep = keep.tril(right)
    if left >= 0:
        keep = keep.triu(-left)
    return keep


def with_window(
    attn_mask: Tensor | None, like: Tensor, seq_q: int, seq_kv: int, window: tuple[int, int]
) -> Tensor:
    """``attn_mask`` (SDPA semantics, or ``None``) restricted to a sliding window.

    A boolean mask (or none) gives a boolean mask; a float mask gets ``-inf``
    outside the window. The result broadcasts like the input, its last two
    dimensions widened to ``(seq_q, seq_kv)``.
    """
    keep = window_keep(like, seq_q, seq_kv, window)
    if attn_mask is None:
        return keep
    if attn_mask.is_floating_point():
        return attn_mask.masked_fill(~keep, float("-inf"))
    return attn_mask & keep


def sdpa_style_mask(
    backend: str,
    q: Tensor,
    k: Tensor,
    attn_mask: Tensor | None,
    causal: bool,
    softcap: float,
    window: tuple[int, int] | None,
) -> tuple[Tensor | None, bool]:
    """``(attn_mask, causal)`` for a kernel that takes an SDPA-style mask but no
    softcap and no window argument (torch SDPA, xformers): ``softcap`` is refused,
    a ``window`` becomes a band in the mask (top-left aligned), and a causal
    layer's triangle is folded into the mask when there is one (``causal`` then
    ``False``; without a mask it stays the kernel's own flag)."""
    if softcap:
        raise unsupported_feature_error(backend, "softcap")
    if window is not None:
        attn_mask = with_window(attn_mask, q, q.shape[1], k.shape[1], window)
    if attn_mask is not None and causal:
        return mask_with_causal(attn_mask, q.shape[1], k.shape[1]), False
    return attn_mask, causal


def no_keys_output(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """What torch SDPA returns for a call with no keys (``seq_kv == 0``: Wan 2.x i2v's
    image cross-attention with zero image tokens): zeros of shape (batch, seq_q,
    heads, v's head size) in q's dtype, measured on CPU with torch 2.13 (no NaN, no
    error), and zero gradients. Computed as the two empty products, so autograd
    reaches q, k and v as it does through SDPA."""
    groups = q.shape[2] // k.shape[2]
    if groups != 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = q.transpose(1, 2) @ k.to(q.dtype).permute(0, 2, 3, 1)  # (B, H, seq_q, 0)
    return (scores @ v.to(q.dtype).transpose(1, 2)).transpose(1, 2)


def keeps_empty_keys(kernel: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``kernel`` answering a call with no keys as torch SDPA does
    (:func:`no_keys_output`) instead of reaching a kernel that fails on it (the
    eager reference's ``amax`` over an empty dimension; flash and sage kernels
    refuse a zero length). Applied once to every adapter :func:`get_kernel`
    builds; a ``specialize`` attribute is kept, its bound functions guarded too."""
    if getattr(kernel, "keeps_empty_keys", False):
        return kernel

    def attention(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if k.shape[1] == 0:
            return no_keys_output(q, k, v)
        return kernel(q, k, v, *args, **kwargs)

    attention.__dict__.update(getattr(kernel, "__dict__", {}))
    specialize = getattr(kernel, "specialize", None)
    if specialize is not None:

        def guarded(*args: Any, **kwargs: Any) -> Callable[..., Tensor]:
            return keeps_empty_keys(specialize(*args, **kwargs))

        attention.specialize = guarded  # type: ignore[attr-defined]
    attention.keeps_empty_keys = True  # type: ignore[attr-defined]
    attention.__wrapped__ = kernel  # type: ignore[attr-defined]  # inspect.unwrap finds it
    attention.__doc__ = kernel.__doc__
    return attention
