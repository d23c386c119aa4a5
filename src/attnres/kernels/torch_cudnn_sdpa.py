"""``torch_cudnn_sdpa``: torch SDPA restricted to the cuDNN backend.

Source facts (pytorch/pytorch torch/nn/attention/__init__.py: ``sdpa_kernel``
and ``SDPBackend.CUDNN_ATTENTION``; aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp ``check_cudnn_*``):
- ``with torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION):`` makes
  SDPA use cuDNN or raise (no silent fallback to another kernel);
- cuDNN attention is CUDA-only (sm80+), fp16/bf16, head size a multiple of 8 and
  at most 128 on most setups (256 on sm90/sm10x with recent cuDNN);
- layout, masks, scale and GQA are SDPA's (see ``torch_sdpa``); the adapter folds
  a causal mask into ``attn_mask`` when both are given, as ``torch_sdpa`` does.

The backend list is built once in ``make_kernel``; each call enters the
``sdpa_kernel`` context (a cheap flag save/restore) around one SDPA call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnres.kernels._common import mask_with_causal

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]


def make_kernel() -> KernelFn:
    """Bind SDPA and the cuDNN-only backend selection."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = [SDPBackend.CUDNN_ATTENTION]

    def attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        causal: bool,
        scale: float | None,
    ) -> Tensor:
        if attn_mask is not None and causal:
            attn_mask = mask_with_causal(attn_mask, q.shape[1], k.shape[1])
            causal = False
        with sdpa_kernel(backends):
            out = sdpa(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=attn_mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=q.shape[2] != k.shape[2],
            )
        return out.transpose(1, 2)

    return attention
