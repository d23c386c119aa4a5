"""``aiter``: AMD aiter flash attention (``aiter.flash_attn_func``, ROCm).

Source facts (ROCm/aiter aiter/ops/mha.py, re-exported as ``aiter.flash_attn_func``):
- ``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
  window_size=(-1, -1), bias=None, alibi_slopes=None, deterministic=True,
  return_lse=False, return_attn_probs=False)`` (``bias`` appeared in 2025;
  older releases lack it); layout (batch, seqlen, nheads, headdim), GQA with
  nheads % nheads_k == 0;
- return value: current releases return ``out`` alone unless ``return_lse`` /
  ``return_attn_probs`` (``result[0] if len(result) == 1 else tuple(result)``);
  older ones returned ``tuple(result)`` -- a 1-tuple ``(out,)``. The adapter
  accepts both;
- fp16/bf16 only (kernels are generated per dtype); head dim <= 256, padded to a
  multiple of 8 by the wrapper;
- ``causal=True`` is bottom-right aligned when seqlen_q != seqlen_k (docstring):
  causal with seq_q != seq_kv is refused;
- ``bias`` is a single (seqlen_q, seqlen_k) tensor, not SDPA's broadcastable
  mask, and is missing in older releases: ``attn_mask`` is refused (the
  catalogue does not list attention masks for aiter);
- ``window_size=(left, right)`` (-1 unbounded) is sliding-window attention,
  bottom-right aligned like causal; there is no softcap argument.
- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, min_seqlen_q=0, dropout_p=0.0, softmax_scale=None,
  logits_soft_cap=0.0, causal=False, ...)`` (aiter/ops/mha.py at e4048607):
  packed (total, nheads, headdim) tensors, "cu_seqlens_q: (batch_size + 1,),
  dtype dtypes.i32"; csrc/py_itfs_ck/mha_varlen_fwd_kernels.cu checks
  "cu_seqlens_q must have dtype int32", contiguous cu_seqlens, "FlashAttention
  only support fp16, bf16 and fp8_e4m3 data type", "CK only supports head
  dimension at most 256"; returns ``out`` alone unless ``return_lse`` /
  ``return_attn_probs``; causal is bottom-right per sequence. ``min_seqlen_q``
  sits before ``dropout_p`` (unlike flash-attn's), so the adapter passes
  everything after the lengths by keyword.
- ``FlashAttnFunc.forward`` and ``FlashAttnVarlenFunc.forward`` ``assert
  return_lse`` whenever an input requires grad (amd-aiter 0.1.7.post2.dev18,
  upstream since 2025-08: the backward reads the saved lse), so the adapter
  passes ``return_lse=True`` wherever the function takes it (issue 31; the
  ``(out, lse)`` result is unwrapped to ``out``). Tested through that
  release's own ``aiter/ops/mha.py`` (tests/kernels/test_real_aiter.py).
- Install: ``pip install amd-aiter`` or build ROCm/aiter from source. The
  unrelated PyPI package ``aiter`` (async iterators) imports under the same
  name and has no ``flash_attn_func``: that case is reported as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnres.kernels._common import (
    flash_call,
    flash_style_kernel,
    flash_varlen_call,
    kernel_function,
    takes_keywords,
    varlen_style_kernel,
)

if TYPE_CHECKING:
    from attnres.kernels import KernelFn, VarlenKernelFn

__all__ = ["make_kernel", "make_varlen_kernel"]

BACKEND = "aiter"
PACKAGE = "aiter"
INSTALL = "pip install amd-aiter  (or build https://github.com/ROCm/aiter; needs ROCm)"
_NOT_AMD = (
    "This is probably the unrelated PyPI package 'aiter' (async iterators), not AMD "
    "aiter; install AMD's with: " + INSTALL
)


def _function(name: str) -> tuple[Any, dict[str, Any]]:
    """aiter's function ``name``, and ``return_lse=True`` where it takes it (issue 31:
    the lse the backward needs, asserted whenever an input requires grad)."""
    function = kernel_function(PACKAGE, name, backend=BACKEND, install=INSTALL, hint=_NOT_AMD)
    return function, {"return_lse": True} if takes_keywords(function, "return_lse") else {}


def make_kernel() -> KernelFn:
    """Import aiter and bind ``flash_attn_func``."""
    flash_attn_func, lse = _function("flash_attn_func")
    return flash_style_kernel(
        BACKEND,
        "aiter.flash_attn_func takes no SDPA-style mask",
        flash_call(flash_attn_func, dropout_p=0.0, **lse),  # softcap is refused (takes)
        takes=frozenset({"window"}),
    )


def make_varlen_kernel() -> VarlenKernelFn:
    """Import aiter and bind ``flash_attn_varlen_func`` (packed sequences).

    The varlen calling convention of :func:`attnres.kernels._common.varlen_style_kernel`
    (int32 contiguous ``cu_seqlens``, as aiter checks); its causal mask is
    bottom-right per sequence.
    """
    varlen_func, lse = _function("flash_attn_varlen_func")
    return varlen_style_kernel(flash_varlen_call(varlen_func, dropout_p=0.0, **lse))
