"""``torch_cudnn_sdpa``: torch SDPA restricted to the cuDNN backend.

Source facts (pytorch/pytorch torch/nn/attention/__init__.py: ``sdpa_kernel``
and ``SDPBackend.CUDNN_ATTENTION``; aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp ``check_cudnn_*``):
- ``with torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION):`` makes
  SDPA use cuDNN or raise (no silent fallback to another kernel);
- cuDNN attention is CUDA-only (sm80+), fp16/bf16, head size a multiple of 8 and
  at most 128 on most setups (256 on sm90/sm10x with recent cuDNN);
- layout, masks, scale and GQA are SDPA's: the adapter is the ``torch_sdpa``
  one, called inside the cuDNN-only selection.

The backend list is built once in ``make_kernel``; each call enters the
``sdpa_kernel`` context (a cheap flag save/restore) around one SDPA call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]


def make_kernel() -> KernelFn:
    """Bind the ``torch_sdpa`` adapter and the cuDNN-only backend selection."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnres.kernels import torch_sdpa

    sdpa_attention = torch_sdpa.make_kernel()
    backends = [SDPBackend.CUDNN_ATTENTION]

    def attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        causal: bool,
        scale: float | None,
        **features: Any,
    ) -> Tensor:
        with sdpa_kernel(backends):
            return sdpa_attention(q, k, v, attn_mask, causal, scale, **features)

    return attention
