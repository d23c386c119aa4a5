"""``eager``: reference attention math — matmul, softmax, matmul.

Semantics are torch SDPA's (pytorch/pytorch torch/nn/functional.py docstring of
``scaled_dot_product_attention``, whose "equivalent" reference code this
follows): scores = q @ k^T * scale (scale None: 1/sqrt(head_size)); a boolean
mask keeps ``True`` positions (others get -inf), a float mask is added; causal is
the top-left lower triangle; a sliding ``window=(left, right)`` keeps keys
``i - left .. i + right`` of query ``i`` (-1: unbounded), on the same diagonal;
``softcap`` (> 0) caps the scaled scores to ``softcap * tanh(scores / softcap)``
before masks apply (flash-attn's order); ``sinks`` (issue 19: one learned logit
per query head, shape ``(heads_q,)``) join every row's softmax and take their share
of it, their value column zero (GPT-OSS's ``eager_attention_forward`` in
transformers 5.24 concatenates them to the scores the same way); GQA repeats each
k/v head heads_q // heads_kv times (``repeat_interleave``, the grouping SDPA's ``enable_gqa`` uses).

Accumulation runs in float32 at least (float64 inputs stay float64); the output
is cast back to q's dtype. A row whose every key is masked out returns zeros, as
SDPA on CPU does in torch 2.5+ (not NaN).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnres.kernels._common import window_keep

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]


def make_kernel() -> KernelFn:
    """Return the reference kernel (torch only, nothing to import lazily)."""

    def attention(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
        scale: float | None, *, softcap: float = 0.0, window: tuple[int, int] | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        acc = torch.promote_types(q.dtype, torch.float32)
        head_size = q.shape[-1]
        seq_q, seq_kv = q.shape[1], k.shape[1]
        groups = q.shape[2] // k.shape[2]
        # (B, S, H, D) -> (B, H, S, D), in the accumulation dtype
        qh = q.transpose(1, 2).to(acc)
        kh = k.transpose(1, 2).to(acc)
        vh = v.transpose(1, 2).to(acc)
        if groups != 1:
            kh = kh.repeat_interleave(groups, dim=1)
            vh = vh.repeat_interleave(groups, dim=1)
        factor = scale if scale is not None else head_size**-0.5
        scores = torch.matmul(qh, kh.transpose(-2, -1)) * factor
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        keep: Tensor | None = None
        if causal:
            keep = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            band = window_keep(scores, seq_q, seq_kv, window)
            keep = band if keep is None else keep & band
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                keep = attn_mask if keep is None else keep & attn_mask
            else:
                scores = scores + attn_mask.to(acc)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        # A fully masked row has max -inf: subtracting it would give NaN. Use 0
        # there, so exp() gives 0 everywhere and the row sums to 0 -> output 0.
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        sink: Tensor | None = None
        if sinks is not None:
            sink = sinks.to(acc).view(1, -1, 1, 1)
            row_max = torch.maximum(row_max, sink)
        weights = torch.exp(scores - row_max)
        denom = weights.sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - row_max)
        weights = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
        out = torch.matmul(weights, vh)
        return out.transpose(1, 2).to(q.dtype)

    return attention
