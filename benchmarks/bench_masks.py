"""Issue 22: the cost of the key-padding route, as ratios measured side by side.

The bar: unpad -> varlen kernel -> pad on a batch with 25% padding costs at most
1.05x the same varlen kernel on the packed tokens alone (what a caller that
already holds packed tokens pays). The kernel is a CPU stand-in with
flash_attn_varlen_func's contract (SDPA per sequence), fp32, one thread. Both
sides compute the same sequences of the same tokens; the route's overhead is
what is measured. attnres runs a key-padding site one of two ways, each with
its own row (both against the same target):

- **span route** (fa3, fa4: their varlen functions take ``seqused_q`` and
  ``seqused_k``): where each row's valid tokens are one run (right or left
  padding), the kernel reads and writes the padded batch where it lies,
  flattened to (batch * seq, heads, head_size), with ``cu_seqlens`` at each
  run's first token; only the uncovered output rows are zeroed afterwards. The
  stand-in then takes ``seqused`` as FA3 does and leaves those rows unwritten;
- **gather route** (fa, sage_attn, aiter; any kernel for padding in the middle,
  as Qwen-Image's joint mask has, or a call that needs a gradient): the valid
  tokens of q, k and v are gathered, the kernel runs on them, and the output is
  scattered back. What this one cannot drop below, by definition: the baseline
  starts from tokens already packed, so the gather and the scatter (linear in
  the tokens, bound by memory bandwidth) are work only the padded side does.
  An informational row measures that floor: the same copies written out by
  hand around the same kernel, with none of the route's logic; the route row's
  excess over it is what attnres adds.

The mask is a self-attention mask that marks the padded queries (rows left and
right padded), passed as the same tensor on every call, as every layer of one
forward receives it (its classification and indices are computed once per
mask: attnres._varlen.mask_plan). Each pair runs ROUNDS rounds, A and B in a
seeded random order per round, on this thread's CPU clock; every row's note
gives the ratio of the medians (the row's value), the ratio of the minima and
the median of the per-round ratios, since on a shared machine one of them alone
can mislead. Informational rows:

- the first layer of a forward: a new mask object on every call (classify and
  index each time);
- both pairs in a child process whose C allocator keeps freed memory
  (``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``), as CUDA's caching
  allocator does for the real kernels: with glibc's defaults a large tensor
  allocated per call (the packed q, k, v; the kernel's output) may come from
  fresh pages, and the first-touch page faults land on either side. The main
  rows' notes give the minor page faults per call of each side;
- each route's own time per call at a tiny shape with an identity kernel (what
  a fast GPU kernel sees added), for a kept mask plan and a new mask each call.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from conftest import CLOCKS, paired
from torch import Tensor

from attnres._varlen import pack, packing, pad, padded_kernel, unpad
from attnres.kernels._common import VarlenAdapter

if TYPE_CHECKING:
    from conftest import PairedResult, RatioRegistry

    Paired = Callable[..., PairedResult]

BATCH, SEQ, HEADS, HEAD_SIZE = 4, 512, 8, 64
#: valid tokens per row: 1536 of 2048, 25% padding (left and right mixed below)
LENGTHS = (512, 384, 448, 192)
TARGET = 1.05
ROUNDS = 60
#: the routes measured: name -> whether its kernel takes seqused (docstring)
ROUTES = {"span": True, "gather": False}
LABELS = {
    "span": "span route (fa3, fa4: seqused, no gather): route",
    "gather": "gather route (fa, sage_attn, aiter): unpad+kernel+pad",
}


def varlen_stand_in(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float | None,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
) -> Tensor:
    """flash_attn_varlen_func's contract on the CPU: SDPA per sequence. With
    ``seqused_q``/``seqused_k``, FA3's and FA4's: sequence i is the ``seqused[i]``
    tokens from ``cu_seqlens[i]`` on, and rows no sequence covers are left
    unwritten (the real kernels allocate their output empty)."""
    out = q.new_empty(q.shape)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    ends_q, ends_k = starts_q[1:], starts_k[1:]
    if seqused_q is not None and seqused_k is not None:
        ends_q = [a + n for a, n in zip(starts_q, seqused_q.tolist(), strict=False)]
        ends_k = [a + n for a, n in zip(starts_k, seqused_k.tolist(), strict=False)]
    for i in range(len(starts_q) - 1):
        qs, ks = slice(starts_q[i], ends_q[i]), slice(starts_k[i], ends_k[i])
        out[qs] = F.scaled_dot_product_attention(
            q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
            is_causal=causal, scale=scale,
        ).transpose(0, 1)  # fmt: skip
    return out


def _never(*args: Any) -> Tensor:
    raise AssertionError("the benchmark passes a mask on every call")


def _route(seqused: bool) -> Callable[..., Tensor]:
    """The key-padding route over the stand-in, through the adapter class the real
    varlen kernels use (``takes_seqused`` as FA3/FA4's, or not, as FA2's)."""
    adapter = VarlenAdapter(varlen_stand_in, takes_seqused=seqused)
    return padded_kernel("bench", _never, lambda: adapter)


class Pair(NamedTuple):
    """One route and the packed baseline, on the same tokens."""

    through_route: Callable[[], Tensor]
    packed_alone: Callable[[], Tensor]
    new_mask_each_call: Callable[[], Tensor]
    #: the route's data movement written out with nothing else (gather route only:
    #: pack q, k and v, the kernel, pad the output): the floor any gather route has
    copies_alone: Callable[[], Tensor] | None = None


def _pairs() -> dict[str, Pair]:
    """Per route: (route, packed alone, route with a new mask object)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, SEQ, HEADS, HEAD_SIZE, generator=gen) for _ in range(3))
    positions = torch.arange(SEQ)
    counts = torch.tensor(LENGTHS)[:, None]
    left = torch.tensor([False, True, False, True])[:, None]
    valid = torch.where(left, positions >= SEQ - counts, positions < counts)
    assert int(valid.sum()) == 3 * BATCH * SEQ // 4  # 25% padding
    # self-attention whose mask marks the padded queries (query i is token i), so the
    # route drops them as the packed baseline does; a [B, 1, 1, S] mask every query
    # shares computes every query, as SDPA does (docs/masks.md)
    mask = valid[:, None, None, :] & valid[:, None, :, None]
    packed = [unpad(t, valid) for t in (q, k, v)]
    cu, longest = packed[0].cu_seqlens, packed[0].max_seqlen
    kept = packing(valid, with_padded=True)  # as a kept mask plan holds it

    def copies_alone() -> Tensor:
        out = varlen_stand_in(
            pack(q, kept), pack(k, kept), pack(v, kept), cu, cu, longest, longest, False, None
        )
        return pad(out, kept, BATCH, SEQ)

    def packed_alone() -> Tensor:
        return varlen_stand_in(
            packed[0].packed, packed[1].packed, packed[2].packed, cu, cu, longest, longest,
            False, None,
        )  # fmt: skip

    pairs = {}
    for name, seqused in ROUTES.items():
        route = _route(seqused)

        def through_route(route: Callable[..., Tensor] = route) -> Tensor:
            return route(q, k, v, mask, False, None)

        def new_mask_each_call(route: Callable[..., Tensor] = route) -> Tensor:
            return route(q, k, v, mask.clone(), False, None)

        with torch.inference_mode():
            out = through_route()
            torch.testing.assert_close(out[valid], packed_alone(), rtol=0, atol=0)
            assert bool((out[~valid] == 0).all())
            if not seqused:
                torch.testing.assert_close(copies_alone(), out, rtol=0, atol=0)
        floor = None if seqused else copies_alone
        pairs[name] = Pair(through_route, packed_alone, new_mask_each_call, floor)
    return pairs


def _faults_per_call(fn: Callable[[], Tensor], calls: int = 5) -> float:
    """Minor page faults per call (fresh pages the C allocator hands out)."""
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def _overhead_at_a_tiny_shape(seqused: bool, calls: int = 2000) -> tuple[float, float]:
    """The route's own time per call, µs (same mask, new mask object), where the
    kernel costs nothing: what it adds to a fast GPU kernel."""
    q = torch.randn(2, 16, 2, 8)
    valid = torch.arange(16) < torch.tensor([[16], [9]])
    mask = valid[:, None, None, :]

    def identity(q: Tensor, *rest: Any, **keywords: Any) -> Tensor:
        return q

    route = padded_kernel("bench", _never, lambda: VarlenAdapter(identity, takes_seqused=seqused))
    per_call = []
    for fresh in (False, True):
        for _ in range(calls // 10):  # warm-up
            route(q, q, q, mask.clone() if fresh else mask, False, None)
        start = time.perf_counter_ns()
        for _ in range(calls):
            route(q, q, q, mask.clone() if fresh else mask, False, None)
        per_call.append((time.perf_counter_ns() - start) / calls / 1e3)
    return per_call[0], per_call[1]


#: the child process: glibc keeps freed memory instead of returning it to the system
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31)}


def _measure(pair: Pair, rounds: int = ROUNDS) -> PairedResult:
    return paired(
        pair.through_route, pair.packed_alone, rounds=rounds, inner=1, clock=CLOCKS["thread"]
    )


def _ratios(result: PairedResult) -> str:
    return (
        f"ratio of minima {result.min_ratio:.3f}x, median of per-round ratios "
        f"{result.round_ratio:.3f}x"
    )


def measure_in_this_process() -> str:
    """Both main pairs, as JSON (what the child process of the allocator rows runs)."""
    torch.set_num_threads(1)
    pairs = _pairs()
    with torch.inference_mode():
        return json.dumps(
            {name: json.loads(_measure(pair).to_json()) for name, pair in pairs.items()}
        )


def _in_a_child_keeping_freed_memory() -> dict[str, dict[str, float]]:
    here = Path(__file__).resolve().parent
    env = {**os.environ, **KEEP_FREED}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", "import bench_masks; print(bench_masks.measure_in_this_process())"],
        env=env, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    measured: dict[str, dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured


def test_key_padding_route_vs_packed_tokens(
    benchmark: Any, ratios: RatioRegistry, paired: Paired
) -> None:
    pairs = _pairs()
    name = "key padding 4x512x8x64 (25% padding)"
    with torch.inference_mode():
        # CPU time of this thread (torch runs on one thread here): the shared
        # machine's load does not land on one side of the pair
        for route, pair in pairs.items():
            result = _measure(pair)
            faults = _faults_per_call(pair.through_route), _faults_per_call(pair.packed_alone)
            ratios.record(
                f"{name}, {LABELS[route]} / kernel on packed tokens",
                result.ratio,
                target=TARGET,
                note=f"{result.describe()}; {_ratios(result)}; minor page faults per call "
                f"{faults[0]:.0f} vs {faults[1]:.0f}",
            )
            benchmark.extra_info[f"ratio_{route}_vs_packed"] = result.ratio
            benchmark.extra_info[f"min_ratio_{route}_vs_packed"] = result.min_ratio
            if pair.copies_alone is not None:
                floor = _measure(pair._replace(through_route=pair.copies_alone))
                ratios.record(
                    f"{name}, {route} route's copies written out alone (pack q, k, v; "
                    f"kernel; pad) / kernel on packed tokens",
                    floor.ratio,
                    note=f"{floor.describe()}; {_ratios(floor)}; the floor of any gather "
                    f"route on this machine: the route row's excess over it is attnres's",
                )
                benchmark.extra_info[f"ratio_{route}_copies_alone"] = floor.ratio
        for route, pair in pairs.items():
            first = _measure(pair._replace(through_route=pair.new_mask_each_call), ROUNDS // 3)
            ratios.record(
                f"{name}, {route} route, first layer of a forward (new mask object: "
                f"classify, index)",
                first.ratio,
                note=f"{first.describe()}; {_ratios(first)}",
            )
            benchmark.extra_info[f"ratio_{route}_first_layer"] = first.ratio
        child = _in_a_child_keeping_freed_memory()
        for route, measured in child.items():
            ratios.record(
                f"{name}, {route} route, allocator keeping freed memory (no first-touch "
                f"page faults)",
                measured["ratio"],
                note=f"child process, {', '.join(f'{k}={v}' for k, v in KEEP_FREED.items())}; "
                f"ratio of minima {measured['min_ratio']:.3f}x, median of per-round ratios "
                f"{measured['round_ratio']:.3f}x",
            )
            benchmark.extra_info[f"ratio_{route}_keeping_freed_memory"] = measured["ratio"]
        benchmark.extra_info["target"] = TARGET
    # torch.no_grad, as diffusers pipelines run: a mask made under inference_mode is an
    # inference tensor, which has no version counter, so its plan is not kept
    with torch.no_grad():
        for route, seqused in ROUTES.items():
            overhead = _overhead_at_a_tiny_shape(seqused)
            ratios.record(
                f"key padding 2x16x2x8, {route} route: its own time per call (identity "
                f"varlen kernel)",
                overhead[0],
                unit="µs",
                note=f"same mask object, no_grad; a new mask object (or an inference-mode "
                f"mask) each call: {overhead[1]:.1f} µs; wall clock: what a fast GPU kernel "
                f"sees added",
            )
            benchmark.extra_info[f"route_us_tiny_{route}"] = overhead[0]
    with torch.inference_mode():
        benchmark.pedantic(pairs["span"].through_route, rounds=10, iterations=1, warmup_rounds=1)
