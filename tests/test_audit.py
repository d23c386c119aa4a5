"""Audit logging (SPEC 5): structlog events for every record and outcome, a single
event for a cache hit, and silence when the application configured nothing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import structlog
from structlog.testing import capture_logs

import attnres
from attnres import (
    LayerSpec,
    Platform,
    ResolutionError,
    SelectionConfig,
    component_scope,
    resolve,
)
from attnres.trace import TransitionRecord, record_to_dict

CPU = Platform.simulate("cpu")
CUDA_SAGE = Platform.simulate("cuda:sm90+flash_attn+sageattention")
SAGE = SelectionConfig(global_backend="sage_attn")
FA_SDPA_DEFAULT = LayerSpec(
    64, "bf16", supported={"fa", "torch_sdpa"}, default="torch_sdpa", name="decoder.attn"
)
OUTCOME_KEYS = {"backend", "reason", "origin", "component", "layer"}
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """capture_logs() leaves structlog 'configured': put the defaults back."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def _not_summary(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if not e.get("summary")]


# -- in-process: structlog capture --------------------------------------------------


def test_cold_resolution_one_debug_event_per_record_then_one_info_outcome() -> None:
    with capture_logs() as logs:
        res = resolve(LayerSpec(64, "fp32", name="blocks.0.attn"), platform=CPU)
    records = res.trace.records
    assert len(logs) == len(records) + 1
    debug, outcome = logs[:-1], logs[-1]
    assert [e["log_level"] for e in debug] == ["debug"] * len(records)
    assert [e["event"] for e in debug] == ["attention record"] * len(records)
    assert [e["index"] for e in debug] == list(range(len(records)))
    for event, record in zip(debug, records, strict=True):
        assert event["component"] is None
        assert event["layer"] == "blocks.0.attn"
        fields = record_to_dict(record)
        assert event["kind"] == fields["kind"]
        for key, value in fields.items():
            if key != "event":
                assert event[key] == value
    assert outcome["log_level"] == "info"
    assert outcome["event"] == "attention backend selected"
    assert set(outcome) >= OUTCOME_KEYS
    assert {k: outcome[k] for k in OUTCOME_KEYS} == {
        "backend": "torch_sdpa",
        "reason": None,
        "origin": "none",
        "component": None,
        "layer": "blocks.0.attn",
    }


def test_transition_records_keep_their_machine_event() -> None:
    """A transition's own ``event`` field cannot clash with the log event name."""
    with capture_logs() as logs:
        res = resolve(LayerSpec(64, "bf16"), platform=Platform.simulate("cuda:sm90"))
    transitions = [
        (i, r) for i, r in enumerate(res.trace.records) if isinstance(r, TransitionRecord)
    ]
    assert transitions
    for index, record in transitions:
        event = logs[index]
        assert event["event"] == "attention record"
        assert event["kind"] == "transition"
        assert event["machine_event"] == record.event.value
        assert (event["source"], event["target"]) == (record.source.value, record.target.value)


def test_outcome_inside_a_scope_names_the_component() -> None:
    with capture_logs() as logs, component_scope("audio_vae"):
        resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    outcomes = [e for e in logs if e["log_level"] == "info" and not e.get("summary")]
    assert len(outcomes) == 1
    assert {k: outcomes[0][k] for k in OUTCOME_KEYS} == {
        "backend": "torch_sdpa",
        "reason": "global backend fallback",
        "origin": "global_cli",
        "component": "audio_vae",
        "layer": "decoder.attn",
    }
    assert all(e["component"] == "audio_vae" for e in logs)


def test_rejection_is_one_warning_with_the_error() -> None:
    with (
        capture_logs() as logs,
        pytest.raises(ResolutionError) as info,
        component_scope("transformer"),
    ):
        resolve(
            LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}), config=SAGE, platform=CUDA_SAGE
        )
    events = _not_summary(logs)
    trace = info.value.trace
    assert len(events) == len(trace.records) + 1
    warnings = [e for e in events if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0] is events[-1]
    warning = warnings[0]
    assert warning["event"] == "attention backend rejected"
    assert warning["error"] == str(info.value)
    assert warning["code"] == "not_in_supported_set"
    assert set(warning) >= OUTCOME_KEYS
    assert warning["backend"] is None
    assert warning["origin"] == "global_cli"
    assert warning["component"] == "transformer"
    assert not [e for e in events if e["log_level"] == "info"]


def test_cache_hit_is_a_single_debug_event() -> None:
    layer = LayerSpec(64, "fp32", name="attn")
    resolve(layer, platform=CPU)
    with capture_logs() as logs:
        resolve(layer, platform=CPU)
    assert len(logs) == 1
    (hit,) = logs
    assert hit["log_level"] == "debug"
    assert hit["event"] == "attention cache hit"
    assert {k: hit[k] for k in OUTCOME_KEYS} == {
        "backend": "torch_sdpa",
        "reason": None,
        "origin": "none",
        "component": None,
        "layer": "attn",
    }


def test_cache_hit_of_a_rejection_is_a_single_debug_event() -> None:
    layer = LayerSpec(64, "fp32")
    with pytest.raises(ResolutionError):
        resolve(layer, platform=CPU, backend="fa")
    with capture_logs() as logs, pytest.raises(ResolutionError):
        resolve(layer, platform=CPU, backend="fa")
    assert [(e["event"], e["log_level"]) for e in logs] == [("attention cache hit", "debug")]
    assert logs[0]["backend"] is None


def test_application_level_filter_at_info_drops_the_record_events() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    with capture_logs() as logs:
        resolve(LayerSpec(64, "fp32"), platform=CPU)
    assert [(e["event"], e["log_level"]) for e in logs] == [("attention backend selected", "info")]


def test_application_level_filter_at_warning_still_sees_rejections() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with capture_logs() as logs:
        resolve(LayerSpec(64, "fp32", name="ok"), platform=CPU)
        with pytest.raises(ResolutionError) as info:
            resolve(LayerSpec(64, "fp32", name="bad"), platform=CPU, backend="fa")
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("attention backend rejected", "warning")
    ]
    assert logs[0]["error"] == str(info.value)
    assert logs[0]["layer"] == "bad"


# -- out of process: what reaches stdout and stderr ------------------------------------

_SCENARIO = textwrap.dedent(
    """
    import attnres
    from attnres import LayerSpec, Platform, SelectionConfig

    cuda = Platform.simulate("cuda:sm90+flash_attn+sageattention")
    sage = SelectionConfig(global_backend="sage_attn")
    layer = LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}, default="torch_sdpa")
    with attnres.component_scope("audio_vae"):
        attnres.resolve(layer, config=sage, platform=cuda)
        attnres.resolve(layer, config=sage, platform=cuda)  # a cache hit
    for _ in range(2):
        try:
            with attnres.component_scope("transformer"):
                attnres.resolve(
                    LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}),
                    config=sage,
                    platform=cuda,
                )
        except attnres.ResolutionError:
            pass
    try:
        with attnres.component_scope("vae", backend="fa"):
            pass
    except attnres.BackendNotAppliedError:
        pass
    import structlog
    assert not structlog.is_configured(), "attnres configured structlog"
    """
)


def _run(prelude: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = SRC
    return subprocess.run(
        [sys.executable, "-c", prelude + _SCENARIO],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_nothing_configured_prints_nothing() -> None:
    out = _run("")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert out.stderr == ""


def test_stdlib_logging_at_debug_shows_every_event_on_stderr() -> None:
    out = _run(
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.WARNING)\n"
        "logging.getLogger('attnres').setLevel(logging.DEBUG)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    err = out.stderr
    for text in (
        "attention record",
        "attention backend selected",
        "attention cache hit",
        "attention backend rejected",
        "Attention backends for audio_vae: torch_sdpa (global backend fallback)",
        "global backend fallback",
    ):
        assert text in err, (text, err)
    assert "DEBUG:attnres:" in err and "INFO:attnres:" in err and "WARNING:attnres:" in err


def test_stdlib_logging_at_warning_shows_only_rejections() -> None:
    out = _run("import logging, sys\nlogging.basicConfig(stream=sys.stderr)\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    lines = [line for line in out.stderr.splitlines() if line]
    assert len(lines) == 1, out.stderr  # the second rejection was a cache hit (DEBUG)
    assert lines[0].startswith("WARNING:attnres:")
    assert "attention backend rejected" in lines[0]
    assert "sage_attn" in lines[0]


def test_the_decision_ledger_is_bounded_and_counts_what_it_drops() -> None:
    from attnres import ledger

    spec = attnres.LayerSpec(head_size=64, dtype="float32")
    previous = ledger.set_decision_limit(3)
    try:
        attnres.clear_decisions()
        for i in range(5):
            attnres.resolve(attrs.evolve(spec, name=f"blocks.{i}.attn"))
        kept = attnres.decisions()
        assert [d.layer for d in kept] == ["blocks.2.attn", "blocks.3.attn", "blocks.4.attn"]
        assert ledger.dropped_decisions() == 2
        ledger.set_decision_limit(2)  # shrinking keeps the newest
        assert [d.layer for d in attnres.decisions()] == ["blocks.3.attn", "blocks.4.attn"]
        assert ledger.dropped_decisions() == 3
        with pytest.raises(ValueError, match="positive integer"):
            ledger.set_decision_limit(0)
    finally:
        ledger.set_decision_limit(previous)
        attnres.clear_decisions()
    assert ledger.dropped_decisions() == 0 and ledger.decision_limit() == ledger.DEFAULT_LIMIT


def test_a_scope_check_that_fails_is_recorded_with_its_code() -> None:
    """SPEC 3.6 problems are records with a ScopeCode: raised in
    BackendNotAppliedError.problems and written to the audit log, one INFO
    event per problem carrying the same code and message."""
    from attnres.errors import BackendNotAppliedError

    with (
        capture_logs() as logs,
        pytest.raises(BackendNotAppliedError) as info,
        component_scope("vae", backend="eager"),
    ):
        resolve(LayerSpec(64, "fp32", name="l0"), platform=CPU, backend="torch_sdpa")
    failed = [e for e in logs if e["event"] == "attention scope check failed"]
    assert [(e["code"], e["message"]) for e in failed] == [
        (p.code.value, p.message) for p in info.value.problems
    ]
    assert [e["code"] for e in failed] == ["override_unexplained", "override_not_applied"]
    assert all(e["log_level"] == "info" and e["component"] == "vae" for e in failed)


def test_a_logger_kept_for_cache_logger_on_first_use_follows_a_reconfiguration() -> None:
    """issue 23: the assembled logger is kept while structlog's configuration stays
    the same; a later configure() (new processors, a new level) is honoured."""
    from structlog.testing import LogCapture

    first, second = LogCapture(), LogCapture()
    layer = LayerSpec(64, "fp32", name="blocks.0.attn")

    def configure(capture: LogCapture, level: int) -> None:
        structlog.configure(
            processors=[capture],
            wrapper_class=structlog.make_filtering_bound_logger(level),
            cache_logger_on_first_use=True,
        )

    configure(first, logging.INFO)
    for _ in range(2):
        attnres.clear_cache()
        resolve(layer, platform=CPU)
    assert [e["event"] for e in first.entries] == ["attention backend selected"] * 2
    configure(second, logging.INFO)
    attnres.clear_cache()
    resolve(layer, platform=CPU)
    assert len(first.entries) == 2 and len(second.entries) == 1
    configure(second, logging.WARNING)  # the level changes: the INFO outcome is dropped
    attnres.clear_cache()
    resolve(layer, platform=CPU)
    assert len(second.entries) == 1
