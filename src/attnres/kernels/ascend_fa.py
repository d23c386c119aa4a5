"""``ascend_fa``: Ascend NPU fused attention (``torch_npu.npu_fusion_attention``).

Source facts (Ascend/op-plugin docs, ``torch_npu.npu_fusion_attention``):
- ``npu_fusion_attention(query, key, value, head_num, input_layout, pse=None,
  padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0,
  pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
  prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
  gen_mask_parallel=True, sync=False)``; returns a tuple whose first item is
  the attention output (then softmax max/sum, softmax out, seed, offset,
  numels);
- ``input_layout="BSND"`` is (batch, seq, heads, head_dim) -- attnres's layout,
  no transpose; ``head_num`` is the number of query heads; key/value may have
  fewer heads (GQA, query heads a multiple of key/value heads);
- ``scale`` is a plain multiplier with default 1.0 (not 1/sqrt(d)): the adapter
  always passes it, ``1/sqrt(head_size)`` when the layer gives none;
- ``atten_mask`` is boolean with the OPPOSITE sense of torch SDPA: ``True``
  masks a position out. With ``sparse_mode=0`` it is a full mask, broadcastable
  as (S_q, S_kv), (B, 1, S_q, S_kv) or (B, N, S_q, S_kv). The adapter inverts an
  SDPA boolean mask and builds the top-left causal mask itself (so causal
  cross-attention keeps SDPA's alignment); a float (additive) mask has no
  equivalent here and is refused;
- dtypes fp16/bf16; head_dim a multiple of 16, at most 512 (catalogue).
- Install: ``pip install torch-npu`` matching the installed torch and CANN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnres.errors import InvalidArgumentError
from attnres.kernels._common import kernel_function

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]

BACKEND = "ascend_fa"
PACKAGE = "torch_npu"
INSTALL = "pip install torch-npu  (matching your torch and CANN; needs an Ascend NPU)"


def _masked_out(attn_mask: Tensor | None, causal: bool, q: Tensor, k: Tensor) -> Tensor | None:
    """The ``atten_mask`` npu_fusion_attention takes: ``True`` where a position is
    masked out, shaped (S_q, S_kv), (B, 1, S_q, S_kv) or (B, N, S_q, S_kv)."""
    batch, seq_q, heads = q.shape[0], q.shape[1], q.shape[2]
    seq_kv = k.shape[1]
    out: Tensor | None = None
    if attn_mask is not None:
        if attn_mask.is_floating_point():
            raise InvalidArgumentError(
                f"attention backend {BACKEND!r} takes boolean masks only "
                "(npu_fusion_attention has no additive mask); pass a boolean attn_mask "
                "(True takes part) or use torch_sdpa for this layer"
            )
        out = ~attn_mask.bool()
    if causal:
        # top-left aligned, like SDPA's is_causal (True above the diagonal)
        above = q.new_ones((seq_q, seq_kv)).bool().triu(1)
        out = above if out is None else out | above
    if out is None:
        return None
    if out.dim() <= 2:
        return out.expand(seq_q, seq_kv).contiguous()
    while out.dim() < 4:
        out = out.unsqueeze(0)
    mask_heads = heads if out.shape[1] != 1 else 1
    return out.expand(batch, mask_heads, seq_q, seq_kv).contiguous()


def make_kernel() -> KernelFn:
    """Import torch_npu and bind ``npu_fusion_attention`` (BSND layout)."""
    hint = "Reinstall it with: " + INSTALL
    fusion = kernel_function(
        PACKAGE, "npu_fusion_attention", backend=BACKEND, install=INSTALL, hint=hint
    )

    def attention(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
        scale: float | None,
    ) -> Tensor:  # fmt: skip
        result = fusion(
            q,
            k,
            v,
            q.shape[2],
            "BSND",
            atten_mask=_masked_out(attn_mask, causal, q, k),
            scale=q.shape[-1] ** -0.5 if scale is None else scale,
            keep_prob=1.0,
            sparse_mode=0,
        )
        out: Tensor = result[0] if isinstance(result, (tuple, list)) else result
        return out

    return attention
