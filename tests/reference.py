"""The float64 attention reference shared by the layer and fake-kernel tests.

The attnres calling convention, vectorised, from SDPA's definition: q is
(batch, seq_q, heads_q, head_size), k and v (batch, seq_kv, heads_kv,
head_size); heads_kv groups of query heads share a key/value head; causal is
top-left aligned; a bool mask keeps True, a float mask is added to the scores.
``tests/test_kernels_numerics.py`` keeps its own loop-by-loop oracle on purpose:
a second, independent construction.
"""

from __future__ import annotations

import math

import torch


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    *,
    softcap: float = 0.0,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Attention in float64, returned in float64 as (batch, seq_q, heads_q, head_size).

    ``softcap`` (> 0) maps the scaled scores to ``softcap * tanh(scores / softcap)``
    before any mask; ``window=(left, right)`` keeps, for query ``i``, the keys
    ``j`` with ``i - left <= j <= i + right`` (-1: unbounded side), top-left aligned.
    """
    group = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.double().transpose(1, 2).repeat_interleave(group, dim=1)
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", qh, kh) * factor
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if window is not None:
        left, right = window
        i = torch.arange(q.shape[1]).unsqueeze(1)
        j = torch.arange(k.shape[1]).unsqueeze(0)
        outside = torch.zeros(q.shape[1], k.shape[1], dtype=torch.bool)
        if left >= 0:
            outside |= j < i - left
        if right >= 0:
            outside |= j > i + right
        scores = scores.masked_fill(outside, float("-inf"))
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.double()
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), vh).transpose(1, 2)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-relative error of ``out`` against a float64 reference."""
    return float(((out.double() - ref).norm() / ref.norm()).item())
