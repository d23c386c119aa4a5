"""Verify that every rank of a job resolved the same attention backends.

Ranks of one tensor- or sequence-parallel job must run the same kernel for the
same layer: a rank that silently fell back to another backend (its platform
lacks flash-attn, its environment differs) computes different numerics, or
takes a different code path into the next collective, and the job deadlocks or
diverges far away from the cause. :func:`verify_consensus` compares the
decisions of all ranks once, after the model is built, and fails loudly and
identically on every rank that took part.

Design (see ``docs/distributed.md``):

- No collective is used. Each rank publishes a compact JSON summary of its
  decisions in the process group's key-value *store* (the rendezvous store that
  ``init_process_group`` already created: a ``TCPStore`` under torchrun, a
  ``FileStore`` for ``file://``). Collectives cannot be relied on to honour a
  timeout when a peer never arrives (gloo's ``all_gather_object`` may block
  forever), and with NCCL they would also need the current CUDA device set;
  the store needs neither, so the check works the same over gloo and NCCL.
- Every wait is a poll of the non-blocking ``Store.check`` against a monotonic
  deadline, so no wait depends on a store honouring a timeout.
- The whole store exchange runs in a daemon thread that the caller joins with a
  hard bound (``timeout`` plus a grace period), so even a store operation that
  blocks (an unreachable ``TCPStore`` server) cannot hang the caller.
- Whether a call completed or was abandoned is decided by one atomic
  ``compare_set`` on a per-call state key: the last rank to arrive marks it
  ``complete``, the first rank to time out marks it ``abandoned``, and
  whichever came first wins. Every rank that takes part therefore reaches the
  same verdict: all compare the same summaries (and all raise, or none does),
  or all raise the timeout error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import structlog
import torch.distributed as dist
from attrs import frozen

from attnres.errors import ArgumentTypeError, ConsensusError, SequenceParallelArgumentError
from attnres.ledger import Decision
from attnres.ledger import decisions as _ledger_decisions

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ConsensusError",
    "ConsensusReport",
    "verify_consensus",
]

#: The timeout used when ``verify_consensus(timeout=None)``, in seconds.
DEFAULT_TIMEOUT_S = 60.0
#: the longest ``timeout`` accepted (seconds): a week (issue 32: a huge one overflowed)
MAX_TIMEOUT_S = 7 * 24 * 3600.0

#: Store keys live under this prefix (inside the group's own store prefix).
_NAMESPACE = "attnres/consensus/v1"
_SCHEMA = 1
#: At most this many differing call sites are spelled out in an error message.
_MAX_LISTED = 20
_COMPLETE = "complete"
#: Beyond ``timeout``, how long the caller waits for the store exchange itself
#: before giving up on a store that does not answer (at least this, or a quarter
#: of the timeout).
_GRACE_MIN_S = 5.0

Timeout = float | int | timedelta | None
# One run of identical consecutive decisions at one call site:
# (backend or None when rejected, reason, origin, how many in a row).
_Run = tuple[str | None, str | None, str, int]
_Key = tuple[str, str]


@frozen
class ConsensusReport:
    """What :func:`verify_consensus` verified (it raises instead of returning a failure).

    ``rank`` is this process's rank in the group; ``layers`` counts the layer
    decisions compared (40 identical blocks count 40), ``call_sites`` the
    distinct (component, layer name) keys; ``digest`` is the SHA-256 of the
    canonical summary, the same on every rank when ``ok``.
    """

    world_size: int
    rank: int
    layers: int
    call_sites: int
    digest: str
    ok: bool = True


# --------------------------------------------------------------------------
# Summaries: compact, JSON-able, order-preserving per call site.


def _summarize(decisions: Iterable[Decision]) -> dict[_Key, list[_Run]]:
    """Run-length encode the decisions of every call site, in ledger order."""
    sites: dict[_Key, list[_Run]] = {}
    for d in decisions:
        backend = None if d.backend is None else str(d.backend)
        reason = None if d.reason is None else str(d.reason)
        entry = (backend, reason, str(d.origin))
        runs = sites.setdefault(d.key(), [])
        if runs and runs[-1][:3] == entry:
            last = runs[-1]
            runs[-1] = (last[0], last[1], last[2], last[3] + 1)
        else:
            runs.append((*entry, 1))
    return sites


def _encode(sites: Mapping[_Key, Sequence[_Run]]) -> str:
    """The canonical JSON of a summary: sorted call sites, compact separators."""
    rows = [[c, layer, [list(run) for run in sites[(c, layer)]]] for c, layer in sorted(sites)]
    return json.dumps({"schema": _SCHEMA, "sites": rows}, sort_keys=True, separators=(",", ":"))


def _decode(text: str) -> dict[_Key, tuple[_Run, ...]]:
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("schema") != _SCHEMA:
        raise ConsensusError(
            "a rank published a consensus summary in an unknown format "
            f"(schema {data.get('schema') if isinstance(data, dict) else '?'}, expected "
            f"{_SCHEMA}): are all ranks running the same attnres version?"
        )
    out: dict[_Key, tuple[_Run, ...]] = {}
    for component, layer, runs in data["sites"]:
        out[(component, layer)] = tuple(
            (backend, reason, origin, int(count)) for backend, reason, origin, count in runs
        )
    return out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------
# Rendering differences.


def _rank_label(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0,2,5-7``."""
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts: list[str] = []
    start = prev = rs[0]
    for r in [*rs[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)


def _render_run(run: _Run) -> str:
    backend, reason, origin, count = run
    text = backend if backend is not None else "rejected"
    if count > 1:
        text += f" x{count}"
    details = [reason] if reason else []
    details.append(f"origin {origin}")
    return f"{text} ({'; '.join(details)})"


def _render_value(runs: tuple[_Run, ...] | None) -> str:
    if runs is None:
        return "absent"
    if len(runs) == 1:
        return _render_run(runs[0])
    return "[" + ", ".join(_render_run(r) for r in runs) + "]"


def _render_key(key: _Key) -> str:
    component, layer = key
    c = f"component {component!r}" if component else "no component"
    lay = f"layer {layer!r}" if layer else "an unnamed layer"
    return f"{c} {lay}"


def _backends_of(runs: tuple[_Run, ...] | None) -> tuple[tuple[str | None, int], ...] | None:
    return None if runs is None else tuple((r[0], r[3]) for r in runs)


def _compare(
    summaries: Mapping[int, Mapping[_Key, tuple[_Run, ...]]], labels: Mapping[int, int]
) -> str | None:
    """None when every rank's summary is identical, else the error message.

    ``summaries`` is keyed by group rank; ``labels`` maps a group rank to the
    rank printed in messages (the global rank).
    """
    keys = sorted(set().union(*(s.keys() for s in summaries.values())))
    lines: list[str] = []
    backends_differ = False
    for key in keys:
        values = {r: s.get(key) for r, s in summaries.items()}
        distinct = set(values.values())
        if len(distinct) == 1:
            continue
        if len({_backends_of(v) for v in distinct}) > 1:
            backends_differ = True
        groups: dict[tuple[_Run, ...] | None, list[int]] = {}
        for r in sorted(values, key=lambda r: labels[r]):
            groups.setdefault(values[r], []).append(labels[r])
        rendered = ", ".join(f"{_rank_label(rs)} -> {_render_value(v)}" for v, rs in groups.items())
        lines.append(f"{_render_key(key)}: {rendered}")
    if not lines:
        return None
    what = "attention backends" if backends_differ else "how attention backends were chosen"
    shown = lines[:_MAX_LISTED]
    message = f"Ranks disagree on {what}: " + "\n  ".join(shown)
    if len(lines) > len(shown):
        message += f"\n  ... and {len(lines) - len(shown)} more call sites"
    message += (
        f"\n({len(lines)} of {len(keys)} call sites differ across {len(summaries)} ranks. "
        "Every rank must run the same attention backend for the same layer, or collectives "
        "deadlock: give all ranks the same platform (`attnres doctor`) and configuration.)"
    )
    return message


# --------------------------------------------------------------------------
# The store protocol.


def _group_position(
    group: dist.ProcessGroup | None, error: type[Exception], who: str, verb: str
) -> tuple[int, int]:
    """(world size, rank) of this process in ``group``; ``error`` when it is not a member."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise error(
            f"{who}: this process is not a member of the given group; {verb} it on the "
            f"group's ranks only, with a group that holds this rank"
        )
    return size, rank


def _timeout_seconds(timeout: Timeout, who: str = "verify_consensus") -> float:
    """``timeout`` in seconds; a value out of bounds is a
    :class:`~attnres.errors.SequenceParallelArgumentError` (a ``ValueError``)
    saying what ``who`` was given and the bound (issue 32 items 11, 16)."""
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        # a huge int is compared before float() would overflow
        # (either way: -10**400 overflowed float() too)
        seconds = (
            float(max(min(timeout, MAX_TIMEOUT_S + 1), -1)) if isinstance(timeout, int) else timeout
        )
    else:
        raise ArgumentTypeError(
            f"{who}: timeout must be seconds (float) or a datetime.timedelta, got "
            f"{type(timeout).__name__}"
        )
    huge = isinstance(timeout, int) and abs(timeout) >= 10**30
    shown = "a huge number" if huge else repr(timeout)
    if not math.isfinite(seconds) or seconds <= 0:
        raise SequenceParallelArgumentError(
            f"{who}: timeout must be a positive, finite duration of at most "
            f"{MAX_TIMEOUT_S:g} s (a week), got {shown}",
            "timeout",
            MAX_TIMEOUT_S,
        )
    if seconds > MAX_TIMEOUT_S:  # issue 32: 1e300 s overflowed timedelta and thread waits
        raise SequenceParallelArgumentError(
            f"{who}: timeout must be at most {MAX_TIMEOUT_S:g} s (a week), got {shown}: a "
            f"bound that long never stops a hang in practice; pass seconds (or a timedelta) "
            f"up to a week",
            "timeout",
            MAX_TIMEOUT_S,
        )
    return seconds


def _group_store(group: dist.ProcessGroup | None) -> Store:
    """The key-value store of ``group`` (the default store for the world group)."""
    c10d = dist.distributed_c10d
    world = c10d.GroupMember.WORLD
    try:
        if group is None or group is world:
            store: Store = c10d._get_default_store()
            return store
        getter = getattr(c10d, "_get_process_group_store", None)
        if getter is not None:
            group_store: Store = getter(group)
            return group_store
        name = c10d._get_process_group_name(group)
        from torch._C._distributed_c10d import PrefixStore

        return PrefixStore(f"attnres/{name}/", c10d._get_default_store())
    except (KeyError, ValueError, AttributeError, RuntimeError) as exc:
        raise ConsensusError(
            "verify_consensus could not find the key-value store of the process group "
            f"({type(exc).__name__}: {exc}); it needs a group created by "
            "torch.distributed.init_process_group or new_group"
        ) from exc


def _poll(store: Store, keys: list[str], deadline: float) -> bool:
    """Wait until every key exists, by polling ``check``; False at the deadline."""
    delay = 0.002
    while True:
        if store.check(keys):
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)


def _get_many(store: Store, keys: list[str]) -> list[str]:
    multi_get = getattr(store, "multi_get", None)
    values: list[bytes] = (
        list(multi_get(keys)) if multi_get is not None else [store.get(k) for k in keys]
    )
    return [v.decode("utf-8") for v in values]


@frozen
class _Outcome:
    kind: str  # "ok", "mismatch" or "timeout"
    message: str = ""


def _protocol(
    store: Store,
    rank: int,
    world_size: int,
    labels: Mapping[int, int],
    payload: str,
    digest: str,
    timeout_s: float,
    deadline: float,
) -> _Outcome:
    # Per-rank call counter, kept in the store itself: the n-th call of every
    # rank meets the n-th call of the others, and a fresh store starts at 1.
    generation = store.add(f"{_NAMESPACE}/calls/{rank}", 1)
    prefix = f"{_NAMESPACE}/{generation}"
    state_key = f"{prefix}/state"
    store.set(f"{prefix}/summary/{rank}", payload)
    store.set(f"{prefix}/digest/{rank}", digest)
    arrived = store.add(f"{prefix}/arrived", 1)

    if arrived >= world_size:
        state = store.compare_set(state_key, "", _COMPLETE).decode("utf-8")
    elif _poll(store, [state_key], deadline):
        state = store.get(state_key).decode("utf-8")
    else:
        # Give up, unless the last rank completed the call in the meantime.
        present = [r for r in range(world_size) if store.check([f"{prefix}/digest/{r}"])]
        mark = json.dumps(
            {
                "by": labels[rank],
                "timeout": timeout_s,
                "arrived": [labels[r] for r in present],
                "missing": [labels[r] for r in range(world_size) if r not in present],
            }
        )
        state = store.compare_set(state_key, "", mark).decode("utf-8")

    try:
        if state != _COMPLETE:
            return _Outcome(
                "timeout", _timeout_message(state, labels[rank], world_size, generation)
            )
        digests = _get_many(store, [f"{prefix}/digest/{r}" for r in range(world_size)])
        if all(d == digest for d in digests):
            return _Outcome("ok")
        texts = _get_many(store, [f"{prefix}/summary/{r}" for r in range(world_size)])
        message = _compare({r: _decode(t) for r, t in enumerate(texts)}, labels)
        return _Outcome("ok") if message is None else _Outcome("mismatch", message)
    finally:
        _leave(store, prefix, world_size)


def _timeout_message(state: str, me: int, world_size: int, generation: int) -> str:
    """The same message on every rank of an abandoned call (plus a note on late ones)."""
    try:
        mark = json.loads(state)
        by, waited = int(mark["by"]), float(mark["timeout"])
        arrived = [int(r) for r in mark["arrived"]]
        missing = [int(r) for r in mark["missing"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConsensusError(
            f"verify_consensus found an unreadable state in the store ({state!r}): "
            "are all ranks running the same attnres version?"
        ) from exc
    message = (
        f"Consensus on attention backends timed out after {waited:g} s: "
        f"{_rank_label(missing) if missing else 'no rank'} did not call verify_consensus "
        f"(call #{generation}) in time; {_rank_label(arrived)} arrived "
        f"(world size {world_size}; rank {by} gave up waiting)."
    )
    if me in missing:
        message += f" This rank (rank {me}) arrived after the others had given up."
    return message + (
        " A rank that never arrives has crashed, hangs, or took a different code path; "
        "the ranks are out of step, so restart the job rather than retrying the check."
    )


def _leave(store: Store, prefix: str, world_size: int) -> None:
    """Count this rank out of a call; the last one out deletes the call's keys."""
    try:
        if store.add(f"{prefix}/done", 1) < world_size:
            return
        keys = [f"{prefix}/{k}" for k in ("state", "arrived", "done")]
        for r in range(world_size):
            keys += [f"{prefix}/summary/{r}", f"{prefix}/digest/{r}"]
        for key in keys:
            store.delete_key(key)
    except Exception:  # best effort: the verdict stands; the keys are small
        pass


# --------------------------------------------------------------------------
# Logging (structlog when the application configured it, else stdlib logging).


# The package attaches a NullHandler to this logger (attnres/__init__.py), so
# unconfigured applications stay silent.
_STDLIB_LOGGER = logging.getLogger("attnres")


def _emit(level: int, event: str, **fields: Any) -> None:
    if structlog.is_configured():
        structlog.get_logger("attnres").log(level, event, **fields)
    elif _STDLIB_LOGGER.isEnabledFor(level):
        _STDLIB_LOGGER.log(level, "%s %s", event, json.dumps(fields, sort_keys=True, default=str))


# --------------------------------------------------------------------------
# Public entry point.


def verify_consensus(
    decisions: Iterable[Decision] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
) -> ConsensusReport:
    """Check that every rank of ``group`` made the same attention decisions.

    Every rank of the group must call this (the n-th call of one rank meets the
    n-th call of the others), typically once after building or loading the
    model. ``decisions`` defaults to :func:`attnres.decisions`; for every
    (component, layer name) the sequence of (backend, reason, origin) is
    compared, run-length encoded so that 40 identical blocks cost one entry.
    Trace digests are not compared (they embed device facts that may
    legitimately differ).

    ``group`` is a ``torch.distributed`` process group (None: the default
    group). ``timeout`` (seconds or a ``timedelta``, default 60 s) bounds the
    wait for the other ranks.

    Returns a :class:`ConsensusReport` when all ranks agree. Raises
    :class:`ConsensusError` on every participating rank when any call site
    differs (the message names the ranks, components, layers and backends), or
    when a rank did not arrive within ``timeout``; it never hangs (see
    ``docs/distributed.md``).

    When ``torch.distributed`` is not initialised there is only this process's
    ledger and nothing to compare: the result is a report for world size 1,
    rank 0 — unless an explicit ``group`` was passed, which is an error.
    """
    timeout_s = _timeout_seconds(timeout)
    snapshot = tuple(_ledger_decisions() if decisions is None else decisions)
    sites = _summarize(snapshot)
    payload = _encode(sites)
    digest = _digest(payload)
    n_layers = sum(run[3] for runs in sites.values() for run in runs)

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ConsensusError(
                "verify_consensus(group=...) needs torch.distributed to be initialised "
                "(call torch.distributed.init_process_group first)"
            )
        return ConsensusReport(
            world_size=1, rank=0, layers=n_layers, call_sites=len(sites), digest=digest
        )

    world_size, rank = _group_position(group, ConsensusError, "verify_consensus", "call")
    report = ConsensusReport(
        world_size=world_size, rank=rank, layers=n_layers, call_sites=len(sites), digest=digest
    )
    if world_size == 1:
        return report

    if group is None or group is dist.distributed_c10d.GroupMember.WORLD:
        labels = {r: r for r in range(world_size)}
    else:
        labels = {r: dist.get_global_rank(group, r) for r in range(world_size)}
    store = _group_store(group)

    deadline = time.monotonic() + timeout_s
    box: list[_Outcome | BaseException] = []

    def run() -> None:
        try:
            box.append(
                _protocol(store, rank, world_size, labels, payload, digest, timeout_s, deadline)
            )
        except BaseException as exc:  # handed to the caller's thread
            box.append(exc)

    worker = threading.Thread(target=run, name="attnres-consensus", daemon=True)
    worker.start()
    # Hard bound: even a store operation that blocks cannot hold the caller.
    worker.join(timeout_s + max(_GRACE_MIN_S, 0.25 * timeout_s))
    if not box:
        raise ConsensusError(
            f"Consensus on attention backends timed out: the process group's store did not "
            f"answer within {timeout_s:g} s (plus grace) on rank {labels[rank]} "
            f"(world size {world_size}); the store server may be unreachable."
        )
    outcome = box[0]
    if isinstance(outcome, ConsensusError):
        raise outcome
    if isinstance(outcome, BaseException):
        raise ConsensusError(
            f"Consensus on attention backends failed on rank {labels[rank]}: the process "
            f"group's store raised {type(outcome).__name__}: {outcome}"
        ) from outcome
    if outcome.kind != "ok":
        _emit(
            logging.WARNING,
            "attention backend consensus failed",
            rank=labels[rank],
            world_size=world_size,
            error=outcome.message,
        )
        raise ConsensusError(outcome.message)
    _emit(
        logging.INFO,
        "attention backends agree across ranks",
        rank=labels[rank],
        world_size=world_size,
        layers=n_layers,
        call_sites=len(sites),
        digest=digest,
    )
    return report
