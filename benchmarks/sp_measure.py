"""Issue 35: ring training memory and causal/non-causal ring time, 2 ranks vs 1 (CPU).

    PYTHONPATH=src python benchmarks/sp_measure.py [--seq 16384] [--what memory,time]
        [--rounds 3]            # or: make bench-sp

Not a benchmark file (``make bench`` does not run it): each configuration runs in
fresh processes, since a process's peak resident memory only grows.

- memory: one training step (forward + backward, torch_sdpa, float32, 8 heads x
  64, one thread) of the full sequence on one process, against ``ring=2`` on two
  ranks, causal and not, after a warm-up step of the same calls on a short
  sequence (the first backward maps ~35 MiB of one-time buffers: unwarmed, they
  land in whichever step runs first). Rows: what the forward leaves allocated
  (kept for backward) and the step's peak, each above what the process held
  before the step (its inputs), as a ratio of the one-process figure; measured
  twice: torch's allocations (the profiler's allocation events, deterministic)
  and resident memory (``VmRSS``, ``VmHWM`` after a reset);
- time: the inference forward per rank, ``ring=2`` against one process on the
  whole sequence timed by the same rank in alternate rounds (the same
  contention: both ranks run either at once, one thread each, as SPEC 7 has it),
  causal and not; ``--rounds`` rounds, the per-round ratios, their best and
  median (wall clock; per-rank CPU time beside it, less disturbed by other
  processes on a shared machine), with the threads per rank and the load
  average before and after. Every timed call starts from a barrier: otherwise
  the rank that finished the previous call first counts its peer's lag in its
  ring time (a causal ring's zig-zag exchange waits for the peer). The timing
  runs in the allocator a user has (no ``MALLOC_MMAP_THRESHOLD_``, which the
  memory runs set and which turns every large allocation into fresh pages).

The last line is a summary of the four ratios against issue 35's bars (2 ranks,
16k tokens: time at most 0.55x causal and not, training peak at most 0.6x).
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


def _allocations(run: Any) -> tuple[int, int]:
    """(net, peak) bytes torch's CPU allocator handed out while ``run()`` ran (the
    profiler's allocation events: every tensor, nothing else; deterministic)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return live, peak


def _job(
    rank: int, world: int, folder: str, what: str, seq: int, causal: bool, rounds: int
) -> None:
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
    # warm-up: the measured calls themselves on a short sequence (kernels, consensus,
    # and the backward's one-time buffers)
    tiny = [torch.randn(1, 256, heads, size, requires_grad=True) for _ in range(3)]
    warm = layer(*tiny)
    warm.backward(torch.ones_like(warm))
    del tiny, warm
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
        del out
        for t in (q, k, v):
            t.grad = None
        # the same step again, under the profiler: torch's own allocations
        held: dict[str, Any] = {}

        def forward() -> None:
            held["out"] = layer(q, k, v)

        def backward() -> None:
            out = held["out"]
            out.backward(torch.ones_like(out))

        kept, forward_peak = _allocations(forward)
        _, backward_peak = _allocations(backward)
        result["kept_alloc"] = kept
        result["peak_alloc"] = max(forward_peak, kept + backward_peak)
    else:
        # both ranks time one process on the whole sequence too, round after round, so
        # the baseline meets the same contention (as bench_parallel.py does)
        single = attnres.Attention(heads, size, dtype="float32", causal=causal)
        gen = torch.Generator().manual_seed(0)
        whole = [torch.randn(1, seq, heads, size, generator=gen) for _ in range(3)]
        times: dict[str, list[float]] = {"one": [], "ring": [], "one_cpu": [], "ring_cpu": []}
        with torch.inference_mode():
            layer(q, k, v)
            single(*[t[:, :256] for t in whole])
            for _ in range(rounds):
                for name, run, args in (("one", single, whole), ("ring", layer, (q, k, v))):
                    dist.barrier()  # both ranks start the call together
                    start, cpu = time.perf_counter(), time.thread_time()
                    run(*args)
                    times[name].append(time.perf_counter() - start)
                    times[f"{name}_cpu"].append(time.thread_time() - cpu)
        result = {**times, "threads": torch.get_num_threads()}
    Path(folder, f"{what}.{world}.{causal}.{rank}.json").write_text(json.dumps(result))
    if sp is not None:
        dist.destroy_process_group()


def _run(
    world: int, folder: str, what: str, seq: int, causal: bool, rounds: int
) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_job, args=(r, world, folder, what, seq, causal, rounds))
        for r in range(world)
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


#: issue 35's bars (2 ranks, 16k tokens, CPU): per rank against one process
TIME_BAR, PEAK_BAR = 0.55, 0.6


def _load() -> str:
    """The 1-minute load average (what ``uptime`` shows first)."""
    return f"{os.getloadavg()[0]:.2f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--what", default="memory,time")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds per process")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="attnres-sp-measure-")
    summary: dict[str, float] = {}
    for what in args.what.split(","):
        if what == "memory":
            # every large tensor its own mapping, returned when freed: resident memory
            # then follows live tensors (glibc's adaptive threshold otherwise keeps
            # freed blocks); the spawned ranks inherit it
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
        else:  # timing: the allocator a user has (fresh pages cost the ring more)
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        for causal in (False, True):
            if what == "time":
                load = _load()
                two = _run(2, folder, what, args.seq, causal, args.rounds)
                # per round, the worse rank's ratio (a ring step waits for the slower rank)
                wall = [max(r["ring"][i] / r["one"][i] for r in two) for i in range(args.rounds)]
                cpu = [
                    max(r["ring_cpu"][i] / r["one_cpu"][i] for r in two) for i in range(args.rounds)
                ]
                ones = ", ".join(f"{statistics.median(r['one']):.2f} s" for r in two)
                rings = ", ".join(f"{statistics.median(r['ring']):.2f} s" for r in two)
                print(
                    f"time seq={args.seq} causal={causal}: per rank (median), one process "
                    f"{ones}; ring=2 {rings}; ratio of the worse rank per round "
                    f"{', '.join(f'{x:.3f}' for x in wall)} (best {min(wall):.3f}, median "
                    f"{statistics.median(wall):.3f}); CPU time ratio "
                    f"{', '.join(f'{x:.3f}' for x in cpu)} (median "
                    f"{statistics.median(cpu):.3f}); threads per rank "
                    f"{', '.join(str(r['threads']) for r in two)}; load average {load} "
                    f"before, {_load()} after",
                    flush=True,
                )
                summary[f"time causal={causal}"] = statistics.median(wall)
                continue
            one = _run(1, folder, what, args.seq, causal, args.rounds)[0]
            two = _run(2, folder, what, args.seq, causal, args.rounds)
            for key, label in (
                ("kept_alloc", "kept for backward, torch allocations"),
                ("peak_alloc", "training peak, torch allocations"),
                ("kept_bytes", "kept for backward, resident"),
                ("peak_bytes", "training peak, resident"),
            ):
                ratio = max(r[key] / one[key] for r in two)
                print(
                    f"memory seq={args.seq} causal={causal}, {label}: one process "
                    f"{_mib(one[key])}; ring=2 ranks {', '.join(_mib(r[key]) for r in two)}; "
                    f"ratio (worse rank) {ratio:.3f}",
                    flush=True,
                )
                summary[f"{key} causal={causal}"] = ratio
    _summarise(summary)


def _summarise(summary: dict[str, float]) -> None:
    """One line: the four figures (non-causal memory; time causal and not) and the bars."""
    parts = []
    for key, name, bar in (
        ("time causal=False", "non-causal time", TIME_BAR),
        ("time causal=True", "causal time (worse rank)", TIME_BAR),
        ("kept_alloc causal=False", "kept for backward", None),
        ("peak_alloc causal=False", "training peak", PEAK_BAR),
        ("peak_alloc causal=True", "causal training peak", PEAK_BAR),
    ):
        if key not in summary:
            continue
        verdict = "" if bar is None else f" (bar {bar}: {'yes' if summary[key] <= bar else 'NO'})"
        parts.append(f"{name} {summary[key]:.3f}x{verdict}")
    print("summary, ring=2 per rank / one process: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
