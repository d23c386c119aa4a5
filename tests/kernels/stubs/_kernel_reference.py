"""What every stub of a compiled attention layer computes: float64 attention.

Ours (committed), used by the stand-ins in this folder for the kernel packages'
compiled extension modules (flash_attn_2_cuda, flash_attn_3._C, aiter's
prebuilt module, xformers' operators, SageAttention's Triton kernels, FA4's
CuTe-DSL launch). The packages' own Python wrappers run unchanged above them.

``window`` follows flash-attn's ``mha_fwd`` (csrc/flash_attn/flash_api.cpp):
query ``i`` sees keys ``[i + offset - left, i + offset + right]`` (-1: that
side unbounded) with ``offset = seq_k - seq_q`` for the bottom-right alignment
of the flash-attn family and 0 for top-left; causal is ``(-1, 0)``. Rows with
no key give 0 and an lse of +inf (flash-attn's convention for empty rows).
"""

from __future__ import annotations

import torch


def check(condition: bool, message: str) -> None:
    """A TORCH_CHECK: the compiled layer's RuntimeError."""
    if not condition:
        raise RuntimeError(message)


def keep_mask(
    seq_q: int, seq_k: int, causal: bool, left: int, right: int, *, bottom_right: bool = True
) -> torch.Tensor:
    """(seq_q, seq_k) bool: which keys each query sees."""
    if causal:
        right = 0
    offset = seq_k - seq_q if bottom_right else 0
    rows = torch.arange(seq_q).unsqueeze(1) + offset
    cols = torch.arange(seq_k).unsqueeze(0)
    keep = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if right >= 0:
        keep &= cols <= rows + right
    if left >= 0:
        keep &= cols >= rows - left
    return keep


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    left: int = -1,
    right: int = -1,
    softcap: float = 0.0,
    bottom_right: bool = True,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64: q (b, sq, hq, d), k/v (b, sk, hk, d[v]); out (b, sq, hq, dv),
    lse (b, hq, sq). GQA: query head ``h`` reads key head ``h // (hq // hk)``.
    ``bias``: (b, hq, sq, sk) added to the scores (xformers' tensor bias). Differentiable."""
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    qh = q64.transpose(1, 2)
    kh = k64.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v64.transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(torch.float64)
    keep = keep_mask(q.shape[1], k.shape[1], causal, left, right, bottom_right=bottom_right)
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isinf(lse) & (lse < 0)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    out = (probs @ vh).transpose(1, 2)
    return out, lse.masked_fill(empty, float("inf"))


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    left: int = -1,
    right: int = -1,
    softcap: float = 0.0,
    bottom_right: bool = True,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (float64) of :func:`attention` for the upstream gradient ``dout``,
    written out (a compiled op runs below autograd: no graph to differentiate)."""
    q64, k64, v64, do = (t.detach().to(torch.float64) for t in (q, k, v, dout))
    groups = q.shape[2] // k.shape[2]
    qh = q64.transpose(1, 2)
    kh = k64.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v64.transpose(1, 2).repeat_interleave(groups, dim=1)
    doh = do.transpose(1, 2)
    raw = (qh @ kh.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    if bias is not None:
        scores = scores + bias.to(torch.float64)
    keep = keep_mask(q.shape[1], k.shape[1], causal, left, right, bottom_right=bottom_right)
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse.nan_to_num(posinf=0.0, neginf=0.0)).nan_to_num(0.0)
    probs = probs.masked_fill(~keep | torch.isinf(scores), 0.0)
    out = probs @ vh
    dv = probs.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    ds = probs * (dp - (doh * out).sum(-1, keepdim=True))
    if softcap > 0:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = (ds @ kh) * scale
    dk = (ds.transpose(-1, -2) @ qh) * scale

    def fold(t: torch.Tensor) -> torch.Tensor:  # GQA: a key head's grads summed over its group
        b, h, s, d = t.shape
        return t.reshape(b, h // groups, groups, s, d).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), fold(dk), fold(dv)


def segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence."""
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def nan_like(
    t: torch.Tensor, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An output buffer the kernel has not written yet: NaN, so an unwritten row shows."""
    return torch.full(shape or tuple(t.shape), float("nan"), dtype=dtype or t.dtype)
