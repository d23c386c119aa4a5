"""attnres.distributed: rank consensus over real gloo process groups.

Multi-process tests start real processes (``multiprocessing`` spawn context)
that join a gloo group through a ``file://`` rendezvous in ``tmp_path``. Every
process is joined with a hard deadline and killed past it, so a bug can fail
these tests but never hang the run.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from dist_workers import build_decisions, run_processes, worker

import attnres
from attnres import distributed
from attnres.distributed import ConsensusError, ConsensusReport, verify_consensus

# The protocol's own bounds, from which every "does not hang" deadline below is
# derived. Nothing here measures how fast this machine starts processes: the only
# wall-clock bounds are the timeouts the code promises to honour, times a wide
# margin, so a loaded 2-core machine cannot fail these tests (issue 11, case 15).
#: ``init_process_group(timeout=...)`` in the worker: how long a rank waits at
#: the rendezvous for the others (which covers their start-up).
RENDEZVOUS_TIMEOUT_S = 30.0
#: How long a rank of ``absent_rank1`` waits for the others' results.
LINGER_S = 30.0
#: Every protocol bound is multiplied by this before a test calls it a hang.
MARGIN = 3.0


def hard_bound_s(timeout_s: float) -> float:
    """What verify_consensus promises: ``timeout`` plus its grace, never more."""
    return timeout_s + max(distributed._GRACE_MIN_S, 0.25 * timeout_s)


def hang_deadline_s(scenario: str, timeout_s: float, calls: int) -> float:
    """The longest a correct run of ``scenario`` can take, times ``MARGIN``."""
    protocol = RENDEZVOUS_TIMEOUT_S + calls * hard_bound_s(timeout_s)
    if scenario == "late_rank1":
        protocol += timeout_s + 1.0  # rank 1 sleeps past rank 0's timeout first
    if scenario == "absent_rank1":
        protocol += LINGER_S
    return MARGIN * protocol


def run_ranks(
    tmp_path: Path,
    world_size: int,
    scenario: str,
    *,
    timeout_s: float = 10.0,
    calls: int = 1,
) -> dict[int, dict[str, Any]]:
    """Run one worker per rank; return each rank's result.

    Fails (never hangs) if a rank is still running past ``hang_deadline_s``.
    """
    run_processes(
        worker,
        [(rank, world_size, str(tmp_path), scenario) for rank in range(world_size)],
        hang_deadline_s(scenario, timeout_s, calls),
        timeout_s=timeout_s,
        linger_s=LINGER_S,
        calls=calls,
    )
    results = {
        rank: json.loads((tmp_path / f"result.{rank}.json").read_text())
        for rank in range(world_size)
    }
    return results


def test_two_ranks_that_agree(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, "agree", calls=3)
    for rank, r in results.items():
        assert r["statuses"] == ["ok", "ok", "ok"], r
        assert r["rank"] == rank
        assert r["world_size"] == 2
        assert r["layers"] == 40 * 2 + 24 + 1
        assert r["call_sites"] == 4
    assert results[0]["digest"] == results[1]["digest"]


def test_rank_without_flash_attn_is_named_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, "no_flash_on_rank1")
    messages = {results[r]["error"] for r in (0, 1) if results[r]["status"] == "error"}
    assert len(messages) == 1, results  # both ranks raised, with the same message
    (message,) = messages
    assert message.startswith("Ranks disagree on attention backends: ")
    assert "component 'transformer' layer 'blocks.attn1'" in message
    assert "rank 0 -> fa x40 (origin global_cli)" in message
    assert "rank 1 -> torch_sdpa x40 (platform default fallback; origin global_cli)" in message
    # Call sites that agree are not reported.
    assert "blocks.attn2" not in message
    assert "text_encoder" not in message
    assert "1 of 4 call sites differ across 2 ranks" in message


def test_rank_that_never_arrives_is_a_timeout_not_a_hang(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, "absent_rank1", timeout_s=5.0)
    assert results[1] == {"status": "absent"}
    r0 = results[0]
    assert r0["status"] == "error"
    assert "timed out after 5 s" in r0["error"]
    assert "rank 1 did not call verify_consensus" in r0["error"]
    assert "rank 0 arrived" in r0["error"]
    # Not before the timeout (a lower bound, not a speed assertion). That it is not
    # a hang is run_ranks' to prove: a rank still running past hang_deadline_s (the
    # protocol's bound times MARGIN) fails the test there.
    assert r0["elapsed_s"] >= 5.0


def test_rank_that_arrives_after_the_timeout_also_raises(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, "late_rank1", timeout_s=2.0)
    r0, r1 = results[0], results[1]
    assert r0["status"] == r1["status"] == "error", results
    assert "timed out after 2 s: rank 1 did not call verify_consensus" in r0["error"]
    # The late rank learns at once that the call was abandoned, and why.
    assert "timed out after 2 s: rank 1 did not call verify_consensus" in r1["error"]
    assert "This rank (rank 1) arrived after the others had given up" in r1["error"]
    # The message above proves the late rank took the "abandoned" path rather than
    # waiting out its own timeout (no clock is read for that); a hang fails
    # run_ranks at hang_deadline_s.


@pytest.mark.slow
def test_subgroup_names_global_ranks(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 3, "subgroup")
    assert results[0] == {"status": "not a member"}
    assert results[1]["status"] == results[2]["status"] == "error", results
    assert results[1]["error"] == results[2]["error"]
    assert "rank 1 -> fa x40" in results[1]["error"]
    assert "rank 2 -> torch_sdpa x40" in results[1]["error"]
    assert "across 2 ranks" in results[1]["error"]


@pytest.mark.slow
def test_four_ranks_one_differs(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 4, "rank3_differs")
    assert all(r["status"] == "error" for r in results.values()), results
    messages = {r["error"] for r in results.values()}
    assert len(messages) == 1
    (message,) = messages
    assert "component 'transformer' layer 'blocks.attn1'" in message
    assert "ranks 0-2 -> fa x40 (origin global_cli)" in message
    assert "rank 3 -> torch_sdpa x40 (platform default fallback; origin global_cli)" in message
    assert "across 4 ranks" in message


# ---------------------------------------------------------------------------
# Single process: torch.distributed not initialised.


def test_not_initialised_is_a_world_of_one() -> None:
    report = verify_consensus(build_decisions("agree", 0))
    assert report == ConsensusReport(
        world_size=1,
        rank=0,
        layers=105,
        call_sites=4,
        digest=report.digest,
        ok=True,
    )
    assert len(report.digest) == 64
    # The default is this process's own ledger.
    assert verify_consensus(timeout=timedelta(seconds=1)).world_size == 1
    assert distributed.ConsensusError is attnres.ConsensusError


def test_not_initialised_with_a_group_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed to be initialised"):
        verify_consensus([], group=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), timedelta(0)])
def test_bad_timeouts_are_rejected(bad: Any) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive"):
        verify_consensus([], timeout=bad)


def test_timeout_of_the_wrong_type_is_rejected() -> None:
    with pytest.raises(TypeError, match="timeout must be seconds"):
        verify_consensus([], timeout="5")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# The summary and the comparison, in process.


def _summary(scenario: str, rank: int) -> dict[tuple[str, str], tuple[Any, ...]]:
    text = distributed._encode(distributed._summarize(build_decisions(scenario, rank)))
    return distributed._decode(text)


def test_summary_is_run_length_encoded() -> None:
    summary = _summary("agree", 0)
    assert summary[("transformer", "blocks.attn1")] == (("fa", None, "global_cli", 40),)
    assert summary[("vae", "mid.attn")] == (
        ("torch_sdpa", "global backend fallback", "global_cli", 1),
    )


def test_identical_summaries_compare_equal() -> None:
    summaries = {r: _summary("agree", r) for r in range(3)}
    assert distributed._compare(summaries, {r: r for r in range(3)}) is None


def test_call_sites_on_some_ranks_only_are_reported() -> None:
    a = _summary("agree", 0)
    b = dict(a)
    del b[("vae", "mid.attn")]
    b[("audio_vae", "attn")] = (("torch_sdpa", None, "none", 2),)
    message = distributed._compare({0: a, 1: b}, {0: 0, 1: 1})
    assert message is not None
    assert (
        "component 'audio_vae' layer 'attn': rank 0 -> absent, "
        "rank 1 -> torch_sdpa x2 (origin none)" in message
    )
    assert (
        "component 'vae' layer 'mid.attn': rank 0 -> torch_sdpa (global backend fallback; "
        "origin global_cli), rank 1 -> absent" in message
    )
    assert "2 of 5 call sites differ" in message


def test_a_difference_in_origin_only_is_still_a_disagreement() -> None:
    a = {("t", "l"): (("fa", None, "global_cli", 1),)}
    b = {("t", "l"): (("fa", None, "layer_default", 1),)}
    message = distributed._compare({0: a, 1: b}, {0: 0, 1: 1})
    assert message is not None
    assert message.startswith("Ranks disagree on how attention backends were chosen: ")


def test_mixed_sequences_and_rank_ranges() -> None:
    good = {("t", "l"): (("fa", None, "global_cli", 3),)}
    bad = {("t", "l"): (("fa", None, "global_cli", 2), (None, None, "global_cli", 1))}
    summaries = {r: (bad if r in (2, 5, 6, 7) else good) for r in range(8)}
    message = distributed._compare(summaries, {r: r for r in range(8)})
    assert message is not None
    assert "ranks 0-1,3-4 -> fa x3 (origin global_cli)" in message
    assert "ranks 2,5-7 -> [fa x2 (origin global_cli), rejected (origin global_cli)]" in message


def test_long_lists_are_truncated() -> None:
    a = {("t", f"l{i:03d}"): (("fa", None, "x", 1),) for i in range(50)}
    b = {("t", f"l{i:03d}"): (("eager", None, "x", 1),) for i in range(50)}
    message = distributed._compare({0: a, 1: b}, {0: 0, 1: 1})
    assert message is not None
    assert "... and 30 more call sites" in message
    assert "50 of 50 call sites differ" in message


# ---------------------------------------------------------------------------
# The store protocol, in process: "ranks" are threads sharing one HashStore.


def _run_protocol(
    store: Any, world_size: int, rank: int, scenario: str, timeout_s: float, delay_s: float = 0.0
) -> Any:
    time.sleep(delay_s)
    payload = distributed._encode(distributed._summarize(build_decisions(scenario, rank)))
    return distributed._protocol(
        store,
        rank,
        world_size,
        {r: r for r in range(world_size)},
        payload,
        distributed._digest(payload),
        timeout_s,
        time.monotonic() + timeout_s,
    )


def _threads(
    world_size: int,
    scenario: str,
    timeout_s: float,
    delays: dict[int, float],
    late: frozenset[int] = frozenset(),
) -> Any:
    """Run each rank's protocol in a thread; ranks in ``late`` start only once the
    others have returned (an ordering, not a race against the clock)."""
    import threading

    import torch.distributed as dist

    store = dist.HashStore()
    out: dict[int, Any] = {}

    def target(rank: int) -> None:
        out[rank] = _run_protocol(
            store, world_size, rank, scenario, timeout_s, delays.get(rank, 0.0)
        )

    limit = MARGIN * hard_bound_s(timeout_s) + max(delays.values(), default=0.0)
    for wave in ([r for r in range(world_size) if r not in late], sorted(late)):
        threads = [threading.Thread(target=target, args=(r,)) for r in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join(limit)
        assert not any(t.is_alive() for t in threads)
    return store, out


def test_protocol_cleans_up_and_repeats() -> None:
    store, out = _threads(3, "agree", 5.0, {1: 0.05, 2: 0.1})
    assert {o.kind for o in out.values()} == {"ok"}
    # Only the three per-rank call counters remain.
    assert store.num_keys() == 3
    out2 = [_run_protocol(store, 1, 0, "agree", 1.0)]  # a second call, world of one
    assert out2[0].kind == "ok"


def test_protocol_mismatch_is_the_same_on_every_rank() -> None:
    _, out = _threads(2, "no_flash_on_rank1", 5.0, {1: 0.1})
    assert out[0] == out[1]
    assert out[0].kind == "mismatch"


def test_protocol_late_rank_gets_the_abandoned_verdict() -> None:
    _, out = _threads(3, "agree", 0.3, {}, late=frozenset({2}))
    assert {o.kind for o in out.values()} == {"timeout"}
    assert "rank 2 did not call verify_consensus" in out[0].message
    assert "ranks 0-1 arrived" in out[1].message
    assert "This rank (rank 2) arrived after the others had given up" in out[2].message


def test_a_store_that_never_answers_cannot_hang_the_caller(monkeypatch: Any) -> None:
    import threading

    import torch.distributed as dist

    never = threading.Event()
    answered = threading.Event()

    class DeadStore:
        def add(self, key: str, value: int) -> int:
            never.wait(60.0)  # a store op that blocks (e.g. an unreachable server)
            answered.set()
            return 0

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(distributed, "_group_store", lambda group: DeadStore())
    monkeypatch.setattr(distributed, "_GRACE_MIN_S", 0.2)
    with pytest.raises(ConsensusError, match=r"store did not answer within 0\.3 s"):
        verify_consensus([], timeout=0.3)
    # The store had not answered when the caller was released: the hard bound
    # (0.3 s + 0.2 s grace) released it, not the store (no clock read at all).
    assert not answered.is_set()
    never.set()


def test_a_store_error_becomes_a_consensus_error(monkeypatch: Any) -> None:
    import torch.distributed as dist

    class BrokenStore:
        def add(self, key: str, value: int) -> int:
            raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(distributed, "_group_store", lambda group: BrokenStore())
    with pytest.raises(ConsensusError, match="store raised RuntimeError: Connection reset"):
        verify_consensus([], timeout=1)
