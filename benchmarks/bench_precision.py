"""Measured error (issue 34): what measuring each layer's error costs beside its time.

``attnres.precision.calibrate(model, x)`` times every attnres layer of a 48-block
model on the input one forward gives it (autotune's 3 warm-up and 8 timed
calls) and, by default, measures its error against a float64 reference
(relative L2, max abs, cosine). ``errors=False`` times only. The row is their
ratio: measuring error must cost at most 1.5x measuring time alone.

CPU, fp32, (1, 1024, 8, 64). Ratios are reported, not enforced, unless
``--bench-enforce``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

import attnres
from attnres.precision import calibrate

if TYPE_CHECKING:
    from conftest import RatioRegistry

SHAPE = (1, 1024, 8, 64)
BLOCKS = 48


class Blocks(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        _, _, heads, size = SHAPE
        self.blocks = nn.ModuleList(
            attnres.Attention(heads, size, name=f"blocks.{i}.attn1") for i in range(n)
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        for block in self.blocks:
            q = block(q, k, v)
        return q


def _seconds(model: nn.Module, inputs: tuple[Tensor, ...], errors: bool) -> float:
    start = time.perf_counter()
    report = calibrate(model, *inputs, errors=errors)
    elapsed = time.perf_counter() - start
    assert len(report.sites) == BLOCKS
    assert all((s.measured is not None) == errors for s in report.sites)
    return elapsed


def test_measuring_error_of_a_48_block_model_vs_time_alone(
    benchmark: Any, ratios: RatioRegistry
) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn(SHAPE, generator=gen) for _ in range(3))
    model = Blocks(BLOCKS)
    _seconds(model, inputs, errors=False)  # warm the kernels and the allocator
    timed, both = [], []
    for _ in range(3):  # interleaved rounds; the fastest of each
        timed.append(_seconds(model, inputs, errors=False))
        both.append(_seconds(model, inputs, errors=True))
    ratios.record(
        f"calibrate() of {BLOCKS} blocks: time and error / time alone",
        min(both) / min(timed),
        1.5,
        note=f"{min(both) * 1000:.0f} ms vs {min(timed) * 1000:.0f} ms "
        f"({'x'.join(map(str, SHAPE))} fp32, float64 reference)",
    )
    benchmark.extra_info["time_and_error_ms"] = min(both) * 1000
    benchmark.extra_info["time_alone_ms"] = min(timed) * 1000
    benchmark.pedantic(lambda: _seconds(model, inputs, True), rounds=1, iterations=1)
