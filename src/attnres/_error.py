"""Error figures against a float64 reference (issue 34): what autotune and
:mod:`attnres.precision` measure a kernel's output with."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["error_figures", "reference_attention", "timed"]


def timed(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    calls: int,
    repeats: int,
    sync: Callable[[], None] = lambda: None,
    timer: Callable[[], int] = time.perf_counter_ns,
) -> tuple[int, int, Any]:
    """(median ns, max - min ns, the first output) of ``repeats`` timed calls of
    ``fn(*args)`` after ``calls`` untimed ones (at least one: its output is the
    one returned); ``sync`` waits for the device after the warm-up and after
    each timed call."""
    out = fn(*args)
    for _ in range(max(calls - 1, 0)):
        fn(*args)
    sync()
    samples = []
    for _ in range(repeats):
        start = timer()
        fn(*args)
        sync()
        samples.append(timer() - start)
    samples.sort()
    middle = len(samples) // 2
    median = samples[middle] if len(samples) % 2 else (samples[middle - 1] + samples[middle]) // 2
    return median, samples[-1] - samples[0], out


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, causal: bool = False,
    scale: float | None = None,
) -> Tensor:  # fmt: skip
    """Attention in float64 (attnres's layout: (batch, seq, heads, head)): the
    reference every measured error is taken against."""
    qd, kd, vd = (t.detach().to(torch.float64).transpose(1, 2) for t in (q, k, v))
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(torch.float64)
    out = torch.nn.functional.scaled_dot_product_attention(
        qd,
        kd,
        vd,
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=kd.shape[1] != qd.shape[1],
    )
    return out.transpose(1, 2)


def error_figures(out: Tensor, reference: Tensor) -> tuple[float, float, float]:
    """(relative L2, max abs, cosine) of ``out`` against ``reference``, in float64.

    Relative L2 is ``||out - ref|| / ||ref||``; a reference of norm 0 gives
    the absolute L2 instead; a non-finite output gives ``inf``, ``inf``, 0.
    """
    o = out.detach().to(torch.float64).flatten()
    r = reference.detach().to(torch.float64).flatten()
    if not bool(torch.isfinite(o).all()):
        return math.inf, math.inf, 0.0
    diff = o - r
    norm = float(r.norm())
    rel = float(diff.norm()) / norm if norm > 0 else float(diff.norm())
    denom = float(o.norm()) * norm
    cosine = float(o @ r) / denom if denom > 0 else (1.0 if rel == 0 else 0.0)
    return rel, float(diff.abs().max()) if diff.numel() else 0.0, cosine
