"""Issue 24: sequence-parallel attention on CPU, 2 ranks against 1, as ratios.

Shape (1, 16384, 8, 64), float32, torch_sdpa, one thread per rank, non-causal
(no ring imbalance). Two gloo ranks each time, round after round in one run,
the attention on the whole sequence alone (the 1-rank baseline) and the 2-rank
forward on their shard (``ulysses=2``, then ``ring=2``). Rows:

- per-rank 2-rank time / 1-rank time (ideal 0.5: half the work per rank);
- the share of the 2-rank time spent in the layout's collectives (waits for the
  slower peer included).

A layer without a layout runs the code path it ran before (the layout is read
when the layer binds, never per call): ``bench_layer.py``'s forward rows measure
that path against SDPA by hand.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sp_bench_worker import rank_main

if TYPE_CHECKING:
    from conftest import RatioRegistry

SHAPE = (1, 16384, 8, 64)
ROUNDS = 2


def _run_ranks() -> dict[int, Any]:
    folder = Path(tempfile.mkdtemp(prefix="attnres-sp-bench-"))
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=rank_main, args=(r, str(folder), SHAPE, ROUNDS), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 1800
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a benchmark rank failed"
    return {r: json.loads((folder / f"bench.{r}.json").read_text()) for r in range(2)}


def test_two_ranks_vs_one(benchmark: Any, ratios: RatioRegistry) -> None:
    results = benchmark.pedantic(_run_ranks, rounds=1, iterations=1)
    ids = "x".join(map(str, SHAPE))
    for layout in ("ulysses=2", "ring=2"):
        per_rank, shares = [], []
        for got in results.values():
            one = statistics.median(got["times"]["1 rank"])
            two = statistics.median(got["times"][layout])
            per_rank.append(two / one)
            shares.append(statistics.median(
                c / t for c, t in zip(got["comm"][layout], got["times"][layout], strict=True)
            ))  # fmt: skip
        ratio = max(per_rank)  # the slower rank sets the pace
        ratios.record(
            f"sequence-parallel {ids} {layout}: per-rank time, 2 ranks / 1 rank",
            ratio,
            note=f"ideal 0.5; ranks {', '.join(f'{r:.3f}' for r in per_rank)}; {ROUNDS} rounds",
        )
        ratios.record(
            f"sequence-parallel {ids} {layout}: share of the time in collectives",
            max(shares),
            unit="",
            note="waits for the slower peer included",
        )
        benchmark.extra_info[f"{layout} per-rank ratio"] = ratio
