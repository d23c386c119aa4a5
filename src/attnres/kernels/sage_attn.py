"""``sage_attn``: SageAttention 2/2++ (``sageattention.sageattn``).

Source facts (thu-ml/SageAttention sageattention/core.py, README):
- ``sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None,
  return_lse=False, **kwargs)``; ``tensor_layout="NHD"`` is (batch, seq, heads,
  head_dim) -- attnres's layout, no transpose; returns ``out`` (plus lse only with
  ``return_lse=True``);
- ``**kwargs`` swallows anything else: ``sageattn(..., attn_mask=m)`` runs and
  silently ignores the mask. The adapter therefore refuses ``attn_mask``;
- "``is_causal``: Only applicable when qo_len == kv_len": causal with
  seq_q != seq_kv is refused;
- dtypes fp16/bf16 ("Input tensors must be in dtype of torch.float16 or
  torch.bfloat16"); head_dim <= 128 (pads < 64 to 64 and 65..127 to 128; larger
  raises "Unsupported head_dim"); num_qo_heads divisible by num_kv_heads (GQA);
- dispatches by GPU arch: sm80, sm86, sm89, sm90, sm120 (others raise
  "Unsupported CUDA architecture").
- ``sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, is_causal=False, sm_scale=None, smooth_k=True, **kwargs)``
  (Triton): packed (total, heads, head_dim) tensors, num_qo_heads divisible by
  num_kv_heads, cu_seqlens int32 or int64 and contiguous; causal "only
  applicable when qo_len == kv_len for each sequence" (the key padding route of
  attnres._varlen unpads queries and keys alike for self-attention).
- Install: ``pip install sageattention``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnres.kernels._common import (
    flash_style_kernel,
    import_kernel_package,
    require_attribute,
    varlen_style_kernel,
)

if TYPE_CHECKING:
    from attnres.kernels import KernelFn, VarlenKernelFn

__all__ = ["make_kernel", "make_varlen_kernel"]

BACKEND = "sage_attn"
PACKAGE = "sageattention"
INSTALL = "pip install sageattention  (needs a CUDA GPU and a matching torch)"


def make_kernel() -> KernelFn:
    """Import sageattention and bind ``sageattn`` (NHD layout)."""
    module = import_kernel_package(PACKAGE, backend=BACKEND, install=INSTALL)
    sageattn = require_attribute(
        module, "sageattn", backend=BACKEND, hint="Reinstall it with: " + INSTALL
    )

    return flash_style_kernel(
        BACKEND,
        "sageattn accepts attn_mask and silently ignores it",
        lambda q, k, v, causal, scale, softcap, window: sageattn(
            q, k, v, tensor_layout="NHD", is_causal=causal, sm_scale=scale
        ),
    )


def make_varlen_kernel() -> VarlenKernelFn:
    """Import sageattention and bind ``sageattn_varlen`` (packed tokens).

    Same calling convention as :func:`attnres.kernels.fa.make_varlen_kernel`.
    """
    module = import_kernel_package(PACKAGE, backend=BACKEND, install=INSTALL)
    sageattn_varlen = require_attribute(
        module, "sageattn_varlen", backend=BACKEND, hint="Reinstall it with: " + INSTALL
    )

    return varlen_style_kernel(
        lambda q, k, v, cu_q, cu_k, max_q, max_k, causal, scale: sageattn_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal, sm_scale=scale
        )
    )
