"""Measured selection (issue 15): what tuning costs, and what it buys.

(a) tuning a 48-block model of one shape with ``attnres.autotune(model, x)``:
    the time of the whole call, and its ratio to tuning a single block (layers
    of one shape share one measurement, so 48 blocks should cost about what one
    does: at most 1.5x);
(b) the forward after tuning vs the best kernel chosen by hand: each candidate
    (torch_sdpa, eager, flex_attention) is bound explicitly and timed, and the
    tuned layer is paired with the fastest of them: at most 1.05x (the margin is
    2%, and two candidates within it are equally good).

CPU, fp32, one thread, (1, 1024, 8, 64). Ratios are reported, not enforced,
unless ``--bench-enforce``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import Tensor, nn

import attnres
from attnres.autotuner import autotune, clear_results

if TYPE_CHECKING:
    from conftest import PairedResult, RatioRegistry

    Paired = Callable[..., PairedResult]

SHAPE = (1, 1024, 8, 64)
CANDIDATES = ("torch_sdpa", "eager", "flex_attention")
BLOCKS = 48


def _inputs() -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(SHAPE, generator=gen) for _ in range(3))  # type: ignore[return-value]


class Blocks(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        _, _, heads, size = SHAPE
        self.blocks = nn.ModuleList(
            attnres.Attention(heads, size, supported=set(CANDIDATES), name=f"blocks.{i}.attn1")
            for i in range(n)
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        for block in self.blocks:
            q = block(q, k, v)
        return q


def _tune_seconds(n: int) -> tuple[float, attnres.autotuner.AutotuneReport]:
    attnres.clear_cache()
    clear_results()
    model = Blocks(n)
    start = time.perf_counter()
    report = autotune(model, *_inputs(), min_elements=0)
    return time.perf_counter() - start, report


def test_tuning_a_48_block_model_of_one_shape(benchmark: Any, ratios: RatioRegistry) -> None:
    one, _ = _tune_seconds(1)
    many, report = _tune_seconds(BLOCKS)
    assert (report.measured, report.reused) == (1, BLOCKS - 1)
    ratios.record(
        f"autotune() of {BLOCKS} blocks, one shape", many * 1000, None,
        note=f"{report.measured} measurement, {report.reused} reused", unit="ms",
    )
    ratios.record(
        f"autotune() of {BLOCKS} blocks / of 1 block", many / one, 1.5,
        note=f"{many * 1000:.1f} ms vs {one * 1000:.1f} ms",
    )
    benchmark.extra_info["tune_48_blocks_ms"] = many * 1000
    benchmark.extra_info["tune_1_block_ms"] = one * 1000
    benchmark.pedantic(lambda: _tune_seconds(BLOCKS), rounds=1, iterations=1)


def test_forward_after_tuning_vs_the_best_kernel_by_hand(
    benchmark: Any, ratios: RatioRegistry, paired: Paired
) -> None:
    q, k, v = _inputs()
    _, _, heads, size = SHAPE
    _, report = _tune_seconds(1)
    [decision] = report.decisions
    attnres.clear_cache()
    tuned = Blocks(1)
    autotune(tuned, q, k, v, min_elements=0)  # the shared measurement applies: no timing
    layer = tuned.blocks[0]
    assert layer.backend.name == decision.backend
    by_hand = {
        name: attnres.Attention(heads, size, backend=name, name=f"hand.{name}")
        for name in CANDIDATES
    }
    with torch.inference_mode():
        alone = {
            name: paired(lambda fn=fn: fn(q, k, v), lambda: layer(q, k, v), rounds=15, inner=1)
            for name, fn in by_hand.items()
        }
        best = min(alone, key=lambda name: alone[name].median_a_ns)
        result = paired(lambda: layer(q, k, v), lambda: by_hand[best](q, k, v),
                        rounds=40, inner=1, seed=3)
    ratios.record(
        f"forward {'x'.join(map(str, SHAPE))} tuned ({layer.backend.name}) / best by hand "
        f"({best})",
        result.ratio,
        1.05,
        note=result.describe() + "; by hand: " + ", ".join(
            f"{n} {alone[n].median_a_ns / 1e6:.2f} ms" for n in CANDIDATES
        ),
    )
    benchmark.extra_info["tuned_backend"] = layer.backend.name
    benchmark.extra_info["best_by_hand"] = best
    benchmark.extra_info["ratio_vs_best_by_hand"] = result.ratio
    with torch.inference_mode():
        benchmark.pedantic(layer, args=(q, k, v), rounds=10, iterations=1, warmup_rounds=1)


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    attnres.clear_cache()
    clear_results()
    yield
    clear_results()
