"""Worker processes for the sequence-parallel tests (issue 24, ``tests/test_parallel.py``).

Like :mod:`dist_workers`, each rank joins a gloo group through a ``file://``
rendezvous and writes ``result.<rank>.json``. One launch runs a whole list of
scenarios in order (process start-up is the cost, so the combinations are batched):

- ``numerics``: every (ulysses, ring) layout of the world size x self/cross x
  causal or not x MHA/GQA x even/uneven lengths, float32 through the layer
  against a float64 single-process reference; gradients for a subset;
- ``dit``: a tiny DiT block (self-attention, cross-attention to a text shard,
  MLP) under each layout against the same block run on one process;
- ``errors``: a degree that does not divide the group, heads that do not divide
  by ``ulysses``, a ring layout on a kernel without the log-sum-exp;
- ``decide_differently``: rank 1 resolves another backend; the first forward
  must stop every rank with the consensus error;
- ``mismatch`` (issue 32): ranks bound to different dtypes (bf16/fp16,
  fp32/fp64) and ``gather`` given shards of different dtypes or shapes: every
  rank must raise the same ``ConsensusError`` before any data moves;
- ``switch_backend`` (issue 32 item 17): after a verified forward, one rank
  switches its layer's backend (a ``request_backend`` block, a schedule step
  the others did not take; once with the new backend's run already verified
  for that shape): every rank must raise the same ``BackendMismatchError``
  naming both ranks' backends and origins, and the group stays in step;
  ranks that chose one backend in different ways get a consensus error naming
  both origins (they all read ``none``);
- ``dead_peer`` (last): the last rank exits between a training ring's forward
  and its backward; the others' backward, then their next forward, must fail
  with ``SequenceParallelError`` within the timeout (issue 32).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from dist_workers import join_group

#: every collective's bound in these workers (seconds)
TIMEOUT_S = 8.0


def reference(q: Any, k: Any, v: Any, causal: bool, scale: float | None = None) -> Any:
    """Full attention in float64 on one process: (b, s, h, d), top-left causal, GQA."""
    import torch

    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    groups = q64.shape[1] // k64.shape[1]
    k64 = k64.repeat_interleave(groups, 1)
    v64 = v64.repeat_interleave(groups, 1)
    scores = (q64 @ k64.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ v64).transpose(1, 2)


def layouts(world: int) -> list[tuple[int, int]]:
    return [(u, world // u) for u in range(1, world + 1) if world % u == 0]


def _numerics(sp_for: Any, rank: int, world: int) -> dict[str, Any]:
    import torch

    import attnres

    worst = 0.0
    worst_grad = 0.0
    cases = 0
    grads = 0
    for (u, r), role, causal, gqa, uneven in itertools.product(
        layouts(world), ("self", "cross"), (False, True), (False, True), (False, True)
    ):
        sp = sp_for(u, r)
        heads, kv_heads, d = 8, (4 if gqa else 8), 16
        lq = 4 * world + (3 if uneven else 0)
        lkv = lq if role == "self" else 3 * world + (1 if uneven else 0)
        gen = torch.Generator().manual_seed(1000 + cases)
        q = torch.randn(2, lq, heads, d, generator=gen)
        k = torch.randn(2, lkv, kv_heads, d, generator=gen)
        v = torch.randn(2, lkv, kv_heads, d, generator=gen)
        # eager's own log-sum-exp adapter matters only on a ring; Ulysses runs any kernel
        for backend in ("torch_sdpa", "eager") if r > 1 else ("torch_sdpa",):
            layer = attnres.Attention(
                heads,
                d,
                num_kv_heads=kv_heads,
                role=role,
                causal=causal,
                dtype="float32",
                parallel=sp,
                backend=backend,
                name=f"numerics.{u}x{r}.{role}.{causal}.{gqa}.{uneven}.{backend}",
            )
            train = backend == "eager" or (uneven and causal) or r == 1
            qs, ks, vs = (sp.shard(t).clone().requires_grad_(train) for t in (q, k, v))
            out = layer(qs, ks, vs)
            full = sp.gather(out.detach())
            # rank 0 holds the reference (the others only take part in the collectives:
            # the machine running the tests has fewer cores than there are ranks)
            if rank == 0:
                expected = reference(q, k, v, causal)
                worst = max(worst, (full.double() - expected).abs().max().item())
            cases += 1
            if train:
                weight = torch.randn(full.shape, generator=torch.Generator().manual_seed(7))
                (out * sp.shard(weight)).sum().backward()
                if rank == 0:
                    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
                    (reference(q64, k64, v64, causal) * weight.double()).sum().backward()
                for i, mine in enumerate((qs, ks, vs)):
                    assert mine.grad is not None
                    got = sp.gather(mine.grad)
                    if rank == 0:
                        ref = (q64, k64, v64)[i].grad
                        assert ref is not None
                        worst_grad = max(worst_grad, (got.double() - ref).abs().max().item())
                grads += 1
    return {"cases": cases, "grads": grads, "max_err": worst, "max_grad_err": worst_grad}


def _dit(sp_for: Any, rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch import nn

    import attnres

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int, parallel: Any) -> None:
            super().__init__()
            self.heads, self.d = heads, dim // heads
            self.qkv = nn.Linear(dim, 3 * dim)
            self.q2 = nn.Linear(dim, dim)
            self.kv2 = nn.Linear(dim, 2 * dim)
            self.out1, self.out2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            common = {"dtype": "float32", "parallel": parallel}
            self.attn1 = attnres.Attention(heads, self.d, name="block.attn1", **common)
            self.attn2 = attnres.Attention(
                heads, self.d, role="cross", name="block.attn2", **common
            )

        def forward(self, x: Any, text: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, self.d).unbind(2)
            x = x + self.out1(self.attn1(q, k, v).reshape(b, s, -1))
            q = self.q2(x).reshape(b, s, self.heads, self.d)
            k, v = self.kv2(text).reshape(b, text.shape[1], 2, self.heads, self.d).unbind(2)
            x = x + self.out2(self.attn2(q, k, v).reshape(b, s, -1))
            return x + self.mlp(x)

    worst = 0.0
    for u, r in layouts(world):
        torch.manual_seed(0)
        single = Block(32, 4, None)
        parallel = Block(32, 4, sp_for(u, r))
        parallel.load_state_dict(single.state_dict())
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(1, 5 * world + 1, 32, generator=gen)
        text = torch.randn(1, 2 * world + 1, 32, generator=gen)
        sp = sp_for(u, r)
        with torch.no_grad():
            got = sp.gather(parallel(sp.shard(x), sp.shard(text)))
            # a deep copy (EMA weights) shares the layout and computes the same
            again = sp.gather(copy.deepcopy(parallel)(sp.shard(x), sp.shard(text)))
            assert torch.equal(again, got)
            if rank == 0:  # the reference: the same block on one process, in float64
                expected = single.double()(x.double(), text.double())
                worst = max(worst, (got.double() - expected).abs().max().item())
    return {"max_err": worst}


def _errors(sp_for: Any, rank: int, world: int) -> dict[str, Any]:
    import attnres
    from attnres.errors import ResolutionError

    out: dict[str, Any] = {}
    try:
        attnres.SequenceParallel(ulysses=world, ring=2)
    except ValueError as exc:
        out["wrong_degree"] = str(exc)
        out["wrong_degree_type"] = type(exc).__name__
    try:
        attnres.Attention(6, 16, num_kv_heads=3, dtype="float32", parallel=sp_for(world, 1))
    except ResolutionError as exc:
        out["heads"] = [str(exc), exc.code]
    try:
        attnres.Attention(
            8, 16, dtype="float32", parallel=sp_for(1, world), backend="flex_attention"
        )
    except ResolutionError as exc:
        out["no_lse"] = [str(exc), exc.code]
    return out


def _decide_differently(sp_for: Any, rank: int, world: int) -> dict[str, Any]:
    import torch

    import attnres
    from attnres.errors import ConsensusError

    backend = "eager" if rank == 1 else "torch_sdpa"
    sp = attnres.SequenceParallel(ulysses=world, timeout=TIMEOUT_S)  # fresh: nothing verified
    layer = attnres.Attention(8, 16, dtype="float32", parallel=sp, backend=backend, causal=True)
    q = torch.randn(1, 3, 8, 16)
    start = time.monotonic()
    try:
        layer(q, q, q)
    except ConsensusError as exc:
        return {"error": str(exc), "elapsed_s": time.monotonic() - start}
    return {"error": None}


def _mismatch(sp_for: Any, rank: int, world: int) -> dict[str, Any]:
    import torch

    import attnres

    out: dict[str, Any] = {}
    sp = sp_for(world, 1) if world > 1 else sp_for(1, 1)
    ring = sp_for(1, world)
    cases = {
        # (layout, dtype of rank 0, dtype of the others)
        "bf16_fp16": (sp, "bfloat16", "float16"),
        "fp32_fp64": (ring, "float32", "float64"),
    }
    for name, (layout, mine, theirs) in cases.items():
        dtype = mine if rank == 0 else theirs
        layer = attnres.Attention(
            8, 16, dtype=dtype, parallel=layout, backend="eager", name=f"mismatch.{name}"
        )
        q = torch.randn(1, 3, 8, 16, dtype=getattr(torch, dtype))
        try:
            layer(q, q, q)
            out[name] = None
        except attnres.ConsensusError as exc:
            out[name] = str(exc)
    shards = {
        "gather_dtype": torch.zeros(2, 3, 4, dtype=torch.float64 if rank else torch.float32),
        "gather_shape": torch.zeros(2, 3, 4 + rank),
    }
    for name, shard in shards.items():
        try:
            sp.gather(shard)
            out[name] = None
        except attnres.ConsensusError as exc:
            out[name] = str(exc)
    return out


def _switch_backend(sp_for: Any, rank: int, world: int) -> dict[str, Any]:
    import contextlib

    import torch

    import attnres

    out: dict[str, Any] = {}

    def attempt(key: str, run: Any) -> None:
        try:
            run()
            out[key] = {"error": None}
        except attnres.errors.BackendMismatchError as exc:
            out[key] = {
                "error": str(exc),
                "backends": {str(r): b for r, b in exc.backends.items()},
                "consensus": isinstance(exc, attnres.ConsensusError),
            }
        except Exception as exc:  # the defect: a dead peer, or another type
            out[key] = {"error": None, "raw": f"{type(exc).__name__}: {exc}"[:400]}

    q = torch.randn(1, 3, 8, 16)
    for name, (u, r) in {"ulysses": (world, 1), "ring": (1, world)}.items():
        sp = attnres.SequenceParallel(ulysses=u, ring=r, timeout=TIMEOUT_S)
        layer = attnres.Attention(
            8, 16, dtype="float32", parallel=sp, backend="torch_sdpa", name=f"switch.{name}"
        )
        with torch.no_grad():
            layer(q, q, q)  # verified: every rank on torch_sdpa
            # every rank prepares the switches first (no forward), so the rank that
            # switches below arrives at the collective as fast as the other: a slow
            # first preparation on a loaded machine would outlast TIMEOUT_S
            with attnres.request_backend(layer, "eager"):
                pass
            with attnres.schedule(layer, {0: "torch_sdpa", 1: "eager"}):
                pass

            def switched(layer: Any = layer) -> None:
                if rank == 1:
                    with attnres.request_backend(layer, "eager"):
                        layer(q, q, q)
                else:
                    layer(q, q, q)

            attempt(f"{name}.request", switched)

            def stepped(layer: Any = layer) -> None:
                with attnres.schedule(layer, {0: "torch_sdpa", 1: "eager"}) as stepper:
                    stepper.step(1 if rank == 1 else 0)
                    layer(q, q, q)

            attempt(f"{name}.schedule", stepped)
            # eager's run for this shape verified on every rank (another layer):
            # the switch no longer asks for a consensus, and ran silently
            other = attnres.Attention(
                8, 16, dtype="float32", parallel=sp, backend="eager", name=f"other.{name}"
            )
            other(q, q, q)
            attempt(f"{name}.verified", switched)
            attempt(f"{name}.after", lambda layer=layer: layer(q, q, q))  # still in step
    # one backend chosen two ways: the consensus names each rank's origin
    sp = sp_for(world, 1)
    forced = attnres.force_backend("torch_sdpa") if rank == 1 else contextlib.nullcontext()
    with forced:
        chosen = attnres.Attention(
            8, 16, dtype="float32", parallel=sp, name="origins",
            backend=None if rank == 1 else "torch_sdpa",
        )  # fmt: skip
    try:
        with torch.no_grad():
            chosen(q, q, q)
        out["origins"] = None
    except attnres.ConsensusError as exc:
        out["origins"] = str(exc)
    return out


def _dead_peer(sp_for: Any, rank: int, world: int, directory: Path) -> dict[str, Any]:
    import torch

    import attnres

    sp = attnres.SequenceParallel(ring=world, timeout=TIMEOUT_S)
    layer = attnres.Attention(8, 16, dtype="float32", parallel=sp, name="dead_peer")
    q = torch.randn(1, 3, 8, 16, requires_grad=True)
    layer(q, q, q).sum().backward()  # consensus and a training step: every rank alive
    out = layer(q, q, q)  # a training forward; the peer dies before its backward
    if rank == world - 1:
        _write(directory / f"result.{rank}.json", {"dead_peer": "exited"}, merge=True)
        os._exit(0)  # dies without a word, between forward and backward
    time.sleep(0.5)
    result: dict[str, Any] = {}
    for what, step in (
        ("backward", lambda: out.sum().backward()),
        ("forward", lambda: layer(q, q, q)),
    ):
        start = time.monotonic()
        try:
            step()
            result[what] = {"error": None}
        except attnres.SequenceParallelError as exc:
            result[what] = {"error": str(exc), "elapsed_s": time.monotonic() - start}
        except BaseException as exc:  # the defect: gloo's raw error
            result[what] = {"error": None, "raw": f"{type(exc).__name__}: {exc}"[:300]}
    return result


# -- issue 35: the ring's backward in chunks, and its memory per rank ------------------------


def _chunked(sp_for: Any, rank: int, world: int) -> dict[str, Any]:
    """Every ring layout's training step with the backward forced into chunks of
    one key/value head and sequence parts of a few rows (the sizes that trigger
    chunks on their own are too slow for the suite), float32 on both kernels and
    bfloat16 on torch_sdpa, against the float64 reference."""
    import torch

    import attnres
    from attnres import parallel

    saved = parallel.BACKWARD_CHUNKS, parallel.CHUNK_MIN_BYTES, parallel.CHUNK_MIN_ROWS
    parallel.BACKWARD_CHUNKS, parallel.CHUNK_MIN_BYTES, parallel.CHUNK_MIN_ROWS = 16, 0, 1
    worst: dict[str, float] = {}
    cases = 0
    try:
        for (u, r), causal, gqa, uneven, (backend, dtype) in itertools.product(
            [(u, r) for u, r in layouts(world) if r > 1], (False, True), (False, True),
            (False, True), (("torch_sdpa", "float32"), ("eager", "float32"),
                            ("torch_sdpa", "bfloat16")),
        ):  # fmt: skip
            sp = sp_for(u, r)
            heads, kv_heads, d = 4, (2 if gqa else 4), 16
            length = 6 * world + (3 if uneven else 0)
            gen = torch.Generator().manual_seed(2000 + cases)
            q = torch.randn(1, length, heads, d, generator=gen)
            k, v = (torch.randn(1, length, kv_heads, d, generator=gen) for _ in range(2))
            layer = attnres.Attention(
                heads, d, num_kv_heads=kv_heads, causal=causal, dtype=dtype, parallel=sp,
                backend=backend, name=f"chunked.{u}x{r}.{causal}.{gqa}.{uneven}.{backend}.{dtype}",
            )  # fmt: skip
            torch_dtype = getattr(torch, dtype)
            shards = [sp.shard(t).to(torch_dtype).clone().requires_grad_() for t in (q, k, v)]
            out = layer(*shards)
            weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
            (out * sp.shard(weight).to(torch_dtype)).sum().backward()
            got = [sp.gather(out.detach())] + [sp.gather(t.grad) for t in shards]
            if rank == 0:
                full = [t.to(torch_dtype).double().requires_grad_() for t in (q, k, v)]
                expected = reference(*full, causal)
                (expected * weight.double()).sum().backward()
                refs = [expected.detach()] + [t.grad for t in full]
                errors = [
                    (g.double() - ref).abs().max().item() for g, ref in zip(got, refs, strict=True)
                ]
                worst[dtype] = max(worst.get(dtype, 0.0), *errors)
            cases += 1
    finally:
        parallel.BACKWARD_CHUNKS, parallel.CHUNK_MIN_BYTES, parallel.CHUNK_MIN_ROWS = saved
    return {"cases": cases, "max_err": worst}


def _allocated_peak(run: Any) -> tuple[int, int]:
    """(net, peak) bytes torch's CPU allocator handed out while ``run()`` ran, from
    the profiler's allocation events (deterministic: every tensor, nothing else)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return live, peak


def _ring_memory(sp_for: Any, rank: int, world: int) -> dict[str, Any]:
    """A ring's training step at a size where its backward goes in chunks: what the
    forward leaves allocated (kept for backward) and the backward's peak, in units
    of one shard of q (what a rank holds of one input)."""
    import torch

    sp = sp_for(1, world)
    result: dict[str, Any] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU kernel's scratch is per thread
    try:
        for causal in (False, True):
            result[str(causal)] = _ring_memory_step(sp, causal, 2048 * world)
    finally:
        torch.set_num_threads(threads)
    return result


def _ring_memory_step(sp: Any, causal: bool, length: int) -> dict[str, float]:
    import torch

    import attnres

    heads, d = 8, 32
    layer = attnres.Attention(
        heads, d, causal=causal, dtype="float32", parallel=sp, backend="torch_sdpa",
        name=f"memory.{causal}",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    shards = [
        sp.shard(torch.randn(1, length, heads, d, generator=gen)).clone().requires_grad_()
        for _ in range(3)
    ]
    warm = [t.detach()[:, :64].clone().requires_grad_() for t in shards]
    layer(*warm).backward(torch.ones(warm[0].shape))  # kernels and one-time buffers
    held: dict[str, Any] = {}

    def forward() -> None:
        held["out"] = layer(*shards)

    kept, forward_peak = _allocated_peak(forward)
    dout = torch.ones(held["out"].shape)
    _, backward_peak = _allocated_peak(lambda: held["out"].backward(dout))
    shard = shards[0].numel() * shards[0].element_size()
    return {
        "kept": kept / shard, "forward_peak": forward_peak / shard,
        "backward_peak": backward_peak / shard,
    }  # fmt: skip


def _write(path: Path, result: dict[str, Any], merge: bool = False) -> None:
    if merge and path.exists():
        result = {**json.loads(path.read_text()), **result}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True))
    os.replace(tmp, path)


def worker(rank: int, world: int, tmpdir: str, scenarios: list[str]) -> None:
    import torch.distributed as dist

    import attnres

    directory = Path(tmpdir)
    join_group(rank, world, directory, timeout_s=60.0)
    cache: dict[tuple[int, int], Any] = {}

    def sp_for(u: int, r: int) -> Any:
        if (u, r) not in cache:
            cache[(u, r)] = attnres.SequenceParallel(ulysses=u, ring=r, timeout=TIMEOUT_S)
        return cache[(u, r)]

    path = directory / f"result.{rank}.json"
    _write(path, {})
    for scenario in scenarios:
        began = time.monotonic()
        try:
            if scenario == "dead_peer":
                result = _dead_peer(sp_for, rank, world, directory)
            else:
                fn = {
                    "numerics": _numerics,
                    "dit": _dit,
                    "errors": _errors,
                    "decide_differently": _decide_differently,
                    "mismatch": _mismatch,
                    "switch_backend": _switch_backend,
                    "chunked": _chunked,
                    "ring_memory": _ring_memory,
                }[scenario]
                result = fn(sp_for, rank, world)
        except BaseException:  # reported, not raised: the test names it
            result = {"crashed": traceback.format_exc()}
        result["scenario_s"] = round(time.monotonic() - began, 2)
        _write(path, {scenario: result}, merge=True)
    if "dead_peer" in scenarios:
        os._exit(0)  # a group with a dead member cannot be torn down cleanly
    dist.destroy_process_group()
