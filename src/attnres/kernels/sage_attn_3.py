"""``sage_attn_3``: SageAttention3 for Blackwell (``sageattn3.sageattn3_blackwell``).

Source facts (thu-ml/SageAttention sageattention3_blackwell/sageattn3/api.py and
``__init__.py``; blackwell/api.cu):
- ``sageattn3_blackwell(q, k, v, attn_mask=None, is_causal=False,
  per_block_mean=True, **kwargs)`` takes (batch, heads, seq, head_dim) -- HND:
  the adapter transposes dims 1 and 2 (views) and transposes the output back;
- ``attn_mask`` is accepted and never used: the adapter refuses a mask;
- no scale argument: the softmax scale is fixed at ``head_dim ** -0.5``, so a
  layer with another ``softmax_scale`` is refused (never silently rescaled);
- it subtracts the mean of ``k`` in place (``k -= k.mean(...)``): the adapter
  passes a copy of ``k``, so the caller's tensor is never changed;
- q, k and v must have the same number of heads (no GQA in the catalogue);
  causal masks with ``seq_q != seq_kv`` are not documented as top-left, so they
  are refused like the flash-attn family's;
- sm120/sm121 only; fp16/bf16 in; head_dim 64 or 128 (>= 256 falls back to
  SDPA with a print).
- Install: build ``sageattention3_blackwell`` from thu-ml/SageAttention (module
  ``sageattn3``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnres.errors import InvalidArgumentError
from attnres.kernels._common import causal_alignment_error, kernel_function, no_mask_error

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]

BACKEND = "sage_attn_3"
PACKAGE = "sageattn3"
INSTALL = (
    "build sageattention3_blackwell from https://github.com/thu-ml/SageAttention "
    "(needs a Blackwell sm120 GPU)"
)


def make_kernel() -> KernelFn:
    """Import sageattn3 and bind ``sageattn3_blackwell`` (HND layout)."""
    sageattn3 = kernel_function(
        PACKAGE,
        "sageattn3_blackwell",
        backend=BACKEND,
        install=INSTALL,
        hint="Reinstall it: " + INSTALL,
    )

    def attention(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
        scale: float | None,
    ) -> Tensor:  # fmt: skip
        if attn_mask is not None:
            raise no_mask_error(BACKEND, "sageattn3_blackwell accepts attn_mask and ignores it")
        head_size = q.shape[-1]
        if scale is not None and abs(scale * head_size**0.5 - 1.0) > 1e-6:
            raise InvalidArgumentError(
                f"attention backend {BACKEND!r} has a fixed softmax scale of "
                f"1/sqrt(head_size) = {head_size**-0.5:.6g}; this layer asks for {scale!r}. "
                "Use a backend that takes a scale (torch_sdpa, sage_attn, fa) for this layer"
            )
        if causal and q.shape[1] != k.shape[1]:
            raise causal_alignment_error(BACKEND, q.shape[1], k.shape[1])
        if q.shape[2] != k.shape[2]:
            raise InvalidArgumentError(
                f"attention backend {BACKEND!r} needs as many key/value heads as query heads "
                f"(got {q.shape[2]} and {k.shape[2]}); it does not implement grouped-query "
                "attention"
            )
        out: Tensor = sageattn3(
            q.transpose(1, 2),
            k.transpose(1, 2).clone(),  # the kernel centres k in place
            v.transpose(1, 2),
            is_causal=causal,
        )
        return out.transpose(1, 2)

    return attention
