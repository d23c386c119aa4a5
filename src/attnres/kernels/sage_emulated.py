"""An emulation, on any device, of SageAttention 2's quantisation (issue 34).

Not a kernel of SageAttention: attnres's own torch code that reproduces what
SageAttention's kernels do to the numbers, so that the error a layer would see
under ``sage_attn`` can be measured where the kernel cannot run (a CPU, a
simulated platform). Everything that reports its figures says ``emulated``.

Written from the published algorithm and source:

- SageAttention2 paper (Zhang et al., ICML 2025, arXiv 2411.10958), section 3:
  K smoothed by subtracting its mean over tokens; Q and K quantised to int8
  with per-thread scales; P and V quantised to fp8 e4m3 (V per channel) with a
  two-level fp32 accumulation;
- thu-ml/SageAttention d1a57a54: ``sageattention/core.py`` (which function runs
  on which GPU, its block sizes: ``BLKQ``, ``WARPQ``, ``BLKK``, ``WARPK``, and
  ``smooth_k``'s ``k.mean(dim=seq_dim)``), ``sageattention/triton/
  quant_per_block.py`` and ``quant_per_thread.py`` (scale ``max|x| / 127``,
  rounding half away from zero; which rows share a per-thread scale),
  ``sageattention/quant.py`` ``per_channel_fp8`` (V scaled per channel to
  ``scale_max`` 448, or 2.25 under ``pv_accum_dtype='fp32+fp16'``).

What it does not reproduce, and why it does not matter much for the figures:
the kernels' online softmax rescales P per key block (P is quantised against
the running row maximum, here against the whole row's maximum, which gives P at
most the same or coarser fp8 values); the fp16 inner accumulation of
``fp32+fp16`` is emulated by rounding each 64-key block's partial P.V to fp16.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnres.errors import InvalidArgumentError

__all__ = ["SAGE_SCHEMES", "SageScheme", "sage_attention_emulated", "scheme_for"]

_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0


class SageScheme:
    """One GPU's SageAttention 2 settings (``sageattention/core.py`` d1a57a54)."""

    __slots__ = ("accum", "blkk", "blkq", "function", "gran", "pv", "v_scale_max", "warpq")

    def __init__(
        self,
        function: str,
        gran: str,
        blkq: int,
        warpq: int,
        blkk: int,
        pv: str,
        accum: str,
        v_scale_max: float = _FP8_MAX,
    ) -> None:
        self.function = function
        self.gran = gran  # "per_block" | "per_warp" | "per_thread"
        self.blkq, self.warpq, self.blkk = blkq, warpq, blkk
        self.pv = pv  # "fp16" | "fp8"
        self.accum = accum  # "fp32" | "fp32+fp16" | "fp32+fp32"
        self.v_scale_max = v_scale_max


#: Per compute capability, what ``sageattn`` runs (SageAttention d1a57a54 core.py).
SAGE_SCHEMES: dict[tuple[int, int], SageScheme] = {
    (8, 0): SageScheme("sageattn_qk_int8_pv_fp16_cuda", "per_thread", 128, 32, 64, "fp16", "fp32"),
    (8, 6): SageScheme(
        "sageattn_qk_int8_pv_fp16_triton", "per_block", 128, 128, 64, "fp16", "fp32"
    ),
    (8, 9): SageScheme(
        "sageattn_qk_int8_pv_fp8_cuda", "per_thread", 128, 32, 64, "fp8", "fp32+fp16", 2.25
    ),
    (9, 0): SageScheme(
        "sageattn_qk_int8_pv_fp8_cuda_sm90", "per_thread", 64, 16, 128, "fp8", "fp32+fp32"
    ),
    (12, 0): SageScheme(
        "sageattn_qk_int8_pv_fp8_cuda", "per_warp", 128, 32, 64, "fp8", "fp32+fp16", 2.25
    ),
    (12, 1): SageScheme(
        "sageattn_qk_int8_pv_fp8_cuda", "per_warp", 128, 32, 64, "fp8", "fp32+fp16", 2.25
    ),
}


def scheme_for(capability: tuple[int, int] | None) -> SageScheme:
    """The scheme ``sageattn`` runs on ``capability`` (sm90's when unknown or
    not one it dispatches: the scheme of the simulated Hopper)."""
    return SAGE_SCHEMES.get(capability or (9, 0), SAGE_SCHEMES[(9, 0)])


def _int8(x: Tensor, groups: Tensor, count: int) -> Tensor:
    """``x`` (b, h, n, d) quantised to int8 and back, one scale per row group.

    ``groups`` (n,) gives each row's group; scale = max|x| / 127 over the group
    (plus the Triton kernels' 1e-7), values rounded half away from zero.
    """
    b, h, n, _ = x.shape
    amax = torch.zeros(b, h, count, dtype=x.dtype, device=x.device)
    amax = amax.scatter_reduce(2, groups.expand(b, h, n), x.abs().amax(dim=-1), "amax")
    scale = (amax / 127.0 + 1e-7).gather(2, groups.expand(b, h, n)).unsqueeze(-1)
    q = x / scale
    q = torch.trunc(q + 0.5 * torch.sign(q)).clamp_(-127, 127)
    return q * scale


def _groups(n: int, block: int, per: str, device: torch.device, *, key: bool) -> tuple[Tensor, int]:
    """Which scale each of ``n`` rows uses (quant_per_block.py, quant_per_thread.py)."""
    rows = torch.arange(n, device=device)
    blocks = rows // block
    nblocks = max(1, math.ceil(n / block))
    if per != "per_thread":
        return blocks, nblocks
    # query: 8 scales per block, rows t, t+8, ... share one (quant_query_per_thread);
    # key: 4 scales per block, rows 2t, 2t+1, 2t+8, 2t+9, ... share one
    within = rows % 8 if not key else (rows % 8) // 2
    per_block = 8 if not key else 4
    return blocks * per_block + within, nblocks * per_block


def _fp8(x: Tensor) -> Tensor:
    return x.to(_FP8).to(x.dtype)


def sage_attention_emulated(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    *,
    capability: tuple[int, int] | None = (9, 0),
    smooth_k: bool = True,
) -> Tensor:
    """SageAttention 2's output on ``capability``, emulated in float32 (issue 34).

    attnres's kernel convention: q (batch, seq_q, heads, head), k and v
    (batch, seq_kv, kv_heads, head); returns q's shape and dtype. ``attn_mask``
    must be ``None`` (``sageattn`` drops masks: the catalogue never gives it a
    layer with one).
    """
    if attn_mask is not None:
        raise InvalidArgumentError(
            "the SageAttention emulation takes no attention mask (sageattn drops it)"
        )
    scheme = scheme_for(capability)
    out_dtype = q.dtype
    qf, kf, vf = (t.transpose(1, 2).to(torch.float32) for t in (q, k, v))  # (b, h, n, d)
    if kf.shape[1] != qf.shape[1]:
        rep = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    d = qf.shape[-1]
    sm = scale if scale is not None else d**-0.5
    if smooth_k:  # core.py: km = k.mean(dim=seq_dim, keepdim=True); softmax-invariant
        kf = kf - kf.mean(dim=2, keepdim=True)
    nq, nk = qf.shape[2], kf.shape[2]
    qblock = scheme.blkq if scheme.gran == "per_block" else scheme.warpq
    gq, cq = _groups(nq, qblock, scheme.gran, qf.device, key=False)
    gk, ck = _groups(nk, scheme.blkk, scheme.gran, kf.device, key=True)
    qd = _int8(qf, gq, cq)
    kd = _int8(kf, gk, ck)
    s = (qd @ kd.transpose(-1, -2)) * sm  # int8 x int8 -> int32 is exact; dequantised in fp32
    if causal:
        mask = torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)  # fp32, in [0, 1]
    l = p.sum(dim=-1, keepdim=True)  # noqa: E741 - the paper's name
    if scheme.pv == "fp16":
        pq, vq = p.to(torch.float16).float(), vf.to(torch.float16).float()
    else:
        # P in [0, 1] scaled by 448 into e4m3; V per channel to v_scale_max (per_channel_fp8)
        pq = _fp8(p * _FP8_MAX) / _FP8_MAX
        vs = vf.abs().amax(dim=2, keepdim=True) / scheme.v_scale_max + 1e-12
        vq = _fp8(vf / vs) * vs
    if scheme.accum == "fp32+fp16":  # partial P.V per 64-key block rounded to fp16
        o = torch.zeros_like(qf)
        for start in range(0, nk, 64):
            part = pq[..., start : start + 64] @ vq[:, :, start : start + 64]
            o = o + part.to(torch.float16).float()
    else:
        o = pq @ vq
    o = o / l
    return o.transpose(1, 2).to(out_dtype)
