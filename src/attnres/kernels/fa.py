"""``fa``: flash-attn 2.x (``flash_attn.flash_attn_func`` / ``flash_attn_varlen_func``).

Source facts (Dao-AILab/flash-attention, flash_attn/flash_attn_interface.py and
csrc/flash_attn/flash_api.cpp):
- ``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
  return_attn_probs=False)``; q (batch, seqlen, nheads, headdim), k/v (batch,
  seqlen_k, nheads_k, headdim) -- attnres's layout, no transpose; returns ``out``
  only unless ``return_attn_probs`` (then ``(out, softmax_lse, S_dmask)``);
- GQA/MQA: nheads % nheads_k == 0, query heads grouped like repeat_interleave
  ("Number of heads in key/value must divide number of heads in query");
- "FlashAttention only support fp16 and bf16 data type"; "FlashAttention forward
  only supports head dimension at most 256"; the Python wrapper pads head dims
  that are not a multiple of 8;
- ``causal=True`` is aligned to the BOTTOM-RIGHT corner when seqlen_q != seqlen_k
  (docstring of flash_attn_func). attnres is top-left, so causal with
  seq_q != seq_kv is refused here (same numbers when the lengths are equal);
- no attention mask argument at all (only ALiBi slopes): ``attn_mask`` is a
  ``ValueError``;
- ``window_size=(left, right)`` (-1: unbounded) is sliding-window attention,
  bottom-right aligned like causal (refused when seq_q != seq_kv); ``softcap``
  (> 0: on; flash-attn >= 2.6) caps the scaled scores, ``softcap *
  tanh(scores / softcap)``, before the softmax. Both are passed only when set;
- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, ...)`` takes
  packed (total, nheads, headdim) tensors and cumulative lengths of shape
  (batch + 1,) with "dtype torch.int32"; its causal mask is bottom-right per
  sequence.
- Install: ``pip install flash-attn --no-build-isolation``. flash-attn-4 also
  installs under the ``flash_attn`` name (only ``flash_attn.cute``), so a
  ``flash_attn`` without ``flash_attn_func`` is reported as that case.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnres.kernels._common import (
    flash_call,
    flash_style_kernel,
    flash_varlen_call,
    kernel_function,
    varlen_style_kernel,
)

if TYPE_CHECKING:
    from attnres.kernels import KernelFn, VarlenKernelFn

__all__ = ["make_kernel", "make_varlen_kernel"]

BACKEND = "fa"
_TAKES = frozenset({"softcap", "window"})
PACKAGE = "flash_attn"
INSTALL = "pip install flash-attn --no-build-isolation  (flash-attn 2.x; needs CUDA or ROCm)"
_NOT_FA2 = (
    "This is not flash-attn 2.x: flash-attn-4 installs only 'flash_attn.cute' under the same "
    "name (use backend 'fa4' for it), or the flash_attn build is broken. Install flash-attn 2 "
    "with: " + INSTALL
)


def _function(name: str) -> Any:
    return kernel_function(PACKAGE, name, backend=BACKEND, install=INSTALL, hint=_NOT_FA2)


def make_kernel() -> KernelFn:
    """Import flash_attn and bind ``flash_attn_func``; it takes the spec's options
    (issue 23: ``deterministic``)."""
    call = flash_call(_function("flash_attn_func"), dropout_p=0.0)
    return flash_style_kernel(BACKEND, "flash_attn_func has no mask argument", call, takes=_TAKES)


def make_varlen_kernel() -> VarlenKernelFn:
    """Import flash_attn and bind ``flash_attn_varlen_func`` (packed sequences).

    The returned function takes q (total_q, heads_q, head_size), k/v (total_kv,
    heads_kv, head_size), cumulative sequence lengths of shape (batch + 1,) (any
    integer dtype: they are passed on as contiguous int32, as flash-attn
    requires), the longest q/kv sequence lengths, ``causal`` and ``scale``. Its
    causal mask is flash-attn's: bottom-right aligned within each sequence; it
    takes the spec's options (issue 23: ``deterministic``).
    """
    return varlen_style_kernel(
        flash_varlen_call(_function("flash_attn_varlen_func"), dropout_p=0.0)
    )
