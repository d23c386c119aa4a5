"""Issue 35: ring training memory and causal/non-causal ring time, 2 ranks vs 1 (CPU).

    PYTHONPATH=src python benchmarks/sp_measure.py [--seq 16384] [--what memory,time]

Not a benchmark file (``make bench`` does not run it): each configuration runs in
fresh processes, since a process's peak resident memory only grows.

- memory: one training step (forward + backward, torch_sdpa, float32, 8 heads x
  64) of the full sequence on one process, against ``ring=2`` on two ranks; rows:
  the resident memory held between forward and backward (what a model's layers
  keep for backward), and the peak during the step, each above what the process
  held before the step (its inputs), as a ratio of the one-process figure;
- time: the inference forward per rank, ``ring=2`` against one process on the
  whole sequence timed by the same rank in alternate rounds (the same
  contention), causal and not (median of 2 rounds).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Reset the kernel's high-water mark of this process (Linux: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _peak() -> int:
    """Peak resident memory since :func:`_reset_peak` (``VmHWM``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _job(rank: int, world: int, folder: str, what: str, seq: int, causal: bool) -> None:
    import torch
    import torch.distributed as dist

    import attnres

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    heads, size = 8, 64
    sp = None
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{folder}/rendezvous.{what}.{causal}", rank=rank,
            world_size=world, timeout=timedelta(seconds=600),
        )  # fmt: skip
        sp = attnres.SequenceParallel(ring=world, timeout=600)
    layer = attnres.Attention(heads, size, dtype="float32", causal=causal, parallel=sp)
    tiny = torch.randn(1, 64, heads, size, requires_grad=True)
    layer(tiny, tiny, tiny).sum().backward()  # warm-up: kernels, consensus
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq, heads, size, generator=gen) for _ in range(3)]
    q, k, v = full if sp is None else [sp.shard(t).clone() for t in full]
    del full
    result: dict[str, Any] = {}
    if what == "memory":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        base = _rss()
        _reset_peak()
        out = layer(q, k, v)
        result["kept_bytes"] = _rss() - base  # held between forward and backward
        out.backward(torch.ones_like(out))
        result["peak_bytes"] = _peak() - base
    else:
        # both ranks time one process on the whole sequence too, round after round, so
        # the baseline meets the same contention (as bench_parallel.py does)
        single = attnres.Attention(heads, size, dtype="float32", causal=causal)
        gen = torch.Generator().manual_seed(0)
        whole = [torch.randn(1, seq, heads, size, generator=gen) for _ in range(3)]
        times: dict[str, list[float]] = {"one": [], "ring": []}
        with torch.inference_mode():
            layer(q, k, v)
            for _ in range(2):
                for name, run, args in (("one", single, whole), ("ring", layer, (q, k, v))):
                    start = time.perf_counter()
                    run(*args)
                    times[name].append(time.perf_counter() - start)
        result = {name: statistics.median(t) for name, t in times.items()}
    Path(folder, f"{what}.{world}.{causal}.{rank}.json").write_text(json.dumps(result))
    if sp is not None:
        dist.destroy_process_group()


def _run(world: int, folder: str, what: str, seq: int, causal: bool) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_job, args=(r, world, folder, what, seq, causal)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
    assert [p.exitcode for p in procs] == [0] * world
    return [
        json.loads(Path(folder, f"{what}.{world}.{causal}.{r}.json").read_text())
        for r in range(world)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--what", default="memory,time")
    args = parser.parse_args()
    # every large tensor its own mapping, returned when freed: resident memory then
    # follows live tensors (glibc's adaptive threshold otherwise keeps freed blocks)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    folder = tempfile.mkdtemp(prefix="attnres-sp-measure-")
    for what in args.what.split(","):
        for causal in (False, True) if what == "time" else (False,):
            if what == "time":
                two = _run(2, folder, what, args.seq, causal)
                ratios = [r["ring"] / r["one"] for r in two]
                ones = ", ".join(f"{r['one']:.2f} s" for r in two)
                rings = ", ".join(f"{r['ring']:.2f} s" for r in two)
                print(
                    f"time seq={args.seq} causal={causal}: per rank, one process {ones}; "
                    f"ring=2 {rings}; ratio (worst rank) {max(ratios):.3f}",
                    flush=True,
                )
                continue
            one = _run(1, folder, what, args.seq, causal)[0]
            two = _run(2, folder, what, args.seq, causal)
            for key in ("kept_bytes", "peak_bytes") if what == "memory" else ("seconds",):
                ratios = [r[key] / one[key] for r in two]
                unit = (lambda x: f"{x / 2**20:.1f} MiB") if what == "memory" else (
                    lambda x: f"{x:.3f} s"
                )  # fmt: skip
                print(
                    f"{key} seq={args.seq} causal={causal}: one process {unit(one[key])}; "
                    f"ring=2 ranks {', '.join(unit(r[key]) for r in two)}; ratio (worst rank) "
                    f"{max(ratios):.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
