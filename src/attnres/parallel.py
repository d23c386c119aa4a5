"""Sequence-parallel attention over ``torch.distributed``: Ulysses, ring and both (issue 24).

``attnres.Attention(..., parallel=attnres.SequenceParallel(group, ulysses=U, ring=R))``
runs attention over a sequence sharded across the ``U * R`` ranks of ``group``
(the caller owns the group). Every rank passes its own shard of q, k and v
(``(batch, seq_shard, heads, head_size)``) and gets its shard of the output.

Layout (group rank ``r``): ``r % U`` is its place in a Ulysses group, ``r // U``
its place on the ring; shards are in rank order along the sequence.

- **Ulysses** (``U > 1``): one all-to-all turns "my shard, all heads" into "the
  whole Ulysses group's sequence, ``1/U`` of the heads"; the kernel runs on that;
  a second all-to-all turns the output back. Any kernel the machine selects.
- **Ring** (``R > 1``): each rank keeps its query block and passes key/value
  blocks around the ring (``R - 1`` point-to-point shifts); the partial outputs
  are merged by their softmax log-sum-exp, so the kernel must return it
  (the machine's ``layout`` check, ``BackendSpec.lse``). Causal blocks in the
  future are skipped; a block that straddles the diagonal is split into a full
  part and a top-left causal part, so no kernel needs a mask. A causal ring is
  zig-zag balanced (issue 35): ring rank ``r`` works on halves ``r`` and
  ``2R-1-r`` of the sequence, exchanged with its ring peers on the way in and
  back on the way out, so the caller's shards stay contiguous.
- **USP** (both): Ulysses inside, ring outside.
- Issue 35: **padded Ulysses** (heads zero-padded to a multiple of ``U``),
  **AllGather-KV** (``allgather=A``: each rank keeps its query shard and
  all-gathers K and V; alone or with Ulysses inside), **key-padding masks**
  gathered with the keys (not on a ring), **joint attention** with replicated
  text tokens (``text_tokens``), and ``layout="auto"``.

Uneven lengths: shards follow ``torch.tensor_split`` (the first ``L % (U*R)``
ranks hold one token more; a rank may hold none) and are exchanged with uneven
split sizes, so nothing is padded and nothing needs masking. Every forward
first gathers the shard lengths of all ranks (one small all-gather).
:meth:`SequenceParallel.shard` and :meth:`SequenceParallel.gather` cut and
reassemble a full tensor that way.

Not supported under a layout (a ``ValueError``): a mask other than key padding,
any mask on a ring; ``window`` with ``ring > 1`` or ``allgather > 1``.
Gradients flow: an all-to-all's backward is the reverse all-to-all; the
ring's backward recomputes every block from the merged log-sum-exp
(:class:`_Ring`, issue 35), so a training forward keeps memory linear in the
sequence.

Verified and bounded (``docs/sequence-parallel.md``):

- at construction: ``U * R`` must equal the group's size (``ValueError``);
  a layer's per-rank kernel is resolved with the layout (``LayerSpec.layout``),
  so a kernel without the log-sum-exp, or head counts that do not divide by
  ``U``, are traced rejections;
- every forward starts with one fixed-width all-gather of each rank's facts
  (shard lengths, batch, dtype, head counts): anything but the lengths that
  differs stops every rank with a ``ConsensusError`` before any data moves
  (issue 32); while any rank has not verified a bound layer shape, every rank's
  decision for the layout then goes through :func:`attnres.verify_consensus`:
  a rank that decided differently stops every rank with a ``ConsensusError``;
- every collective is started asynchronously and waited for with the layout's
  ``timeout`` (at most a week): a dead peer (connection reset, at launch or in
  the wait, a ring's backward included) or one that never arrives is a
  :class:`SequenceParallelError` within that bound, never a hang.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from attnres._outcome import Outcome
from attnres._vocab import MaskKind
from attnres.backends import Backend
from attnres.distributed import (
    DEFAULT_TIMEOUT_S,
    _group_position,
    _timeout_seconds,
    verify_consensus,
)
from attnres.errors import (
    ArgumentTypeError,
    BackendMismatchError,
    ConsensusError,
    InvalidArgumentError,
    SequenceParallelArgumentError,
    SequenceParallelError,
)
from attnres.kernels.lse import (
    LseBackwardFn,
    LseKernelFn,
    get_lse_backward,
    get_lse_kernel,
    lse_has_gradient,
)
from attnres.layout import SequenceLayout, padded_heads
from attnres.ledger import Decision
from attnres.machine import LayoutFacts, choose_layout

if TYPE_CHECKING:
    from attnres.trace import Trace

__all__ = ["SequenceParallel", "SequenceParallelError"]


class SequenceParallel:
    """A sequence-parallel layout over a process group: ``ulysses * ring`` ranks.

    ``group``: a ``torch.distributed`` process group (``None``: the default
    group), created and owned by the caller; ``ulysses`` and ``ring``: the
    degrees, whose product must be the group's size; ``timeout``: seconds (or a
    ``timedelta``) that bounds every collective and the first forward's
    consensus (default 60 s).

    Issue 35 (docs/sequence-parallel.md): ``allgather``: the AllGather-KV degree
    (each rank keeps its query shard and all-gathers K and V; composes with
    Ulysses inside, not with a ring); ``pad_heads``: Ulysses zero-pads the heads
    to a multiple of ``ulysses`` and drops the padding after; ``text_tokens``:
    joint attention, every rank's q, k, v start with that many replicated text
    tokens; ``layout="auto"``: each layer's layout is chosen by
    ``attnres.machine.LAYOUT_RULES`` (:meth:`for_layer`) from its facts, the
    group's size, ``seq_len`` (the full sequence, for the AllGather-KV memory
    rule, bounded by ``kv_budget`` bytes per rank) and ``interconnect``
    (``"nvlink"``, ``"pcie"``, or ``"measure"``: one timed all-reduce).

    Raises :class:`~attnres.errors.SequenceParallelArgumentError` (a
    ``ValueError``) for a degree or a timeout out of bounds, or degrees that do
    not match the group, naming the argument and its bound;
    :class:`~attnres.errors.SequenceParallelError` (a ``RuntimeError``) when
    ``torch.distributed`` is not initialised or this process is not in ``group``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        ulysses: int = 1,
        ring: int = 1,
        timeout: float | timedelta | None = None,
        allgather: int = 1,
        pad_heads: bool = False,
        layout: str | None = None,
        text_tokens: int = 0,
        interconnect: str | None = None,
        seq_len: int | None = None,
        kv_budget: int | None = None,
    ) -> None:
        # issue 35: layout="auto" leaves the degrees to each layer's facts
        auto = _auto(layout, ulysses, ring, allgather, pad_heads)
        # validates the degrees (an auto layout spans the group, checked below)
        shape = SequenceLayout(ulysses=ulysses, ring=ring, allgather=allgather, pad_heads=pad_heads)
        text_tokens = _count("text_tokens", text_tokens, 0)
        seq_len = None if seq_len is None else _count("seq_len", seq_len, 1)
        budget = _DEFAULT_KV_BUDGET if kv_budget is None else _count("kv_budget", kv_budget, 1)
        if interconnect not in (None, *_INTERCONNECTS, "measure"):
            raise SequenceParallelArgumentError(
                f"interconnect: expected one of {', '.join(_INTERCONNECTS)}, 'measure' or None, "
                f"got {interconnect!r}",
                "interconnect",
                ", ".join((*_INTERCONNECTS, "measure")),
            )
        # bounded before anything else (issue 32: 1e300 overflowed timedelta)
        timeout_s = _timeout_seconds(
            DEFAULT_TIMEOUT_S if timeout is None else timeout, "SequenceParallel"
        )
        if not (dist.is_available() and dist.is_initialized()):
            raise SequenceParallelError(
                "SequenceParallel needs torch.distributed to be initialised: call "
                "torch.distributed.init_process_group first (every rank of the group)"
            )
        size, rank = _group_position(group, SequenceParallelError, "SequenceParallel", "build")
        if shape.degree != size and not auto:
            raise SequenceParallelArgumentError(
                f"SequenceParallel: {shape.ulysses_ring()} spans "
                f"{shape.degree} ranks, but the group has {size}; choose degrees whose product "
                f"is the group's size",
                "ulysses x ring",
                size,
            )
        self.group = group
        self.ulysses = shape.ulysses
        self.ring = shape.ring
        self.allgather = shape.allgather
        self.pad_heads = shape.pad_heads
        self.size = size
        self.rank = rank
        self.timeout_s = timeout_s
        self._wait = timedelta(seconds=self.timeout_s)
        #: seconds this rank spent in the layout's collectives, waits included (the bench)
        self.comm_seconds = 0.0
        #: issue 35: replicated text tokens at the front of every rank's q, k, v (MMDiT)
        self.text_tokens = text_tokens
        #: issue 35: ``"auto"`` when each layer's layout is chosen (``for_layer``)
        self.auto = auto
        self.seq_len, self.kv_budget = seq_len, budget
        self.chosen: SequenceLayout | None = None
        self._children: dict[Any, SequenceParallel] = {}
        self.interconnect, self.interconnect_source = "unknown", "not declared"
        if interconnect == "measure":
            self.interconnect, self.interconnect_source = self._measure_interconnect()
        elif interconnect is not None:
            self.interconnect, self.interconnect_source = interconnect, "declared"

    def __repr__(self) -> str:
        if self.auto:
            return f"SequenceParallel(layout='auto', rank {self.rank} of {self.size})"
        extra = f", allgather={self.allgather}" if self.allgather > 1 else ""
        extra += ", pad_heads=True" if self.pad_heads else ""
        return (
            f"SequenceParallel(ulysses={self.ulysses}, ring={self.ring}{extra}, rank "
            f"{self.rank} of {self.size})"
        )

    # -- issue 35: the layout as a decision -------------------------------------------

    def _measure_interconnect(self) -> tuple[str, str]:
        """One timed all-reduce of 4 MiB (after one warm-up): every rank takes the
        slowest rank's time (a max all-reduce), so every rank classifies alike."""
        numel = 1 << 20
        buf = torch.ones(numel, dtype=torch.float32)
        self._all_reduce(buf)  # warm-up: connections
        began = time.perf_counter()
        self._all_reduce(buf)
        elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        self._all_reduce(elapsed, dist.ReduceOp.MAX)
        seconds = max(float(elapsed.item()), 1e-9)
        # a ring all-reduce moves 2 (P-1)/P of the buffer over each rank's link
        moved = 4 * numel * 2 * (self.size - 1) / max(self.size, 1)
        gbps = moved / seconds / 1e9
        kind = "nvlink" if gbps >= _FAST_LINK_GBPS else "pcie"
        return kind, (
            f"measured {gbps:.3g} GB/s by a timed all-reduce of 4 MiB (slowest rank; "
            f"nvlink-class at {_FAST_LINK_GBPS:g} GB/s or more)"
        )

    def for_layer(self, num_heads: int, num_kv_heads: int, spec: Any = None) -> SequenceParallel:
        """The layout one layer runs: this one, or -- ``layout="auto"`` -- the layout
        ``attnres.machine.LAYOUT_RULES`` choose from the layer's facts (heads, kv
        heads, causal, key-padding mask), the group's size, the declared sequence
        and the interconnect; layers of the same facts share it."""
        if not self.auto:
            return self
        requirements = getattr(spec, "requirements", None)
        causal = bool(getattr(requirements, "causal", False))
        mask = getattr(requirements, "mask", MaskKind.NONE) is not MaskKind.NONE
        kv_bytes = 0
        if spec is not None:  # one key and one value row of one head
            itemsize = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
            kv_bytes = 2 * spec.head_size * itemsize
        key = (num_heads, num_kv_heads, causal, mask, kv_bytes)
        child = self._children.get(key)
        if child is None:
            facts = LayoutFacts(
                self.size, num_heads, num_kv_heads, causal, mask, self.seq_len,
                kv_bytes, self.kv_budget, self.interconnect, self.interconnect_source,
            )  # fmt: skip
            chosen = choose_layout(facts)
            child = object.__new__(SequenceParallel)
            child.__dict__.update(self.__dict__)
            child.auto, child._children = False, {}
            child.ulysses, child.ring = chosen.ulysses, chosen.ring
            child.allgather, child.pad_heads = chosen.allgather, chosen.pad_heads
            child.chosen = chosen
            self._children[key] = child
        return child

    def _all_reduce(self, x: Tensor, op: Any = None) -> None:
        self._bounded(
            "all_reduce",
            lambda: dist.all_reduce(
                x, op=dist.ReduceOp.SUM if op is None else op, group=self.group, async_op=True
            ),
        )

    # A layout holds the caller's process group: a copied model (EMA weights,
    # ``copy.deepcopy``) shares it; pickling one is an error that says so.
    def __copy__(self) -> SequenceParallel:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SequenceParallel:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ArgumentTypeError(
            "attnres.SequenceParallel holds a torch.distributed process group and cannot be "
            "pickled; save the model's state_dict and build its layers with a layout again "
            "in the loading process"
        )

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses

    @property
    def ring_rank(self) -> int:
        return self.rank // self.ulysses

    def layout(
        self, num_heads: int | None = None, num_kv_heads: int | None = None
    ) -> SequenceLayout:
        """The layout as the resolver sees it, for a layer of these head counts."""
        if self.auto:
            raise InvalidArgumentError(
                "layout='auto' chooses per layer: call for_layer(num_heads, num_kv_heads, "
                "requirements) first (attnres.Attention does)"
            )
        if self.chosen is not None:  # issue 35: the rule and why ride along
            return attrs.evolve(self.chosen, num_heads=num_heads, num_kv_heads=num_kv_heads)
        return SequenceLayout(
            self.ulysses, self.ring, num_heads, num_kv_heads,
            allgather=self.allgather, pad_heads=self.pad_heads,
        )  # fmt: skip

    # -- shards -------------------------------------------------------------------

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's shard of a full tensor along ``dim`` (``torch.tensor_split``)."""
        return torch.tensor_split(x, self.size, dim=dim)[self.rank]

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """The full tensor from every rank's shard along ``dim`` (bounded; no grad).

        Every rank's dtype and shape apart from ``dim`` must agree: they are compared
        (one small all-gather) before any data moves, and a difference is a
        :class:`~attnres.ConsensusError` on every rank (issue 32)."""
        dim = dim % x.dim() if x.dim() else dim
        moved = x.movedim(dim, 0).contiguous()
        tail = moved.shape[1:]
        facts = [x.shape[dim], _dtype_code(x.dtype), x.dim(), dim, *_shape_code(tuple(tail))]
        rows_list = self._gather_facts("gather", facts, x.device)
        if any(row[1:] != rows_list[0][1:] for row in rows_list):
            mine = f"{x.dtype} {tuple(x.shape)} along dim {dim}"
            raise ConsensusError(
                f"SequenceParallel.gather: the ranks' shards differ in dtype or in shape "
                f"outside dim {dim} (rank {self.rank}: {mine}; "
                f"{_disagreeing(rows_list, 1)} with rank 0), so nothing was "
                f"exchanged; pass shards of one dtype whose other dimensions match"
            )
        lengths = [row[0] for row in rows_list]
        per = int(torch.Size(tail).numel())
        most = max(lengths)
        # gloo gathers equal sizes only: every shard is padded to the longest, then cut
        flat = torch.zeros(most * per, dtype=x.dtype, device=x.device)
        flat[: moved.numel()] = moved.reshape(-1)
        parts = [torch.empty(most * per, dtype=x.dtype, device=x.device) for _ in lengths]
        self._bounded(
            "all_gather", lambda: dist.all_gather(parts, flat, group=self.group, async_op=True)
        )
        full = torch.cat(
            [p[: n * per].reshape(n, *tail) for p, n in zip(parts, lengths, strict=True)]
        )
        return full.movedim(0, dim)

    # -- bounded collectives -------------------------------------------------------

    def _failure(self, what: str, exc: BaseException) -> SequenceParallelError:
        return SequenceParallelError(
            f"sequence-parallel {what} failed on rank {self.rank} of {self.size} "
            f"(ulysses={self.ulysses} x ring={self.ring}, timeout {self.timeout_s:g} s): "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. A peer died, "
            f"hangs, or took a different code path; the group is out of step, so restart "
            f"the job"
        )

    def _launch(self, what: str, start: Callable[[], Any]) -> Any:
        """``start()``, a collective's launch: gloo raises there, not only in the
        wait, when a peer's connection is gone (issue 32: a peer that died between
        a ring's forward and backward)."""
        try:
            return start()
        except SequenceParallelError:
            raise
        except RuntimeError as exc:
            raise self._failure(what, exc) from exc

    def _bounded(self, what: str, start: Callable[[], Any]) -> None:
        """Launch a collective and wait for it within the layout's timeout."""
        self._wait_for(what, self._launch(what, start))

    def _wait_for(self, what: str, work: Any) -> None:
        began = time.perf_counter()
        try:
            work.wait(timeout=self._wait)
        except RuntimeError as exc:
            raise self._failure(what, exc) from exc
        self.comm_seconds += time.perf_counter() - began

    def _gather_facts(self, what: str, facts: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``facts`` (one all-gather of a fixed width, whatever the
        call, so ranks on different code paths exchange equal sizes and are told
        so instead of gloo aborting on a size mismatch; issue 32)."""
        row = [_FACT_KINDS.index(what), *facts]
        row += [0] * (_FACTS_WIDTH - len(row))
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        rows = self._all_gather_ints(mine).tolist()
        kinds = [_FACT_KINDS[r[0]] if 0 <= r[0] < len(_FACT_KINDS) else "?" for r in rows]
        if len(set(kinds)) > 1:
            raise ConsensusError(
                f"sequence-parallel ranks took different code paths before any data moved: "
                f"{', '.join(f'rank {i} -> {k}' for i, k in enumerate(kinds))}; every rank "
                f"must make the same calls in the same order"
            )
        return [r[1 : len(facts) + 1] for r in rows]

    def _all_gather_ints(self, mine: Tensor) -> Tensor:
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._bounded(
            "all_gather", lambda: dist.all_gather(parts, mine, group=self.group, async_op=True)
        )
        return torch.stack(parts)

    def _all_to_all(self, x: Tensor, send: list[int], recv: list[int]) -> Tensor:
        out = torch.empty(sum(recv), dtype=x.dtype, device=x.device)
        self._bounded(
            "all_to_all",
            lambda: dist.all_to_all_single(out, x, recv, send, group=self.group, async_op=True),
        )
        return out

    def _shift(
        self, xs: Sequence[Tensor], to: int, frm: int, shapes: Sequence[tuple[int, ...]]
    ) -> list[Tensor]:
        """Send ``xs`` to group rank ``to`` and receive tensors of ``shapes`` from ``frm``."""
        outs, works = self._start_shift(xs, to, frm, shapes)
        self._finish_shift(works)
        return outs

    def _start_shift(
        self, xs: Sequence[Tensor], to: int, frm: int, shapes: Sequence[tuple[int, ...]],
        into: Sequence[Tensor] | None = None,
    ) -> tuple[list[Tensor], list[Any]]:  # fmt: skip
        """Start a shift of contiguous tensors, received into ``into`` (contiguous, of
        ``shapes``) or new tensors; :meth:`_finish_shift` waits for it (bounded)."""
        outs = (
            list(into)
            if into is not None
            else [
                torch.empty(n, dtype=x.dtype, device=x.device)
                for x, n in zip(xs, shapes, strict=True)
            ]
        )
        ops = [dist.P2POp(dist.isend, x, group=self.group, group_peer=to) for x in xs]
        ops += [dist.P2POp(dist.irecv, o, group=self.group, group_peer=frm) for o in outs]
        return outs, list(self._launch("ring shift", lambda: dist.batch_isend_irecv(ops)))

    def _finish_shift(self, works: list[Any]) -> None:
        for work in works:
            self._wait_for("ring shift", work)

    # -- the layer's forward -------------------------------------------------------

    def make_run(
        self,
        shape: Any,
        kernel: Any,
        dtypes: frozenset[torch.dtype],
        new_run: Callable[[Any, Any, frozenset[torch.dtype]], Callable[..., Tensor]],
    ) -> Callable[..., Tensor]:
        """The forward of a layer bound to ``kernel`` under this layout.

        ``shape`` is the layer's ``_LayerShape`` (full head counts, the backend);
        ``new_run`` builds a local forward for a shape (``attnres.modules``).
        """
        return _ParallelRun(self, shape, kernel, dtypes, new_run)


#: what a facts all-gather is for (its first column), and every row's width
_FACT_KINDS: tuple[str, ...] = ("forward", "gather")
_FACTS_WIDTH = 12

#: issue 35: the interconnect classes the layout rules read, the bandwidth a
#: measured link needs to count as NVLink-class (PCIe 5.0 x16 is about 64 GB/s
#: each way, NVLink 4 on H100 450), and the default per-rank bound on gathered
#: keys and values (``kv_budget``)
_INTERCONNECTS: tuple[str, ...] = ("nvlink", "pcie")
_FAST_LINK_GBPS = 100.0
_DEFAULT_KV_BUDGET = 1 << 30


def _auto(layout: Any, ulysses: int, ring: int, allgather: int, pad_heads: bool) -> bool:
    if layout is None:
        return False
    if layout != "auto":
        raise SequenceParallelArgumentError(
            f"layout: expected 'auto' or None, got {layout!r}", "layout", "auto"
        )
    if (ulysses, ring, allgather, pad_heads) != (1, 1, 1, False):
        raise SequenceParallelArgumentError(
            "layout='auto' chooses the degrees per layer: leave ulysses, ring, allgather and "
            "pad_heads unset",
            "layout",
            "auto with no degrees",
        )
    return True


def _count(what: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SequenceParallelArgumentError(
            f"{what}: expected an integer of at least {least}, got {value!r}", what, least
        )
    return value


#: the most UTF-8 bytes of a rank's backend label exchanged when the ranks' backends
#: differ (a registered name is at most 64 characters; the origin's word follows)
_LABEL_BYTES = 128


def _dtype_code(dtype: torch.dtype) -> int:
    """A dtype as an integer every rank computes alike (for the facts all-gather)."""
    return zlib.crc32(str(dtype).encode())


def _backend_code(backend: str) -> int:
    """A backend's name as an integer every rank computes alike (the facts all-gather)."""
    return zlib.crc32(backend.encode())


def _dtype_name(code: int, mine: torch.dtype) -> str:
    """The dtype behind a code, among torch's floating dtypes (``dtype #code`` else)."""
    for dtype in (mine, torch.float64, torch.float32, torch.float16, torch.bfloat16):
        if _dtype_code(dtype) == code:
            return str(dtype).removeprefix("torch.")
    return f"dtype #{code}"


def _shape_code(shape: tuple[int, ...]) -> tuple[int, int]:
    """A shape as (number of elements, a checksum of its dimensions)."""
    return int(torch.Size(shape).numel()), zlib.crc32(repr(shape).encode())


def _disagreeing(rows: list[list[int]], first: int) -> str:
    """``ranks 1, 3``: the ranks whose facts from column ``first`` on differ from rank 0's."""
    ranks = [str(i) for i, row in enumerate(rows) if row[first:] != rows[0][first:]]
    return f"ranks {', '.join(ranks)} disagree" if len(ranks) > 1 else f"rank {ranks[0]} disagrees"


class _Lengths(NamedTuple):
    batch: int
    q: list[int]  # per group rank
    kv: list[int]


class _ParallelRun:
    """One bound layer shape's forward under a layout (shared by layers of that shape)."""

    def __init__(
        self,
        sp: SequenceParallel,
        shape: Any,
        kernel: Any,
        dtypes: frozenset[torch.dtype],
        new_run: Callable[[Any, Any, frozenset[torch.dtype]], Callable[..., Tensor]],
    ) -> None:
        u = sp.ulysses
        self.sp = sp
        self.heads, self.kv_heads, self.head_size = (
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_size,
        )
        self.causal, self.scale, self.softcap = shape.causal, shape.softmax_scale, shape.softcap
        self.backend = shape.backend
        #: how the layer's backend was chosen (the resolution's origin): the
        #: consensus reports it (issue 32 item 17: every origin read ``none``)
        self.origin = str(getattr(shape, "origin", "none"))
        self.dtypes = dtypes
        if sp.ring > 1 and shape.window is not None:
            raise InvalidArgumentError(
                "window: sliding-window attention is not supported with ring > 1 (a window "
                "crosses key/value blocks); use a Ulysses-only layout for this layer"
            )
        if sp.allgather > 1 and shape.window is not None:
            raise InvalidArgumentError(
                "window: sliding-window attention is not supported with allgather > 1 (each "
                "rank's query shard would need its global positions); use a Ulysses layout"
            )
        if sp.text_tokens and (sp.ring > 1 or shape.causal or shape.window is not None):
            raise InvalidArgumentError(
                f"text_tokens={sp.text_tokens}: joint attention with replicated text tokens "
                f"runs non-causal, without a window, under Ulysses or AllGather-KV (not a ring); "
                f"this layer has ring={sp.ring}, causal={shape.causal}"
            )
        if sp.allgather > 1 and shape.causal:  # the machine's allgather_causal rules it out
            raise InvalidArgumentError(
                f"allgather={sp.allgather}: AllGather-KV runs non-causal attention only"
            )
        # issue 35: heads zero-padded to a multiple of U (whole GQA groups), dropped after
        heads, kv_heads = shape.num_heads, shape.num_kv_heads
        if sp.pad_heads:
            heads, kv_heads = padded_heads(heads, kv_heads, u)
        self.carried = (heads, kv_heads)
        # what one rank runs: 1/U of the heads (the machine checked they divide)
        self.local_shape = shape._replace(
            num_heads=heads // u, num_kv_heads=kv_heads // u, parallel=None
        )
        self.local = new_run(self.local_shape, kernel, dtypes) if sp.ring == 1 else None
        self.lse: LseKernelFn | None = None
        if sp.ring > 1:
            self.lse = get_lse_kernel(shape.backend)
            if self.lse is None:  # the machine's layout check rules this out
                raise InvalidArgumentError(
                    f"ring={sp.ring}: backend {shape.backend!r} has no log-sum-exp adapter"
                )
            # issue 23: the layer's options reach the log-sum-exp kernel, bound once
            # (a Ulysses-only layout runs the dense kernel, options included)
            self.options = dict(dict(shape.backend_options).get(shape.backend, ()))
            if self.options:
                self.lse = functools.partial(self.lse, **self.options)
        self.lse_grad = lse_has_gradient(shape.backend)
        self._lse_backward: LseBackwardFn | None = None
        self._verified = False
        self._lock = threading.Lock()

    def lse_backward(self) -> LseBackwardFn:
        """The block backward of the ring's kernel, built on the first backward
        (issue 35: a training ring recomputes each block from the log-sum-exp)."""
        if self._lse_backward is None:
            built = get_lse_backward(self.backend)
            if built is None:  # the layer refuses a training ring on such a kernel
                raise SequenceParallelError(
                    f"ring={self.sp.ring} on {self.backend!r}: attnres has no backward from "
                    f"the log-sum-exp for this kernel; run the forward under torch.no_grad()"
                )
            options = getattr(self, "options", None)
            self._lse_backward = functools.partial(built, **options) if options else built
        return self._lse_backward

    # consensus: once per bound shape, before the first collective
    def _verify(self) -> None:
        with self._lock:
            sp = self.sp
            site = (
                f"{sp.layout(self.heads, self.kv_heads).describe()}; "
                f"{self.heads}/{self.kv_heads} heads x {self.head_size}"
                f"{', causal' if self.causal else ''}"
            )
            decision = Decision(
                "sequence_parallel",
                site,
                Outcome("selected", self.origin, Backend(self.backend), None),
                cast("Trace", None),  # the consensus compares backends, not traces
            )
            verify_consensus([decision], group=sp.group, timeout=sp.timeout_s)
            self._verified = True

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        if attn_mask is not None and self.sp.ring > 1:
            raise InvalidArgumentError(
                "attn_mask: masks are not supported on a ring (each block is merged without "
                "one); Ulysses and AllGather-KV layouts take key-padding masks; see "
                "docs/sequence-parallel.md"
            )
        self._check(q, k, v)
        keep = None if attn_mask is None else _key_padding(attn_mask, k)
        if (
            self.lse is not None
            and not self.lse_grad
            and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)
        ):  # the layer's training path re-resolves first; this is the last line of defence
            raise InvalidArgumentError(
                f"ring={self.sp.ring} on {self.backend!r} is inference-only: attnres has no "
                f"backward from its log-sum-exp; run the forward under torch.no_grad(), or "
                f"give the layer a backend with one (eager, fa, torch_sdpa)"
            )
        sp = self.sp
        n = sp.text_tokens
        text: tuple[Tensor, Tensor, Tensor] | None = None
        keep_text = None
        if n:  # issue 35: replicated text tokens in front of this rank's shard (MMDiT)
            if q.shape[1] < n or k.shape[1] < n:
                raise InvalidArgumentError(
                    f"text_tokens={n}: every rank's q, k and v start with the {n} replicated "
                    f"text tokens, then its shard; got q {tuple(q.shape)}, k {tuple(k.shape)}"
                )
            text = (q[:, :n], k[:, :n], v[:, :n])
            q, k, v = q[:, n:], k[:, n:], v[:, n:]
            if keep is not None:
                keep_text, keep = keep[:, :n], keep[:, n:]
        lengths = self._lengths(q, k, keep is not None)
        if sp.pad_heads:
            q, k, v = (_pad_heads(t, h) for t, h in zip((q, k, v), self._carried3(), strict=True))
            if text is not None:
                text = cast(
                    "tuple[Tensor, Tensor, Tensor]",
                    tuple(_pad_heads(t, h) for t, h in zip(text, self._carried3(), strict=True)),
                )
        d = self.head_size
        if sp.ulysses > 1:
            q_blk = _apply(_Ulysses, q, self, lengths.q, True)
            kv_blk = _apply(_Ulysses, torch.cat([k, v], dim=-1), self, lengths.kv, True)
            k_blk, v_blk = kv_blk[..., :d], kv_blk[..., d:]
        else:  # k and v themselves: a ring saves them for its backward, no copy
            q_blk, k_blk, v_blk = q, k, v
        if keep is not None:  # gathered in the order the keys are
            keep = self._gather_keep(keep, lengths.kv)
        if sp.allgather > 1:  # issue 35: every key/value block, on every rank of the gather
            kv_full = _apply(
                _GatherKV, torch.cat([k_blk, v_blk], dim=-1), self, self._block_lengths(lengths.kv)
            )
            k_blk, v_blk = kv_full[..., :d], kv_full[..., d:]
        if sp.ring > 1:
            out_blk = self._ring(q_blk, k_blk, v_blk, lengths)
        else:
            assert self.local is not None
            if text is not None:
                qt, kt, vt = (self._my_heads(_apply(_Replicated, t, self)) for t in text)
                q_blk = torch.cat([qt, q_blk], 1)
                k_blk, v_blk = torch.cat([kt, k_blk], 1), torch.cat([vt, v_blk], 1)
                if keep is not None:
                    assert keep_text is not None
                    keep = torch.cat([keep_text, keep], 1)
            mask = None if keep is None else keep[:, None, None, :]
            out_blk = self.local(q_blk, k_blk, v_blk, mask)
        out_text = None
        if text is not None:
            out_text, out_blk = out_blk[:, :n], out_blk[:, n:]
            if sp.ulysses > 1:
                out_text = _apply(_GatherHeads, out_text.contiguous(), self)
        out = _apply(_Ulysses, out_blk, self, lengths.q, False) if sp.ulysses > 1 else out_blk
        if out_text is not None:
            out = torch.cat([out_text, out], 1)
        if sp.pad_heads:
            out = out[:, :, : self.heads]
        return out

    # -- issue 35: padding, joint text, masks -------------------------------------------

    def _carried3(self) -> tuple[int, int, int]:
        return self.carried[0], self.carried[1], self.carried[1]

    def _my_heads(self, x: Tensor) -> Tensor:
        """This rank's Ulysses share of a replicated tensor's heads."""
        u = self.sp.ulysses
        if u == 1:
            return x
        h = x.shape[2] // u
        i = self.sp.ulysses_rank
        return x[:, :, i * h : (i + 1) * h]

    def _gather_keep(self, keep: Tensor, kv_lens: list[int]) -> Tensor:
        """The key-padding mask of the keys this rank attends over, gathered from the
        ranks whose keys it gathers (its Ulysses group, then the all-gather's ranks),
        in the same order as the keys (no gradient)."""
        sp = self.sp
        flat = keep.to(torch.float32)
        b = keep.shape[0]
        if sp.ulysses > 1:
            members = self._members()
            pieces = _exchange(
                sp, {m: flat for m in members}, {m: b * kv_lens[m] for m in members}, flat
            )
            flat = torch.cat([pieces[m].reshape(b, kv_lens[m]) for m in members], 1)
        if sp.allgather > 1:
            blocks = self._block_lengths(kv_lens)
            outer = self._outer_members()
            pieces = _exchange(
                sp, dict.fromkeys(outer, flat),
                {m: b * blocks[p] for p, m in enumerate(outer)}, flat,
            )  # fmt: skip
            flat = torch.cat([pieces[m].reshape(b, blocks[p]) for p, m in enumerate(outer)], 1)
        return flat > 0.5

    def _outer_members(self) -> list[int]:
        """The group ranks at this rank's Ulysses place, one per outer block."""
        sp = self.sp
        return [p * sp.ulysses + sp.ulysses_rank for p in range(sp.ring * sp.allgather)]

    def _check(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        h, hk, d = self.heads, self.kv_heads, self.head_size
        if (
            q.dim() != 4
            or k.dim() != 4
            or q.shape[2] != h
            or q.shape[3] != d
            or k.shape[2] != hk
            or k.shape[3] != d
            or v.shape != k.shape
            or k.shape[0] != q.shape[0]
            or q.dtype not in self.dtypes
            or k.dtype != q.dtype
            or v.dtype != q.dtype
        ):
            raise InvalidArgumentError(
                f"this sequence-parallel layer takes this rank's shards q (batch, seq_shard, {h}, "
                f"{d}) and k, v (batch, seq_kv_shard, {hk}, {d}) of one dtype "
                f"({', '.join(sorted(str(t).removeprefix('torch.') for t in self.dtypes))}); "
                f"got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                f"v {tuple(v.shape)} {v.dtype}"
            )

    def _lengths(self, q: Tensor, k: Tensor, masked: bool = False) -> _Lengths:
        """Every rank's shard lengths, and the consensus on what the shards are.

        One all-gather of (batch, q length, kv length, dtype, heads, kv heads, head
        size): everything but the lengths must agree across ranks before any data
        moves (issue 32: ranks bound to bf16 and fp16 exchanged raw bytes), else
        every rank raises the same :class:`~attnres.ConsensusError`."""
        facts = [q.shape[0], q.shape[1], k.shape[1], _dtype_code(q.dtype), *q.shape[2:], k.shape[2]]
        facts.append(0 if self._verified else 1)
        facts += [self.sp.text_tokens, int(masked)]  # issue 35: joint text, a mask
        facts.append(_backend_code(self.backend))
        rows = self.sp._gather_facts("forward", facts, q.device)
        agreed = [rows[0][0], *rows[0][3:7], *rows[0][8:10]]
        if any([row[0], *row[3:7], *row[8:10]] != agreed for row in rows):
            described = "; ".join(
                f"rank {i}: batch {row[0]}, {_dtype_name(row[3], q.dtype)}, "
                f"{row[4]}/{row[6]} heads x {row[5]}"
                + (f", {row[8]} text tokens" if row[8] else "")
                + (", a key-padding mask" if row[9] else ", no mask")
                for i, row in enumerate(rows)
            )
            raise ConsensusError(
                f"sequence-parallel ranks disagree on the shards of a layer before any data "
                f"moved ({described}): every rank must pass the same batch size and dtype, "
                f"a mask or none, and bind the same head counts (only the sequence lengths "
                f"may differ); "
                f"build every rank's layer with the same dtype and shapes"
            )
        if any(row[10] != rows[0][10] for row in rows):
            self._backends_differ()
        # a rank that has not verified this shape's decision yet asks every rank to
        # (a rank that verified a shared shape earlier would otherwise skip the store
        # protocol while its peer waited there)
        if any(row[7] for row in rows):
            self._verify()
        return _Lengths(rows[0][0], [r[1] for r in rows], [r[2] for r in rows])

    def _backends_differ(self) -> None:
        """Every rank saw the same rows: the ranks run different backends for this
        layer (issue 32 item 17: a rank that switched its backend mid-run -- a
        ``request_backend`` block, a schedule step, ``force_backend`` -- while the
        others did not was reported as a dead peer, or not at all once both
        backends had been verified). One more fixed-width all-gather brings each
        rank's backend and origin, so every rank raises the same error naming them."""
        label = f"{self.backend} (origin {self.origin})".encode()[:_LABEL_BYTES]
        row = [len(label), *label] + [0] * (_LABEL_BYTES - len(label))
        mine = torch.tensor(row, dtype=torch.int64)
        rows = self.sp._all_gather_ints(mine).tolist()
        labels = [bytes(r[1 : 1 + r[0]]).decode("utf-8", "replace") for r in rows]
        backends = {rank: text.split(" (origin ", 1)[0] for rank, text in enumerate(labels)}
        sp = self.sp
        layout = sp.layout(self.heads, self.kv_heads).describe()
        raise BackendMismatchError(
            f"Ranks disagree on attention backends at a forward of the sequence-parallel "
            f"layer {layout}; {self.heads}/{self.kv_heads} heads x {self.head_size}: "
            f"{', '.join(f'rank {r} -> {t}' for r, t in enumerate(labels))}; no data was "
            f"exchanged. A rank switched its backend (attnres.request_backend, "
            f"attnres.schedule, force_backend) without the others: switch every rank of the "
            f"group alike, at the same step",
            backends,
        )

    # Ulysses groups: ranks ring_rank*U .. ring_rank*U + U - 1
    def _members(self) -> list[int]:
        u = self.sp.ulysses
        base = self.sp.ring_rank * u
        return list(range(base, base + u))

    # -- the ring -----------------------------------------------------------------

    def _block_lengths(self, per_rank: Sequence[int]) -> list[int]:
        u = self.sp.ulysses
        return [sum(per_rank[p * u : (p + 1) * u]) for p in range(self.sp.ring * self.sp.allgather)]

    def _ring(self, q: Tensor, k: Tensor, v: Tensor, lengths: _Lengths) -> Tensor:
        q_lens, kv_lens = self._block_lengths(lengths.q), self._block_lengths(lengths.kv)
        if not self.causal:  # every block costs the same: contiguous blocks
            q_segs, kv_segs = _contiguous(q_lens), _contiguous(kv_lens)
            return _apply(_Ring, q, k, v, self, q_segs, kv_segs)
        # issue 35: zig-zag. Ring rank r works on halves r and 2R-1-r of the sequence
        # (an early and a late one), so every rank does the same causal work; the
        # halves are exchanged on the way in and back on the way out, inside one
        # autograd function that saves the caller's q, k, v and output (no zig-zag copies)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return _apply(_ZigZagRing, q, k, v, self, _halves(q_lens), _halves(kv_lens), training)

    def _block_pieces(self, q_segs: _Segments, kv_segs: _Segments) -> Iterator[_Piece]:
        """The kernel calls of q's segments over one block's segments (local indices);
        full pieces side by side (a zig-zag row over both halves of a block, both
        halves over one) are one call."""
        last: _Piece | None = None
        qs = 0
        for q_len, q0 in q_segs:
            ks = 0
            for kv_len, k0 in kv_segs:
                for r0, r1, c0, c1, causal in self._pieces(q_len, q0, kv_len, k0):
                    piece = _Piece(qs + r0, qs + r1, ks + c0, ks + c1, causal)
                    if last is not None and not (causal or last.causal):
                        if (last.r0, last.r1, last.c1) == (piece.r0, piece.r1, piece.c0):
                            last = last._replace(c1=piece.c1)
                            continue
                        if (last.c0, last.c1, last.r1) == (piece.c0, piece.c1, piece.r0):
                            last = last._replace(r1=piece.r1)
                            continue
                    if last is not None:
                        yield last
                    last = piece
                ks += kv_len
            qs += q_len
        if last is not None:
            yield last

    def _pieces(self, q_len: int, q0: int, kv_len: int, k0: int) -> list[_Piece]:
        """The kernel calls for q's rows (global offset ``q0``) over one key/value
        block (global offset ``k0``): full blocks and top-left causal squares."""
        if q_len == 0 or kv_len == 0:
            return []
        if not self.causal or k0 + kv_len - 1 <= q0:  # every key at or before every query
            return [_Piece(0, q_len, 0, kv_len, False)]
        if k0 > q0 + q_len - 1:  # every key after every query: nothing to see
            return []
        offset = q0 - k0  # query row r sees local keys c <= r + offset
        if offset < 0:  # rows r < -offset see no key of this block
            return _causal_pieces(-offset, q_len, 0, kv_len)
        if offset > 0:  # keys < offset are seen by every row; the rest is top-left causal
            return [_Piece(0, q_len, 0, offset, False), *_causal_pieces(0, q_len, offset, kv_len)]
        return _causal_pieces(0, q_len, 0, kv_len)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, q0: Any, k0: Any, out: Tensor, lse: Tensor
    ) -> None:
        """Merge q's attention over one key/value block at global offsets q0, k0 (or
        segments: ``((length, offset), ...)``), in place, without gradients."""
        assert self.lse is not None
        q_segs = ((q.shape[1], q0),) if isinstance(q0, int) else q0
        kv_segs = ((k.shape[1], k0),) if isinstance(k0, int) else k0
        for r0, r1, c0, c1, causal in self._block_pieces(q_segs, kv_segs):
            part, part_lse = self.lse(
                q[:, r0:r1], k[:, c0:c1], v[:, c0:c1], causal, self.scale, self.softcap
            )
            _merge_into(out[:, r0:r1], lse[..., r0:r1], part, part_lse)


#: a ring block as segments of the global sequence: ((length, global offset), ...)
_Segments = tuple[tuple[int, int], ...]


def _contiguous(lens: list[int]) -> list[_Segments]:
    """Each ring rank's block as one segment."""
    return [((n, sum(lens[:r])),) for r, n in enumerate(lens)]


def _halves(lens: list[int]) -> list[tuple[int, int]]:
    """The 2R halves of the ring blocks in global order: (length, global offset)."""
    chunks: list[tuple[int, int]] = []
    offset = 0
    for n in lens:
        first = (n + 1) // 2
        chunks += [(first, offset), (n - first, offset + first)]
        offset += n
    return chunks


def _pair_lens(chunks: list[tuple[int, int]]) -> list[int]:
    """Each ring rank's contiguous block length from the 2R halves."""
    return [chunks[2 * r][0] + chunks[2 * r + 1][0] for r in range(len(chunks) // 2)]


def _zigzag_ids(ring: int) -> list[tuple[int, int]]:
    """The halves each ring rank holds under zig-zag: r and 2R-1-r (in global order)."""
    return [(r, 2 * ring - 1 - r) for r in range(ring)]


def _zigzag(chunks: list[tuple[int, int]]) -> list[_Segments]:
    """Each ring rank's zig-zag block as segments."""
    ring = len(chunks) // 2
    return [(chunks[a], chunks[b]) for a, b in _zigzag_ids(ring)]


class _ZigZagRing(torch.autograd.Function):
    """Issue 35: a causal ring on zig-zag blocks (halves r and 2R-1-r) that takes and
    returns contiguous ones (halves 2r, 2r+1). The halves move in and out inside the
    function, so a training forward keeps what a contiguous ring keeps (the caller's
    q, k, v, the output and the log-sum-exp), not zig-zag copies of q, k, v and of the
    output besides. When training, the forward goes in chunks of key/value heads (the
    backward's, :func:`_backward_chunks`), each zig-zagged, around the ring and back
    in turn; on two ranks only the query halves move, the keys and values going
    around in their contiguous blocks. The backward sends the keys and values
    around in their contiguous blocks (a rank's work is its zig-zag query rows
    against every key, balanced in any key order): per head chunk, a rank receives
    the query halves it works on and does not hold (q, output, output gradient; its
    own halves are views) and sends their query gradients back. A rank holds zig-zag
    copies of one chunk's halves at a time, not of whole blocks."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, run: _ParallelRun,
        q_chunks: list[tuple[int, int]], kv_chunks: list[tuple[int, int]], training: bool,
    ) -> Tensor:  # fmt: skip
        ring, me = run.sp.ring, run.sp.ring_rank
        q_segs = _zigzag(q_chunks)
        # keys and values in zig-zag blocks on more than two ranks (every step's work is
        # then the same, so no rank waits for a block); on two, in their contiguous
        # blocks, as the backward sends them: the one shift starts before any work, so
        # the steps' uneven work costs no wait, and the keys and values move once
        kv_zigzag = ring > 2
        kv_segs = _zigzag(kv_chunks) if kv_zigzag else _contiguous(_pair_lens(kv_chunks))
        kv_lens = [sum(n for n, _ in segs) for segs in kv_segs]
        groups = q.shape[2] // k.shape[2]
        heads = _backward_chunks(k, kv_lens)[0] if training else [(0, k.shape[2])]
        result = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lses = []
        for h0, h1 in heads:
            qh = slice(h0 * groups, h1 * groups)
            # what moves, in one exchange, straight into its zig-zag block
            qz, kz, vz = q[:, :, qh], k[:, :, h0:h1], v[:, :, h0:h1]
            moves = [(qz, q_chunks, _zigzag_like(qz, q_segs[me]))]
            if kv_zigzag:
                moves += [(t, kv_chunks, _zigzag_like(t, kv_segs[me])) for t in (kz, vz)]
            _move_halves(run, moves, inward=True)
            qz = moves[0][2]
            if kv_zigzag:
                kz, vz = moves[1][2], moves[2][2]
            del moves
            out_z, lse_z = _ring_forward(run, qz, kz, vz, q_segs[me], kv_segs)
            del qz, kz, vz
            lses.append(lse_z)
            # the output home, straight into its heads of the result
            _move_halves(run, [(out_z, q_chunks, result[:, :, qh])], inward=False)
            del out_z
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, 1)
        del lses
        # the log-sum-exp stays in zig-zag order (where the backward's kernels read it)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.run, ctx.q_chunks, ctx.kv_chunks = run, q_chunks, kv_chunks
        return result

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        run: _ParallelRun = ctx.run
        ring, me = run.sp.ring, run.sp.ring_rank
        q_chunks, kv_chunks = ctx.q_chunks, ctx.kv_chunks
        # the keys and values go around in their contiguous blocks (views of the
        # caller's, gradients straight into dk, dv): a rank's work is its zig-zag
        # query rows against every key, balanced whatever order the keys come in
        kv_lens = _pair_lens(kv_chunks)
        kv_segs = _contiguous(kv_lens)
        groups = q.shape[2] // k.shape[2]
        acc = lse.dtype
        grads = _zero_grads(q, k, v)
        dq = grads.dq
        ids = _zigzag_ids(ring)[me]
        heads, parts = _backward_chunks(k, kv_lens)
        for h0, h1 in heads:
            qh = slice(h0 * groups, h1 * groups)
            # this rank's zig-zag query halves: its own as views, the others received
            # (the three tensors in one exchange)
            contiguous = (2 * me, 2 * me + 1)
            moves = [(_split(t[:, :, qh], contiguous, q_chunks), q_chunks) for t in (dout, q, out)]
            dout_z, q_z, out_z = _swap_halves(run, moves, inward=True)
            del moves
            own = _split(dq[:, :, qh], contiguous, q_chunks)
            rows, dq_z, z0 = [], {}, 0
            for c in ids:
                n = q_chunks[c][0]
                direct = c in own and dq.dtype == acc
                dq_z[c] = (
                    own[c] if direct else torch.zeros(q_z[c].shape, dtype=acc, device=q.device)
                )
                rows.append(_Rows(
                    (q_chunks[c],), dout_z[c], q_z[c], out_z[c], lse[:, qh, z0 : z0 + n], dq_z[c]
                ))  # fmt: skip
                z0 += n
            for j in range(parts):
                _backward_part(run, rows, k, v, grads, kv_segs, kv_lens, h0, h1, j, parts)
            del rows, dout_z, q_z, out_z
            # the query gradients home: the other ranks' halves back to them
            (back,) = _swap_halves(run, [(dq_z, q_chunks)], inward=False)
            del dq_z
            for c, got in back.items():
                if not (c in own and got is own[c]):
                    own[c].copy_(got)
            del back, own
        return *grads, None, None, None, None


def _split(x: Tensor, ids: Sequence[int], chunks: list[tuple[int, int]]) -> dict[int, Tensor]:
    """Views of the halves ``ids`` that ``x`` holds one after the other along the sequence."""
    views, start = {}, 0
    for c in ids:
        views[c] = x[:, start : start + chunks[c][0]]
        start += chunks[c][0]
    return views


def _zigzag_like(x: Tensor, segs: _Segments) -> Tensor:
    """An empty zig-zag block for ``x``'s rows: ``segs``' lengths, ``x``'s other sizes."""
    shape = (x.shape[0], sum(n for n, _ in segs), *x.shape[2:])
    return torch.empty(shape, dtype=x.dtype, device=x.device)


#: one tensor's part of a zig-zag exchange: (its halves by id, the halves' lengths)
_Move = tuple[dict[int, Tensor], list[tuple[int, int]]]


def _swap_halves(
    run: _ParallelRun, moves: Sequence[_Move], inward: bool,
    into: Sequence[dict[int, Tensor]] | None = None,
) -> list[dict[int, Tensor]]:  # fmt: skip
    """For each tensor of ``moves``, the halves this rank holds after moving from the
    contiguous layout to zig-zag (``inward``) or back, by half id; every tensor's
    halves move in one exchange (one wait for the peers, not one per tensor).

    Without ``into``, the halves it keeps are ``moves``' own tensors (views stay
    views) and the others are received into new tensors; with ``into`` (views,
    by half id, in a destination of the same sizes), every half lands there:
    received straight into a contiguous view (a copy after the exchange into one
    that is not), copied from the tensor for a half it keeps, and sent in the
    destination's dtype."""
    sp = run.sp
    ring, me = sp.ring, sp.ring_rank
    contiguous = [(2 * r, 2 * r + 1) for r in range(ring)]
    held, wanted = (contiguous, _zigzag_ids(ring)) if inward else (_zigzag_ids(ring), contiguous)
    owner_now = {c: r for r, ids in enumerate(held) for c in ids}
    owner_next = {c: r for r, ids in enumerate(wanted) for c in ids}

    def group_rank(ring_rank: int) -> int:
        return ring_rank * sp.ulysses + sp.ulysses_rank

    ops, results, copies = [], [], []
    for i, (mine, chunks) in enumerate(moves):
        dest = None if into is None else into[i]
        like = next(iter((mine if dest is None else dest).values()))
        for c in held[me]:  # an empty half is known empty on both sides: nothing moves
            if owner_next[c] != me and chunks[c][0]:
                sent = mine[c].to(like.dtype).contiguous()
                ops.append(
                    dist.P2POp(
                        dist.isend, sent, group=sp.group, group_peer=group_rank(owner_next[c])
                    )
                )
        got: dict[int, Tensor] = {}
        for c in wanted[me]:
            if owner_now[c] == me:
                got[c] = mine[c] if dest is None else dest[c].copy_(mine[c])
                continue
            if dest is not None and dest[c].is_contiguous():
                buf = got[c] = dest[c]
            else:
                shape = (like.shape[0], chunks[c][0], *like.shape[2:])
                buf = got[c] = torch.empty(shape, dtype=like.dtype, device=like.device)
                if dest is not None:
                    copies.append((dest[c], buf))
                    got[c] = dest[c]
            if chunks[c][0]:
                ops.append(
                    dist.P2POp(dist.irecv, buf, group=sp.group, group_peer=group_rank(owner_now[c]))
                )
        results.append(got)
    if ops:
        sp._finish_shift(list(sp._launch("zig-zag exchange", lambda: dist.batch_isend_irecv(ops))))
    for target, buf in copies:
        target.copy_(buf)
    return results


def _move_halves(
    run: _ParallelRun, moves: Sequence[tuple[Tensor, list[tuple[int, int]], Tensor]], inward: bool
) -> None:
    """Move each ``(x, chunks, dest)``'s halves from the contiguous layout to zig-zag
    (``inward``) or back: ``x``'s halves into ``dest`` (the same sizes but its
    length, the halves in the other layout's order), all in one exchange."""
    ring, me = run.sp.ring, run.sp.ring_rank
    contiguous, zigzag = (2 * me, 2 * me + 1), _zigzag_ids(ring)[me]
    held, wanted = (contiguous, zigzag) if inward else (zigzag, contiguous)
    _swap_halves(
        run, [(_split(x, held, chunks), chunks) for x, chunks, _ in moves], inward,
        [_split(dest, wanted, chunks) for _, chunks, dest in moves],
    )  # fmt: skip


class _Piece(NamedTuple):
    """One kernel call of a ring step: q rows ``r0:r1`` over block keys ``c0:c1``."""

    r0: int
    r1: int
    c0: int
    c1: int
    causal: bool


def _causal_pieces(r0: int, r1: int, c0: int, c1: int) -> list[_Piece]:
    """Top-left causal attention of rows ``r0:r1`` over keys ``c0:c1``, asked of the
    kernel only with equal lengths, where top-left and bottom-right alignment
    (flash-attn's) agree: keys past the last row are never seen, and rows past
    the last key see every key (one full piece)."""
    rows, keys = r1 - r0, c1 - c0
    if rows <= keys:
        return [_Piece(r0, r1, c0, c0 + rows, True)]
    return [_Piece(r0, r0 + keys, c0, c1, True), _Piece(r0 + keys, r1, c0, c1, False)]


def _merge_into(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Merge one partial result into views of the accumulators, in place: the rows
    move towards ``part`` by its share of the merged softmax, ``exp(part_lse -
    new_lse)`` (the old rows' share is one minus it), one pass over the rows
    (``lerp_``); a row that no key has reached yet (both -inf) keeps its zeros."""
    part_lse = part_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, part_lse)
    share = torch.exp(part_lse - new_lse).nan_to_num_(0.0)  # -inf - -inf: no key yet
    out.lerp_(part.to(out.dtype), share.transpose(1, 2).unsqueeze(-1))
    lse.copy_(new_lse)


def _ring_forward(
    run: _ParallelRun, q: Tensor, k: Tensor, v: Tensor, q_seg: _Segments,
    kv_segs: list[_Segments],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """A ring's forward without gradients: this rank's merged output (in the compute
    dtype) and log-sum-exp, ``ring - 1`` shifts passing the key/value blocks (the
    next block travels while this one is computed)."""
    kv_lens = [sum(n for n, _ in segs) for segs in kv_segs]
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(b, sq, h, run.head_size, dtype=acc, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device)
    for src, (k_blk, v_blk) in _ring_steps(run, (k, v), kv_lens):
        run._attend(q, k_blk, v_blk, q_seg, kv_segs[src], out, lse)
    return out, lse


class _Ring(torch.autograd.Function):
    """Issue 35: ring attention whose backward recomputes each block from the merged
    log-sum-exp (ring-flash-attention's scheme), so a training forward keeps only
    q, this rank's key/value block, the output and the log-sum-exp: memory linear
    in the sequence, where differentiating through every block's scores kept
    ``ring`` score matrices.

    Forward: ``ring - 1`` shifts pass key/value blocks; each block's pieces are
    merged by their log-sum-exp (the next block travels while this one is
    computed). Backward: the blocks travel the same way again, each with the
    accumulated gradient of its keys and values, which one more shift brings
    home; every rank runs every shift, skipped causal blocks included, so the
    shifts pair up across ranks. The backward goes in chunks of key/value heads
    and sequence parts (:data:`BACKWARD_CHUNKS`), each around the ring in turn,
    so a rank's peak is its gradients plus about 1/16 of a block.
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, run: _ParallelRun, q_segs: list[_Segments],
        kv_segs: list[_Segments],
    ) -> Tensor:  # fmt: skip
        out, lse = _ring_forward(run, q, k, v, q_segs[run.sp.ring_rank], kv_segs)
        result = out.to(q.dtype)
        del out
        # what the backward needs, linear in the sequence: the inputs, the merged
        # output (the result itself when the dtypes agree) and log-sum-exp
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.run, ctx.q_segs, ctx.kv_segs = run, q_segs, kv_segs
        return result

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        run: _ParallelRun = ctx.run
        me = run.sp.ring_rank
        kv_lens = [sum(n for n, _ in segs) for segs in ctx.kv_segs]
        grads = _zero_grads(q, k, v)  # each chunk below fills its slice of them
        saved = _Saved(dout, q, k, v, out, lse)
        heads, parts = _backward_chunks(k, kv_lens)
        for h0, h1 in heads:
            _backward_heads(run, saved, grads, ctx.q_segs[me], ctx.kv_segs, kv_lens, h0, h1, parts)
        return *grads, None, None, None


#: issue 35: a ring's backward moves each key/value block in about this many chunks
#: (key/value heads x parts of the block's sequence), each around the whole ring in
#: turn, so what is in flight on a rank (the block in hand, the next one, their
#: gradients and the kernel's) is about 1/16 of a block, not twice a block
BACKWARD_CHUNKS = 16
#: blocks of fewer bytes go whole (chunks would only add kernel calls and shifts) ...
CHUNK_MIN_BYTES = 1 << 20
#: ... and a sequence part has at least this many rows (tests lower both)
CHUNK_MIN_ROWS = 64


class _Saved(NamedTuple):
    """What a ring's backward reads: the output's gradient and the forward's saved tensors."""

    dout: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


class _Grads(NamedTuple):
    dq: Tensor
    dk: Tensor
    dv: Tensor


def _zero_grads(q: Tensor, k: Tensor, v: Tensor) -> _Grads:
    """The gradients themselves, zeroed, in the inputs' dtype and layout (what autograd
    hands to the leaves without a copy)."""
    return _Grads(*(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)))


def _backward_chunks(k: Tensor, kv_lens: list[int]) -> tuple[list[tuple[int, int]], int]:
    """The key/value head ranges and the number of sequence parts a ring's backward
    goes in. Every rank computes the same from facts every rank agreed on (the
    block lengths, head count, head size, dtype), so the ranks' shifts pair up."""
    kv_heads = k.shape[2]
    block_bytes = max(kv_lens) * k.shape[0] * kv_heads * k.shape[3] * k.element_size()
    if block_bytes < CHUNK_MIN_BYTES:
        return [(0, kv_heads)], 1
    n_heads = min(kv_heads, BACKWARD_CHUNKS)
    heads = [(kv_heads * i // n_heads, kv_heads * (i + 1) // n_heads) for i in range(n_heads)]
    parts = -(-BACKWARD_CHUNKS // n_heads)
    return heads, max(1, min(parts, max(kv_lens) // max(1, CHUNK_MIN_ROWS)))


def _part(n: int, parts: int, j: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of sequence part ``j`` of ``parts`` of a block of ``n`` rows."""
    return n * j // parts, n * (j + 1) // parts


def _cut(segs: _Segments, a: int, b: int) -> _Segments:
    """The segments of a block's local rows ``[a, b)`` (global offsets kept)."""
    cut: list[tuple[int, int]] = []
    pos = 0
    for n, offset in segs:
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            cut.append((hi - lo, offset + lo - pos))
        pos += n
    return tuple(cut)


class _Rows(NamedTuple):
    """Query rows of a ring's backward, this key/value head chunk's query heads:
    their segments and the tensors the kernel reads and writes there."""

    segs: _Segments
    dout: Tensor
    q: Tensor
    out: Tensor
    lse: Tensor
    dq: Tensor  # the compute dtype's; gradients are added in place


def _backward_heads(
    run: _ParallelRun, saved: _Saved, grads: _Grads, q_segs: _Segments,
    kv_segs: list[_Segments], kv_lens: list[int], h0: int, h1: int, parts: int,
) -> None:  # fmt: skip
    """One chunk of key/value heads ``h0:h1`` (and their query heads) of a ring's
    backward: for each sequence part, a ring of its own (:func:`_backward_part`).
    Gradients accumulate in the compute dtype: straight into ``grads`` when that
    is their dtype, else in buffers of this chunk's size."""
    groups = saved.q.shape[2] // saved.k.shape[2]
    qh = slice(h0 * groups, h1 * groups)
    acc = saved.lse.dtype
    dq = grads.dq[:, :, qh]
    dq_acc = dq if dq.dtype == acc else torch.zeros(dq.shape, dtype=acc, device=dq.device)
    rows = _Rows(
        q_segs, saved.dout[:, :, qh], saved.q[:, :, qh], saved.out[:, :, qh], saved.lse[:, qh],
        dq_acc,
    )  # fmt: skip
    for j in range(parts):
        _backward_part(run, [rows], saved.k, saved.v, grads, kv_segs, kv_lens, h0, h1, j, parts)
    if dq_acc is not dq:
        dq.copy_(dq_acc)


def _backward_part(
    run: _ParallelRun, rows: list[_Rows], k: Tensor, v: Tensor, grads: _Grads,
    kv_segs: list[_Segments], kv_lens: list[int], h0: int, h1: int, j: int, parts: int,
) -> None:  # fmt: skip
    """Sequence part ``j`` of key/value heads ``h0:h1`` of every block, once around
    the ring, against every set of this rank's query rows. Step 0 is this rank's
    own part, its gradients added in place; at step
    ``s >= 1`` the part of ring rank ``me - s`` is in hand (its shift started while
    the previous step computed) with the gradient its earlier holders accumulated
    for it, which the step adds to and passes on; the last shift brings this rank's
    own part home with everyone else's share."""
    sp = run.sp
    ring, me = sp.ring, sp.ring_rank
    nxt, prv = _neighbours(sp)
    block_backward = run.lse_backward()
    kh = slice(h0, h1)
    acc = rows[0].lse.dtype
    b, d = k.shape[0], k.shape[3]

    def shape(src: int) -> tuple[int, ...]:
        a, e = _part(kv_lens[src], parts, j)
        return (b, e - a, h1 - h0, d)

    a, e = _part(kv_lens[me], parts, j)
    own_k, own_v = grads.dk[:, a:e, kh], grads.dv[:, a:e, kh]
    direct = own_k.dtype == acc
    if not direct:
        own_k, own_v = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (own_k, own_v))
    k_blk, v_blk = k[:, a:e, kh], v[:, a:e, kh]
    moving: tuple[Tensor, Tensor] | None = None  # the part in hand's gradient so far
    for step in range(ring):
        src = (me - step) % ring
        works: list[Any] = []
        if step + 1 < ring:  # the next part travels while this one is computed
            sent = [k_blk.contiguous(), v_blk.contiguous()]
            incoming, works = sp._start_shift(sent, nxt, prv, [shape((src - 1) % ring)] * 2)
        target = (own_k, own_v) if step == 0 else moving
        cut = _cut(kv_segs[src], *_part(kv_lens[src], parts, j))
        for qr, (r0, r1, c0, c1, causal) in (
            (set_, piece) for set_ in rows for piece in run._block_pieces(set_.segs, cut)
        ):
            gq, gk, gv = block_backward(
                qr.dout[:, r0:r1], qr.q[:, r0:r1], k_blk[:, c0:c1], v_blk[:, c0:c1],
                qr.out[:, r0:r1], qr.lse[..., r0:r1], causal, run.scale, run.softcap,
            )  # fmt: skip
            qr.dq[:, r0:r1] += gq
            del gq
            if target is None:  # this part's first share: the kernel's own gradients
                if c0 == 0 and c1 == k_blk.shape[1] and gk.dtype == acc:
                    target = (gk, gv)
                    continue
                target = tuple(  # type: ignore[assignment]
                    torch.zeros(k_blk.shape, dtype=acc, device=k_blk.device) for _ in range(2)
                )
            assert target is not None
            target[0][:, c0:c1] += gk
            target[1][:, c0:c1] += gv
            del gk, gv
        if step > 0:  # pass the gradient on (the last shift brings this rank's home)
            if target is None:  # no piece of this part was seen here
                target = tuple(  # type: ignore[assignment]
                    torch.zeros(k_blk.shape, dtype=acc, device=k_blk.device) for _ in range(2)
                )
            assert target is not None
            del k_blk, v_blk  # the part in hand is done with before its gradient moves
            moving = None
            home = [t.contiguous() for t in target]
            del target
            got = sp._shift(home, nxt, prv, [shape((src - 1) % ring)] * 2)
            del home
            if step + 1 == ring:  # our own part, every other rank's share
                own_k += got[0]
                own_v += got[1]
            else:
                moving = (got[0], got[1])
            del got
        if works:
            sp._finish_shift(works)
            del sent
            k_blk, v_blk = incoming
            del incoming
    if not direct:
        grads.dk[:, a:e, kh] = own_k
        grads.dv[:, a:e, kh] = own_v


def _neighbours(sp: SequenceParallel) -> tuple[int, int]:
    """(next, previous) group ranks on this rank's ring (same place in its Ulysses group)."""
    me = sp.ring_rank
    nxt = ((me + 1) % sp.ring) * sp.ulysses + sp.ulysses_rank
    prv = ((me - 1) % sp.ring) * sp.ulysses + sp.ulysses_rank
    return nxt, prv


def _ring_steps(
    run: _ParallelRun, block: tuple[Tensor, Tensor], kv_lens: list[int]
) -> Iterator[tuple[int, tuple[Tensor, Tensor]]]:
    """``(source ring rank, (k, v) block)`` for each ring step: the next block's shift
    starts before the step's work and is waited for (bounded) after it. Blocks are
    received into two buffers per tensor, allocated once and taken in turn (the
    block in hand is being sent while the next one arrives in the other)."""
    sp = run.sp
    ring, me = sp.ring, sp.ring_rank
    nxt, prv = _neighbours(sp)
    longest = max((kv_lens[(me - s) % ring] for s in range(1, ring)), default=0)
    pools = [
        [t.new_empty(t.shape[0] * longest * math.prod(t.shape[2:])) for t in block]
        for _ in range(min(2, ring - 1))
    ]
    for step in range(ring):
        src = (me - step) % ring
        works: list[Any] = []
        if step + 1 < ring:
            n = kv_lens[(src - 1) % ring]
            shapes = [(t.shape[0], n, *t.shape[2:]) for t in block]
            into = [
                flat[: math.prod(shape)].view(shape)
                for flat, shape in zip(pools[step % 2], shapes, strict=True)
            ]
            sent = [t.contiguous() for t in block]
            incoming, works = sp._start_shift(sent, nxt, prv, shapes, into)
        yield src, block
        if works:
            sp._finish_shift(works)
            block = (incoming[0], incoming[1])


# -- collectives as autograd functions --------------------------------------------------


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Tensor:
    """``fn.apply(*args)``, typed (torch leaves ``Function.apply`` untyped)."""
    out: Tensor = fn.apply(*args)  # type: ignore[no-untyped-call]
    return out


class _Ulysses(torch.autograd.Function):
    """Ulysses: (b, my shard, H, d) -> (b, the Ulysses group's sequence, H/U, d) with
    ``to_heads``, else back; the gradient takes the other direction."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: _ParallelRun, lens: list[int], to_heads: bool) -> Tensor:
        ctx.run, ctx.lens, ctx.to_heads = run, lens, to_heads
        return (_to_heads if to_heads else _to_sequence)(run, x, lens)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        back = _to_sequence if ctx.to_heads else _to_heads
        return back(ctx.run, grad.contiguous(), ctx.lens), None, None, None


def _to_heads(run: _ParallelRun, x: Tensor, lens: list[int]) -> Tensor:
    sp = run.sp
    u, members = sp.ulysses, run._members()
    b, s, heads, d = x.shape
    h = heads // u
    send_buf = x.reshape(b, s, u, h, d).permute(2, 0, 1, 3, 4).reshape(-1)
    send = [0] * sp.size
    recv = [0] * sp.size
    for m in members:
        send[m] = b * s * h * d
        recv[m] = b * lens[m] * h * d
    flat = sp._all_to_all(send_buf.contiguous(), send, recv)
    parts = torch.split(flat, [recv[m] for m in members])
    return torch.cat([p.reshape(b, lens[m], h, d) for p, m in zip(parts, members, strict=True)], 1)


def _to_sequence(run: _ParallelRun, x: Tensor, lens: list[int]) -> Tensor:
    sp = run.sp
    u, members = sp.ulysses, run._members()
    b, _, h, d = x.shape
    mine = lens[sp.rank]
    pieces = torch.split(x, [lens[m] for m in members], dim=1)
    send_buf = torch.cat([p.reshape(-1) for p in pieces])
    send = [0] * sp.size
    recv = [0] * sp.size
    for m in members:
        send[m] = b * lens[m] * h * d
        recv[m] = b * mine * h * d
    flat = sp._all_to_all(send_buf.contiguous(), send, recv)
    return flat.reshape(u, b, mine, h, d).permute(1, 2, 0, 3, 4).reshape(b, mine, u * h, d)


# -- issue 35: head padding, AllGather-KV, joint text, key-padding masks -------------------


def _pad_heads(x: Tensor, heads: int) -> Tensor:
    """``x`` with zero heads appended up to ``heads`` (differentiable)."""
    extra = heads - x.shape[2]
    if extra <= 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], extra, x.shape[3])], 2)


def _key_padding(mask: Tensor, k: Tensor) -> Tensor:
    """A key-padding mask of this rank's keys as booleans (batch, keys): boolean
    ``True`` keeps a key, or a float 0 (keep) / -inf (drop); shaped (batch, keys) or
    (batch, 1, 1, keys). Any other mask is a ``ValueError``: only key padding is
    gathered consistently with the keys."""
    b, s = k.shape[0], k.shape[1]
    if mask.dim() == 4 and mask.shape[1:3] == (1, 1):
        mask = mask[:, 0, 0]
    if mask.dim() != 2 or tuple(mask.shape) != (b, s):
        raise InvalidArgumentError(
            f"attn_mask: a sequence-parallel layout takes a key-padding mask of this rank's "
            f"keys, shaped (batch, keys) or (batch, 1, 1, keys) = ({b}, {s}); got "
            f"{tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        keep = mask == 0
        if not bool((keep | torch.isneginf(mask)).all()):
            raise InvalidArgumentError(
                "attn_mask: a float key-padding mask holds 0 (keep) or -inf (drop) only; a "
                "bias is not a key-padding mask"
            )
        return keep
    raise InvalidArgumentError(f"attn_mask: expected a boolean or float mask, got {mask.dtype}")


def _exchange(
    sp: SequenceParallel, send: dict[int, Tensor], recv: dict[int, int], like: Tensor
) -> dict[int, Tensor]:
    """One bounded all-to-all: ``send[peer]`` to each peer (flattened), ``recv[peer]``
    elements from each; the ranks not named exchange nothing."""
    send_sizes = [0] * sp.size
    recv_sizes = [0] * sp.size
    parts = []
    for peer in range(sp.size):
        if peer in send:
            flat = send[peer].reshape(-1)
            send_sizes[peer] = flat.numel()
            parts.append(flat)
        recv_sizes[peer] = recv.get(peer, 0)
    buf = torch.cat(parts) if parts else like.new_empty(0)
    flat = sp._all_to_all(buf.to(like.dtype).contiguous(), send_sizes, recv_sizes)
    pieces = torch.split(flat, recv_sizes)
    return {peer: pieces[peer] for peer in recv}


class _GatherKV(torch.autograd.Function):
    """AllGather-KV: this rank's key/value block -> every outer block in order (the
    ranks at this rank's Ulysses place); the backward sums each block's gradient
    from every rank that gathered it and sends it home (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: _ParallelRun, blocks: list[int]) -> Tensor:
        ctx.run, ctx.blocks = run, blocks
        outer = run._outer_members()
        b, _, h, d = x.shape
        pieces = _exchange(
            run.sp, dict.fromkeys(outer, x.contiguous()),
            {m: b * blocks[p] * h * d for p, m in enumerate(outer)}, x,
        )  # fmt: skip
        return torch.cat([pieces[m].reshape(b, blocks[p], h, d) for p, m in enumerate(outer)], 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        run: _ParallelRun = ctx.run
        outer = run._outer_members()
        me = run.sp.ring_rank
        b, _, h, d = grad.shape
        parts = torch.split(grad, ctx.blocks, 1)
        mine = ctx.blocks[me]
        pieces = _exchange(
            run.sp, {m: parts[p].contiguous() for p, m in enumerate(outer)},
            {m: b * mine * h * d for m in outer}, grad,
        )  # fmt: skip
        total = sum(pieces[m].reshape(b, mine, h, d) for m in outer)
        return cast(Tensor, total), None, None


class _Replicated(torch.autograd.Function):
    """A tensor every rank holds whole (joint attention's text tokens): the forward
    is the identity; the backward sums every rank's gradient (an all-reduce), so
    each rank's gradient is the whole group's (the sum of every rank's loss)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: _ParallelRun) -> Tensor:
        ctx.run = run
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.contiguous().clone()
        ctx.run.sp._all_reduce(total)
        return total, None


class _GatherHeads(torch.autograd.Function):
    """Joint text under Ulysses: this rank's heads of the text output -> every head
    (from its Ulysses group); the backward sums the group's gradients of this
    rank's heads (each rank's whole text output depends on every member's heads)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: _ParallelRun) -> Tensor:
        ctx.run = run
        members = run._members()
        pieces = _exchange(run.sp, dict.fromkeys(members, x), dict.fromkeys(members, x.numel()), x)
        return torch.cat([pieces[m].reshape(x.shape) for m in members], 2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        run: _ParallelRun = ctx.run
        members = run._members()
        u = len(members)
        h = grad.shape[2] // u
        shape = (grad.shape[0], grad.shape[1], h, grad.shape[3])
        parts = {m: grad[:, :, i * h : (i + 1) * h].contiguous() for i, m in enumerate(members)}
        pieces = _exchange(run.sp, parts, dict.fromkeys(members, parts[members[0]].numel()), grad)
        return cast(Tensor, sum(pieces[m].reshape(shape) for m in members)), None
