"""Helpers shared by the kernel adapters (private).

Nothing here imports torch or any kernel package (``import attnres.kernels``
stays light): the kernel packages are imported inside ``make_kernel()``, and the
per-call helpers work through the methods of the tensors they are given.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "KernelUnavailableError",
    "causal_alignment_error",
    "flash_style_kernel",
    "import_kernel_package",
    "mask_with_causal",
    "no_mask_error",
    "require_attribute",
]


class KernelUnavailableError(ImportError):
    """The package a kernel adapter needs cannot be imported (or is the wrong one).

    An ``ImportError`` so that ``except ImportError`` keeps working; the message
    names the backend, the package and how to install it.
    """


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


def no_mask_error(backend: str, detail: str) -> ValueError:
    """The error an adapter raises when a kernel cannot take ``attn_mask``."""
    return ValueError(
        f"attention backend {backend!r} does not support attn_mask ({detail}); "
        "resolve the layer with the attn_mask requirement so that a backend that "
        "implements attention masks (torch_sdpa, flex_attention, xformers, eager) is chosen"
    )


def causal_alignment_error(backend: str, seq_q: int, seq_kv: int) -> ValueError:
    """The error for causal attention with ``seq_q != seq_kv`` on a bottom-right kernel."""
    return ValueError(
        f"attention backend {backend!r} aligns its causal mask to the bottom-right corner "
        f"when seq_q != seq_kv (here {seq_q} != {seq_kv}), while attnres layers use the "
        "top-left alignment of torch SDPA's is_causal; refusing to return different "
        "numbers. Use torch_sdpa, flex_attention, xformers or eager for this layer"
    )


def flash_style_kernel(
    backend: str,
    mask_detail: str,
    call: Callable[[Tensor, Tensor, Tensor, bool, float | None], Any],
) -> Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float | None], Tensor]:
    """The adapter shape shared by the flash-attn family, aiter and SageAttention.

    They take (batch, seq, heads, head_size) as is, take no SDPA-style mask, and
    align a causal mask bottom-right when lengths differ, so the adapter refuses
    both cases rather than return other numbers. ``call(q, k, v, causal, scale)``
    is the kernel call; a tuple result (``(out, lse)`` in some releases) is
    unwrapped to ``out``.
    """

    def attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        causal: bool,
        scale: float | None,
    ) -> Tensor:
        if attn_mask is not None:
            raise no_mask_error(backend, mask_detail)
        if causal and q.shape[1] != k.shape[1]:
            raise causal_alignment_error(backend, q.shape[1], k.shape[1])
        result = call(q, k, v, causal, scale)
        out: Tensor = result[0] if isinstance(result, tuple) else result
        return out

    return attention


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
