"""One rank of ``bench_parallel.py`` (spawned; not a benchmark file itself).

Each rank joins a 2-rank gloo group and, round after round, times the same
attention on one process (the full sequence, this rank alone: the 1-rank
baseline) and then the 2-rank sequence-parallel forward on its shard, for each
layout; it records the time the layout's collectives took (waits included).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path


def rank_main(rank: int, directory: str, shape: tuple[int, int, int, int], rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import attnres

    torch.set_num_threads(1)  # SPEC 7: one CPU thread per rank
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    folder = Path(directory)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=2,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    batch, seq, heads, size = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, seq, heads, size, generator=gen) for _ in range(3))
    single = attnres.Attention(heads, size, dtype="float32", name="bench.single")
    layouts = {"ulysses=2": {"ulysses": 2}, "ring=2": {"ring": 2}}
    layers = {}
    for name, degrees in layouts.items():
        sp = attnres.SequenceParallel(**degrees, timeout=600)
        layers[name] = (sp, attnres.Attention(heads, size, dtype="float32", parallel=sp))
    shards = {name: tuple(sp.shard(t) for t in (q, k, v)) for name, (sp, _) in layers.items()}
    times: dict[str, list[float]] = {"1 rank": [], **{n: [] for n in layouts}}
    comm: dict[str, list[float]] = {n: [] for n in layouts}
    with torch.inference_mode():
        for name, (_, layer) in layers.items():  # warm-up (and the consensus)
            layer(*shards[name])
        single(q, k, v)
        for _ in range(rounds):
            start = time.perf_counter()
            single(q, k, v)
            times["1 rank"].append(time.perf_counter() - start)
            for name, (sp, layer) in layers.items():
                before = sp.comm_seconds
                start = time.perf_counter()
                layer(*shards[name])
                times[name].append(time.perf_counter() - start)
                comm[name].append(sp.comm_seconds - before)
    (folder / f"bench.{rank}.json").write_text(json.dumps({"times": times, "comm": comm}))
    dist.destroy_process_group()
