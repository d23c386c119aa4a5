"""``xformers``: ``xformers.ops.memory_efficient_attention`` (cutlass/flash dispatch).

Source facts (facebookresearch/xformers xformers/ops/fmha/__init__.py,
attn_bias.py, common.py, dispatch/cutlass checks; docs at
facebookresearch.github.io/xformers):
- ``memory_efficient_attention(query, key, value, attn_bias=None, p=0.0,
  scale=None, *, op=None)``; "Input tensors must be in format [B, M, H, K]"
  (BMHK = attnres's layout, no transpose); returns ``[B, Mq, H, Kv]``;
- no window argument: a sliding ``window`` becomes part of the tensor bias (a
  band, top-left aligned); no softcap argument: ``softcap`` is refused;
- 4-D inputs need the same H for q, k and v ("Incompatible shapes for attention
  inputs ... We don't support broadcasting, please use `expand` yourself"): GQA
  repeats k/v heads (repeat_interleave grouping, as SDPA's enable_gqa);
- causal: ``xformers.ops.LowerTriangularMask()`` -- "A query Q cannot attend to a
  key which is farther from the initial key than Q is from the initial query",
  i.e. top-left aligned, like SDPA (bottom-right is the separate
  ``LowerTriangularFromBottomRightMask``); causal plus a tensor bias is
  ``LowerTriangularMask().add_bias(bias)``;
- a tensor ``attn_bias`` is added to the scores; it must have q's dtype, the
  full (B, H, Mq, Mkv) shape (``expand`` is fine: stride 0) and every stride but
  the last a multiple of ``128 // bits`` (4 for fp32, 8 for fp16/bf16; "HINT: To
  use an `attn_bias` with a sequence length that is not a multiple of 8, you need
  to ensure memory is aligned by slicing a bigger tensor"). The adapter builds
  such a tensor from the SDPA-style mask (bool -> 0 / -inf);
- dtypes fp16, bf16, fp32 on CUDA (cutlass cc >= 5.0).
- Install: ``pip install xformers`` (wheels pin a torch version).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnres.errors import InvalidArgumentError
from attnres.kernels._common import import_kernel_package, require_attribute, sdpa_style_mask

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]

BACKEND = "xformers"
PACKAGE = "xformers.ops"
INSTALL = "pip install xformers  (pick the wheel built for your torch and CUDA)"


def _aligned_bias(
    attn_mask: Tensor, batch: int, heads: int, seq_q: int, seq_kv: int, dtype: torch.dtype
) -> Tensor:
    """The SDPA mask as an xformers tensor bias: dtype, full shape, aligned strides."""
    missing = 4 - attn_mask.dim()
    if missing < 0:
        raise InvalidArgumentError(
            f"attn_mask must have at most 4 dims, got shape {tuple(attn_mask.shape)}"
        )
    mask = attn_mask.reshape((1,) * missing + tuple(attn_mask.shape)) if missing else attn_mask
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, float("-inf")
        )
    mask_b, mask_h = mask.shape[0], mask.shape[1]
    align = 128 // torch.finfo(dtype).bits
    padded = -(-seq_kv // align) * align
    # Slice a wider buffer so every stride but the last is a multiple of `align`;
    # broadcast batch/head dims stay stride 0 after expand (aligned too).
    buffer = torch.empty(mask_b, mask_h, seq_q, padded, dtype=dtype, device=mask.device)
    bias = buffer[..., :seq_kv]
    bias.copy_(mask.expand(mask_b, mask_h, seq_q, seq_kv))
    return bias.expand(batch, heads, seq_q, seq_kv)


def make_kernel() -> KernelFn:
    """Import xformers.ops and bind ``memory_efficient_attention``."""
    ops = import_kernel_package(PACKAGE, backend=BACKEND, install=INSTALL)
    hint = "The xformers install looks incomplete; reinstall it with: " + INSTALL
    memory_efficient_attention = require_attribute(
        ops, "memory_efficient_attention", backend=BACKEND, hint=hint
    )
    lower_triangular = require_attribute(ops, "LowerTriangularMask", backend=BACKEND, hint=hint)
    causal_bias = lower_triangular()

    def attention(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
        scale: float | None, *, softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> Tensor:  # fmt: skip
        # a window is a band and causal with a mask is folded in: the tensor bias below
        # (the backward takes no LowerTriangularMaskWithTensorBias)
        attn_mask, causal = sdpa_style_mask(BACKEND, q, k, attn_mask, causal, softcap, window)
        batch, seq_q, heads, _ = q.shape
        if k.shape[2] != heads:
            groups = heads // k.shape[2]
            k = k.repeat_interleave(groups, dim=2)
            v = v.repeat_interleave(groups, dim=2)
        bias: object = causal_bias if causal else None
        if attn_mask is not None:
            bias = _aligned_bias(attn_mask, batch, heads, seq_q, k.shape[1], q.dtype)
        out: Tensor = memory_efficient_attention(q, k, v, attn_bias=bias, p=0.0, scale=scale)
        return out

    return attention
