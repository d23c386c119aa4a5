"""Worker processes for the multi-process tests of :mod:`attnres.distributed`.

They live in their own module under ``tests/`` (not in the test file) so that
a ``spawn``-started process can import them by name: the child gets the
parent's ``sys.path``, which holds ``tests/`` under pytest. Each worker joins a
gloo group through a ``file://`` rendezvous, builds a synthetic ledger for its scenario, calls
:func:`attnres.distributed.verify_consensus` and writes what happened to
``result.<rank>.json`` in the rendezvous directory.

Scenarios:

- ``agree``: every rank made the same decisions.
- ``no_flash_on_rank1``: rank 1 decided as if its platform lacked flash-attn
  (its transformer layers fell back to ``torch_sdpa``).
- ``rank3_differs``: like the above, but on rank 3.
- ``absent_rank1``: rank 1 joins the group but never calls verify_consensus;
  it waits until every other rank wrote its result (at most ``linger_s``).
- ``late_rank1``: rank 1 calls verify_consensus one second after rank 0's
  timeout expired.
- ``subgroup``: three ranks; ranks 1 and 2 verify over ``new_group([1, 2])``
  and rank 2 lacks flash-attn; rank 0 is not a member and only builds the group.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from attnres.backends import Backend
from attnres.ledger import Decision
from attnres.trace import Outcome

SCENARIOS = (
    "agree",
    "no_flash_on_rank1",
    "rank3_differs",
    "absent_rank1",
    "late_rank1",
    "subgroup",
)
_LACKS_FLASH = {("no_flash_on_rank1", 1), ("rank3_differs", 3), ("subgroup", 2)}


class _NoTrace:
    """Stands in for a trace: synthetic decisions have none."""

    digest = "0" * 64


def _decision(
    component: str, layer: str, backend: str, reason: str | None, origin: str
) -> Decision:
    return Decision(
        component=component,
        layer=layer,
        outcome=Outcome("selected", origin, Backend.parse(backend), reason),
        trace=_NoTrace(),  # type: ignore[arg-type]
    )


def build_decisions(scenario: str, rank: int) -> list[Decision]:
    """The ledger of ``rank`` in ``scenario``: 40 transformer blocks and their encoders."""
    if (scenario, rank) in _LACKS_FLASH:
        dense, reason = "torch_sdpa", "platform default fallback"
    else:
        dense, reason = "fa", None
    out: list[Decision] = []
    for _ in range(40):
        out.append(_decision("transformer", "blocks.attn1", dense, reason, "global_cli"))
        out.append(_decision("transformer", "blocks.attn2", "torch_sdpa", None, "role_override"))
    for _ in range(24):
        out.append(
            _decision("text_encoder", "encoder.self_attn", "torch_sdpa", None, "layer_default")
        )
    out.append(_decision("vae", "mid.attn", "torch_sdpa", "global backend fallback", "global_cli"))
    return out


def _write(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True))
    os.replace(tmp, path)


def join_group(rank: int, world_size: int, directory: Path, timeout_s: float = 30.0) -> None:
    """Join the gloo group of ``world_size`` ranks through ``directory``'s rendezvous file."""
    import torch.distributed as dist

    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory / 'rendezvous'}",
        world_size=world_size,
        rank=rank,
        timeout=timedelta(seconds=timeout_s),
    )


def run_processes(target: Any, args: list[tuple[Any, ...]], limit_s: float, **kwargs: Any) -> None:
    """Start one spawned process per argument tuple, join them all within ``limit_s``;
    kill and fail on any still running, fail on a non-zero exit (never hangs)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=a, kwargs=kwargs, daemon=True) for a in args]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} still running after {limit_s:g} s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"worker exit codes {codes}"


def worker(
    rank: int,
    world_size: int,
    tmpdir: str,
    scenario: str,
    timeout_s: float = 10.0,
    linger_s: float = 20.0,
    calls: int = 1,
) -> None:
    """One rank: join the group, verify ``calls`` times, write ``result.<rank>.json``, leave.

    The result records the last call's outcome and every call's status.
    """
    import torch.distributed as dist

    from attnres.distributed import ConsensusError, verify_consensus

    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; expected one of {SCENARIOS}")
    directory = Path(tmpdir)
    join_group(rank, world_size, directory)
    result_path = directory / f"result.{rank}.json"
    try:
        if scenario == "absent_rank1" and rank == 1:
            # Joined the group, never calls verify_consensus: wait for the others.
            others = [directory / f"result.{r}.json" for r in range(world_size) if r != rank]
            deadline = time.monotonic() + linger_s
            while time.monotonic() < deadline and not all(p.exists() for p in others):
                time.sleep(0.05)
            _write(result_path, {"status": "absent"})
            return
        group = None
        if scenario == "subgroup":
            group = dist.new_group([1, 2])  # collective: every rank builds it
            if rank == 0:
                _write(result_path, {"status": "not a member"})
                return
        if scenario == "late_rank1" and rank == 1:
            time.sleep(timeout_s + 1.0)
        statuses: list[str] = []
        outcome: dict[str, Any] = {}
        start = time.monotonic()
        for _ in range(calls):
            try:
                report = verify_consensus(
                    build_decisions(scenario, rank), group=group, timeout=timeout_s
                )
            except ConsensusError as exc:
                outcome = {"status": "error", "error": str(exc)}
            else:
                outcome = {
                    "status": "ok",
                    "world_size": report.world_size,
                    "rank": report.rank,
                    "layers": report.layers,
                    "call_sites": report.call_sites,
                    "digest": report.digest,
                }
            statuses.append(outcome["status"])
        outcome["elapsed_s"] = time.monotonic() - start
        outcome["statuses"] = statuses
        _write(result_path, outcome)
    finally:
        dist.destroy_process_group()
