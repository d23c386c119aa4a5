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
  part and a top-left causal part, so no kernel needs a mask.
- **USP** (both): Ulysses inside, ring outside.

Uneven lengths: shards follow ``torch.tensor_split`` (the first ``L % (U*R)``
ranks hold one token more; a rank may hold none) and are exchanged with uneven
split sizes, so nothing is padded and nothing needs masking. Every forward
first gathers the shard lengths of all ranks (one small all-gather).
:meth:`SequenceParallel.shard` and :meth:`SequenceParallel.gather` cut and
reassemble a full tensor that way.

Not supported under a layout (a ``ValueError``): ``attn_mask``; ``window`` with
``ring > 1``. Gradients flow: the collectives are autograd functions (an
all-to-all's backward is the reverse all-to-all, a ring shift's the reverse
shift), and the log-sum-exp of the ring kernels is differentiable.

Verified and bounded (``docs/sequence-parallel.md``):

- at construction: ``U * R`` must equal the group's size (``ValueError``);
  a layer's per-rank kernel is resolved with the layout (``LayerSpec.layout``),
  so a kernel without the log-sum-exp, or head counts that do not divide by
  ``U``, are traced rejections;
- on the first forward of each bound layer shape, before any collective, every
  rank's decision for the layout goes through :func:`attnres.verify_consensus`:
  a rank that decided differently stops every rank with a ``ConsensusError``;
- every collective is started asynchronously and waited for with the layout's
  ``timeout``: a dead peer (connection reset) or one that never arrives is a
  :class:`SequenceParallelError` within that bound, never a hang.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from attnres._outcome import Outcome
from attnres.backends import Backend
from attnres.distributed import DEFAULT_TIMEOUT_S, _timeout_seconds, verify_consensus
from attnres.errors import SequenceParallelError
from attnres.kernels.lse import LseKernelFn, get_lse_kernel, lse_has_gradient
from attnres.layout import SequenceLayout
from attnres.ledger import Decision

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

    Raises ``ValueError`` for a bad degree or one that does not match the
    group, ``RuntimeError`` when ``torch.distributed`` is not initialised or
    this process is not in ``group``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        ulysses: int = 1,
        ring: int = 1,
        timeout: float | timedelta | None = None,
    ) -> None:
        shape = SequenceLayout(ulysses=ulysses, ring=ring)  # validates the degrees
        if not (dist.is_available() and dist.is_initialized()):
            raise SequenceParallelError(
                "SequenceParallel needs torch.distributed to be initialised: call "
                "torch.distributed.init_process_group first (every rank of the group)"
            )
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise SequenceParallelError(
                "SequenceParallel: this process is not a member of the given group; build it "
                "on the group's ranks only, with a group that holds this rank"
            )
        if shape.degree != size:
            raise ValueError(
                f"SequenceParallel: ulysses={shape.ulysses} x ring={shape.ring} spans "
                f"{shape.degree} ranks, but the group has {size}; choose degrees whose product "
                f"is the group's size"
            )
        self.group = group
        self.ulysses = shape.ulysses
        self.ring = shape.ring
        self.size = size
        self.rank = rank
        self.timeout_s = _timeout_seconds(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        self._wait = timedelta(seconds=self.timeout_s)
        #: seconds this rank spent in the layout's collectives, waits included (the bench)
        self.comm_seconds = 0.0

    def __repr__(self) -> str:
        return (
            f"SequenceParallel(ulysses={self.ulysses}, ring={self.ring}, rank {self.rank} "
            f"of {self.size})"
        )

    # A layout holds the caller's process group: a copied model (EMA weights,
    # ``copy.deepcopy``) shares it; pickling one is an error that says so.
    def __copy__(self) -> SequenceParallel:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SequenceParallel:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
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
        return SequenceLayout(self.ulysses, self.ring, num_heads, num_kv_heads)

    # -- shards -------------------------------------------------------------------

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's shard of a full tensor along ``dim`` (``torch.tensor_split``)."""
        return torch.tensor_split(x, self.size, dim=dim)[self.rank]

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """The full tensor from every rank's shard along ``dim`` (bounded; no grad)."""
        length = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
        lengths = self._all_gather_ints(length).reshape(-1).tolist()
        moved = x.movedim(dim, 0).contiguous()
        tail = moved.shape[1:]
        per = int(torch.Size(tail).numel())
        most = max(lengths)
        # gloo gathers equal sizes only: every shard is padded to the longest, then cut
        flat = torch.zeros(most * per, dtype=x.dtype, device=x.device)
        flat[: moved.numel()] = moved.reshape(-1)
        parts = [torch.empty(most * per, dtype=x.dtype, device=x.device) for _ in lengths]
        self._bounded("all_gather", dist.all_gather(parts, flat, group=self.group, async_op=True))
        full = torch.cat(
            [p[: n * per].reshape(n, *tail) for p, n in zip(parts, lengths, strict=True)]
        )
        return full.movedim(0, dim)

    # -- bounded collectives -------------------------------------------------------

    def _bounded(self, what: str, work: Any) -> None:
        start = time.perf_counter()
        try:
            work.wait(timeout=self._wait)
        except RuntimeError as exc:
            raise SequenceParallelError(
                f"sequence-parallel {what} failed on rank {self.rank} of {self.size} "
                f"(ulysses={self.ulysses} x ring={self.ring}, timeout {self.timeout_s:g} s): "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. A peer died, "
                f"hangs, or took a different code path; the group is out of step, so restart "
                f"the job"
            ) from exc
        self.comm_seconds += time.perf_counter() - start

    def _all_gather_ints(self, mine: Tensor) -> Tensor:
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._bounded("all_gather", dist.all_gather(parts, mine, group=self.group, async_op=True))
        return torch.stack(parts)

    def _all_to_all(self, x: Tensor, send: list[int], recv: list[int]) -> Tensor:
        out = torch.empty(sum(recv), dtype=x.dtype, device=x.device)
        work = dist.all_to_all_single(out, x, recv, send, group=self.group, async_op=True)
        self._bounded("all_to_all", work)
        return out

    def _shift(self, x: Tensor, to: int, frm: int, numel: int) -> Tensor:
        """Send ``x`` to group rank ``to`` and receive ``numel`` elements from ``frm``."""
        out, works = self._start_shift(x, to, frm, numel)
        self._finish_shift(works)
        return out

    def _start_shift(self, x: Tensor, to: int, frm: int, numel: int) -> tuple[Tensor, list[Any]]:
        """Start a shift; :meth:`_finish_shift` waits for it (bounded)."""
        out = torch.empty(numel, dtype=x.dtype, device=x.device)
        ops = [dist.P2POp(dist.isend, x, group=self.group, group_peer=to)]
        ops.append(dist.P2POp(dist.irecv, out, group=self.group, group_peer=frm))
        return out, list(dist.batch_isend_irecv(ops))

    def _finish_shift(self, works: list[Any]) -> None:
        for work in works:
            self._bounded("ring shift", work)

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
        self.dtypes = dtypes
        if sp.ring > 1 and shape.window is not None:
            raise ValueError(
                "window: sliding-window attention is not supported with ring > 1 (a window "
                "crosses key/value blocks); use a Ulysses-only layout for this layer"
            )
        # what one rank runs: 1/U of the heads (the machine checked they divide)
        self.local_shape = shape._replace(
            num_heads=shape.num_heads // u, num_kv_heads=shape.num_kv_heads // u, parallel=None
        )
        self.local = new_run(self.local_shape, kernel, dtypes) if sp.ring == 1 else None
        self.lse: LseKernelFn | None = None
        if sp.ring > 1:
            self.lse = get_lse_kernel(shape.backend)
            if self.lse is None:  # the machine's layout check rules this out
                raise ValueError(
                    f"ring={sp.ring}: backend {shape.backend!r} has no log-sum-exp adapter"
                )
            # issue 23: the layer's options reach the log-sum-exp kernel, bound once
            # (a Ulysses-only layout runs the dense kernel, options included)
            options = dict(dict(shape.backend_options).get(shape.backend, ()))
            if options:
                self.lse = functools.partial(self.lse, **options)
        self.lse_grad = lse_has_gradient(shape.backend)
        self._verified = False
        self._lock = threading.Lock()

    # consensus: once per bound shape, before the first collective
    def _verify(self) -> None:
        with self._lock:
            if self._verified:
                return
            sp = self.sp
            site = (
                f"{SequenceLayout(sp.ulysses, sp.ring, self.heads, self.kv_heads).describe()}; "
                f"{self.heads}/{self.kv_heads} heads x {self.head_size}"
                f"{', causal' if self.causal else ''}"
            )
            decision = Decision(
                "sequence_parallel",
                site,
                Outcome("selected", "none", Backend(self.backend), None),
                cast("Trace", None),  # the consensus compares backends, not traces
            )
            verify_consensus([decision], group=sp.group, timeout=sp.timeout_s)
            self._verified = True

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        if attn_mask is not None:
            raise ValueError(
                "attn_mask: masks are not supported under a sequence-parallel layout (each rank "
                "holds a shard of the sequence); see docs/sequence-parallel.md"
            )
        self._check(q, k, v)
        if (
            self.lse is not None
            and not self.lse_grad
            and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)
        ):  # the layer's training path re-resolves first; this is the last line of defence
            raise ValueError(
                f"ring={self.sp.ring} on {self.backend!r} is inference-only: its log-sum-exp "
                f"carries no gradient; run the forward under torch.no_grad(), or give the "
                f"layer a backend whose lse does (eager, torch_sdpa)"
            )
        if not self._verified:
            self._verify()
        sp = self.sp
        lengths = self._lengths(q, k)
        if sp.ulysses > 1:
            q_blk = _apply(_ToHeads, q, self, lengths.q)
            kv_blk = _apply(_ToHeads, torch.cat([k, v], dim=-1), self, lengths.kv)
        else:
            q_blk, kv_blk = q, torch.cat([k, v], dim=-1)
        if sp.ring > 1:
            out_blk = self._ring(q_blk, kv_blk, lengths)
        else:
            assert self.local is not None
            d = self.head_size
            out_blk = self.local(q_blk, kv_blk[..., :d], kv_blk[..., d:], None)
        if sp.ulysses > 1:
            return _apply(_ToSequence, out_blk, self, lengths.q)
        return out_blk

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
            raise ValueError(
                f"this sequence-parallel layer takes this rank's shards q (batch, seq_shard, {h}, "
                f"{d}) and k, v (batch, seq_kv_shard, {hk}, {d}) of one dtype "
                f"({', '.join(sorted(str(t).removeprefix('torch.') for t in self.dtypes))}); "
                f"got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                f"v {tuple(v.shape)} {v.dtype}"
            )

    def _lengths(self, q: Tensor, k: Tensor) -> _Lengths:
        mine = torch.tensor(
            [q.shape[0], q.shape[1], k.shape[1]], dtype=torch.int64, device=q.device
        )
        rows = self.sp._all_gather_ints(mine).tolist()
        batches = {row[0] for row in rows}
        if len(batches) != 1:
            raise ValueError(
                f"batch: every rank must pass the same batch size, got {[r[0] for r in rows]} "
                f"(by rank)"
            )
        return _Lengths(rows[0][0], [r[1] for r in rows], [r[2] for r in rows])

    # Ulysses groups: ranks ring_rank*U .. ring_rank*U + U - 1
    def _members(self) -> list[int]:
        u = self.sp.ulysses
        base = self.sp.ring_rank * u
        return list(range(base, base + u))

    # -- the ring -----------------------------------------------------------------

    def _block_lengths(self, per_rank: Sequence[int]) -> list[int]:
        u = self.sp.ulysses
        return [sum(per_rank[p * u : (p + 1) * u]) for p in range(self.sp.ring)]

    def _ring(self, q: Tensor, kv: Tensor, lengths: _Lengths) -> Tensor:
        sp = self.sp
        ring, me = sp.ring, sp.ring_rank
        q_lens, kv_lens = self._block_lengths(lengths.q), self._block_lengths(lengths.kv)
        q_off = sum(q_lens[:me])
        kv_offs = [sum(kv_lens[:j]) for j in range(ring)]
        b, sq, h = q.shape[0], q.shape[1], q.shape[2]
        d = self.head_size
        hk2 = kv.shape[2] * kv.shape[3]
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(b, sq, h, d, dtype=acc_dtype, device=q.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=acc_dtype, device=q.device)
        nxt = ((me + 1) % ring) * sp.ulysses + sp.ulysses_rank
        prv = ((me - 1) % ring) * sp.ulysses + sp.ulysses_rank
        block = kv
        # without gradients the next block travels while this one is computed (the
        # wait stays bounded); with them the shift is an autograd function
        overlap = not (torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad))
        for step in range(ring):
            src = (me - step) % ring
            works: list[Any] = []
            if step + 1 < ring:
                numel = b * kv_lens[(src - 1) % ring] * hk2
                flat = block.reshape(-1).contiguous()
                if overlap:
                    incoming, works = sp._start_shift(flat, nxt, prv, numel)
                else:
                    incoming = _apply(_Shift, flat, self, nxt, prv, numel)
            out, lse = self._attend(q, block, q_off, kv_offs[src], out, lse)
            sp._finish_shift(works)
            if step and block.requires_grad:
                # every received block joins the graph, used or skipped (a causal block
                # in the future): each rank then runs every shift's backward, so the
                # reverse shifts pair up across ranks instead of leaving a peer waiting
                out = _apply(_Anchor, out, block)
            if step + 1 < ring:
                block = incoming.reshape(b, kv_lens[(src - 1) % ring], kv.shape[2], kv.shape[3])
        return out.to(q.dtype)

    def _attend(
        self, q: Tensor, kv: Tensor, q0: int, k0: int, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Merge q's attention over one key/value block at global offsets q0, k0."""
        sq, skv = q.shape[1], kv.shape[1]
        if sq == 0 or skv == 0:
            return out, lse
        d = self.head_size
        k, v = kv[..., :d], kv[..., d:]
        if not self.causal or k0 + skv - 1 <= q0:  # every key at or before every query
            return self._merge(q, k, v, False, 0, out, lse)
        if k0 > q0 + sq - 1:  # every key after every query: nothing to see
            return out, lse
        offset = q0 - k0  # query row r sees local keys c <= r + offset
        if offset < 0:  # rows r < -offset see no key of this block
            return self._causal(q[:, -offset:], k, v, -offset, out, lse)
        if offset > 0:  # keys < offset are seen by every row; the rest is top-left causal
            out, lse = self._merge(q, k[:, :offset], v[:, :offset], False, 0, out, lse)
            return self._causal(q, k[:, offset:], v[:, offset:], 0, out, lse)
        return self._causal(q, k, v, 0, out, lse)

    def _causal(
        self, q: Tensor, k: Tensor, v: Tensor, row0: int, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Top-left causal attention of ``q`` (rows ``row0:``) over ``k``, asked of the
        kernel only with equal lengths, where top-left and bottom-right alignment
        (flash-attn's) agree: keys past the last row are never seen, and rows past
        the last key see every key."""
        sq, skv = q.shape[1], k.shape[1]
        if sq <= skv:
            return self._merge(q, k[:, :sq], v[:, :sq], True, row0, out, lse)
        out, lse = self._merge(q[:, :skv], k, v, True, row0, out, lse)
        # rows skv.. see every key: one full block, merged into rows row0 + skv..
        return self._merge(q[:, skv:], k, v, False, row0 + skv, out, lse)

    def _merge(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, row0: int, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Merge one partial result into rows ``row0 : row0 + len(q)`` of the accumulators."""
        assert self.lse is not None
        part, part_lse = self.lse(q, k, v, causal, self.scale, self.softcap)
        part_lse = part_lse.to(lse.dtype)
        end = row0 + q.shape[1]
        old, old_lse = out[:, row0:end], lse[..., row0:end]
        new_lse = torch.logaddexp(old_lse, part_lse)
        empty = torch.isneginf(new_lse)
        zero = torch.zeros_like(new_lse)
        w_old = torch.exp(torch.where(empty, zero, old_lse - new_lse)).transpose(1, 2).unsqueeze(-1)
        w_new = (
            torch.exp(torch.where(empty, zero, part_lse - new_lse)).transpose(1, 2).unsqueeze(-1)
        )
        merged = w_old * old + w_new * part.to(out.dtype)
        if row0 == 0 and end == out.shape[1]:
            return merged, new_lse
        return (
            torch.cat([out[:, :row0], merged, out[:, end:]], 1),
            torch.cat([lse[..., :row0], new_lse, lse[..., end:]], -1),
        )


# -- collectives as autograd functions --------------------------------------------------


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Tensor:
    """``fn.apply(*args)``, typed (torch leaves ``Function.apply`` untyped)."""
    out: Tensor = fn.apply(*args)  # type: ignore[no-untyped-call]
    return out


class _ToHeads(torch.autograd.Function):
    """Ulysses: (b, my shard, H, d) -> (b, the Ulysses group's sequence, H/U, d)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: _ParallelRun, lens: list[int]) -> Tensor:
        ctx.run, ctx.lens = run, lens
        return _to_heads(run, x, lens)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _to_sequence(ctx.run, grad.contiguous(), ctx.lens), None, None


class _ToSequence(torch.autograd.Function):
    """Ulysses, back: (b, the group's sequence, H/U, d) -> (b, my shard, H, d)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: _ParallelRun, lens: list[int]) -> Tensor:
        ctx.run, ctx.lens = run, lens
        return _to_sequence(run, x, lens)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _to_heads(ctx.run, grad.contiguous(), ctx.lens), None, None


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


class _Shift(torch.autograd.Function):
    """Ring: send a flat block to ``to``, receive ``numel`` from ``frm``; backward reverses."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: _ParallelRun, to: int, frm: int, numel: int) -> Tensor:
        ctx.run, ctx.to, ctx.frm, ctx.numel = run, to, frm, x.numel()
        return run.sp._shift(x.contiguous(), to, frm, numel)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        back = ctx.run.sp._shift(grad.contiguous(), ctx.frm, ctx.to, ctx.numel)
        return back, None, None, None, None


class _Anchor(torch.autograd.Function):
    """``out`` unchanged; in backward, a zero gradient for ``block`` (see ``_ring``)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, block: Tensor) -> Tensor:
        ctx.block_shape, ctx.block_dtype = block.shape, block.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.new_zeros(ctx.block_shape, dtype=ctx.block_dtype)
