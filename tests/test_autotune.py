"""Measured selection (autotune): eligibility, verdicts, evidence, sharing, replay,
results files.

Verdicts are made deterministic with fake backends whose kernels advance a fake
clock by a fixed cost per call, read by the tuner through ``use_timer``: no test
here depends on real timing. The real CPU candidates (torch_sdpa, eager,
flex_attention) are measured with the real clock, and only their evidence and
its replay are asserted, never which one wins.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

import attnres
from attnres import (
    Attention,
    BackendSpec,
    SelectionConfig,
    component_scope,
    force_backend,
    register_backend,
    set_selection_config,
    unregister_backend,
)
from attnres._states import Event, Origin, State, Verdict
from attnres.autotuner import (
    autotune,
    clear_results,
    is_armed,
    load_results,
    save_results,
    use_timer,
)
from attnres.errors import ResultsFileError, TraceFormatError
from attnres.kernels import get_kernel, register_kernel, unregister_kernel
from attnres.machine import TUNABLE_ORIGINS
from attnres.replayer import replay
from attnres.trace import (
    MeasurementRecord,
    SkipRecord,
    Trace,
    TransitionRecord,
    TuningRecord,
    dump_trace,
    load_trace,
    trace_from_json,
)
from attnres.tuning import (
    DEFAULT_TOLERANCES,
    Measured,
    tolerance_for,
    verdicts,
)

HEADS, SIZE = 2, 16
# q of (1, 8, 2, 16): 256 elements
SMALL = (1, 8, HEADS, SIZE)


class FakeClock:
    """Nanoseconds that pass only when a fake kernel says so."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


CLOCK = FakeClock()
CALLS: dict[str, int] = {}
_SDPA = get_kernel("torch_sdpa")
assert _SDPA is not None


def _fake(
    name: str, cost: int, *, wrong: bool = False, raises: bool = False
) -> Callable[..., torch.Tensor]:
    def kernel(q, k, v, attn_mask, causal, scale):  # type: ignore[no-untyped-def]
        CALLS[name] = CALLS.get(name, 0) + 1
        if raises:
            raise RuntimeError(f"{name} cannot run this call")
        CLOCK.now += cost
        out = _SDPA(q, k, v, attn_mask, causal, scale)
        return out + 0.5 if wrong else out

    return kernel


#: fake backends: name -> (cost per call in ns, wrong, raises)
FAKES: dict[str, tuple[int, bool, bool]] = {
    "fake_incumbent": (1000, False, False),
    "fake_close": (990, False, False),  # 1% faster: inside the 2% margin
    "fake_fast": (900, False, False),  # 10% faster
    "fake_faster": (800, False, False),  # 20% faster
    "fake_wrong": (100, True, False),  # fastest, but computes something else
    "fake_raising": (1, False, True),
    "fake_slow": (5000, False, False),
}


@pytest.fixture(scope="module", autouse=True)
def fake_backends() -> Iterator[None]:
    for name, (cost, wrong, raises) in FAKES.items():
        register_backend(
            BackendSpec(
                name=name,
                sparse=False,
                platforms=("cpu", "cuda"),
                dtypes=("float32", "float64", "float16", "bfloat16"),
                description="autotune test double",
            )
        )
        register_kernel(name, _fake(name, cost, wrong=wrong, raises=raises))
    register_backend(
        BackendSpec(name="fake_kernelless", sparse=False, platforms=("cpu",), dtypes=("float32",))
    )
    yield
    for name in [*FAKES, "fake_kernelless"]:
        unregister_kernel(name)
        with contextlib.suppress(ValueError):
            unregister_backend(name)


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    clear_results()
    CALLS.clear()
    with use_timer(CLOCK):
        yield
    clear_results()


def _config(**kwargs: object) -> SelectionConfig:
    settings: dict[str, object] = {
        "autotune": True,
        "autotune_min_elements": 0,
        "autotune_warmup": 1,
        "autotune_repeats": 3,
    }
    settings.update(kwargs)
    return SelectionConfig(**settings)  # type: ignore[arg-type]


def _layer(*candidates: str, default: str = "fake_incumbent", **kwargs: object) -> Attention:
    supported = {default, *candidates}
    kwargs.setdefault("dtype", torch.float32)  # resolve (and arm) at construction
    return Attention(HEADS, SIZE, supported=supported, default=default, **kwargs)  # type: ignore[arg-type]


def _qkv(shape: tuple[int, ...] = SMALL, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen) for _ in range(3))


def _measurements(trace: Trace) -> dict[str, MeasurementRecord]:
    return {r.candidate.name: r for r in trace.records if isinstance(r, MeasurementRecord)}


def _tuning_transition(trace: Trace) -> TransitionRecord:
    return next(
        r for r in trace.records if isinstance(r, TransitionRecord) and r.source is State.MEASURING
    )


# -- the rule ------------------------------------------------------------------


def test_rule_autotune_keeps_the_incumbent_without_a_clear_win() -> None:
    set_selection_config(_config())
    layer = _layer("fake_close", "fake_slow", name="attn")
    assert is_armed(layer)
    layer(*_qkv())
    assert layer.backend.name == "fake_incumbent"
    trace = layer.resolution.trace
    judged = _measurements(trace)
    assert judged["fake_incumbent"].verdict is Verdict.INCUMBENT
    assert judged["fake_close"].verdict is Verdict.WITHIN_MARGIN
    assert judged["fake_slow"].verdict is Verdict.WITHIN_MARGIN
    assert (judged["fake_incumbent"].median_ns, judged["fake_close"].median_ns) == (1000, 990)
    assert judged["fake_close"].spread_ns == 0
    step = _tuning_transition(trace)
    assert (step.event, step.reason, step.candidate.name) == (
        Event.INCUMBENT_KEPT,
        None,
        "fake_incumbent",
    )
    assert layer.resolution.reason is None  # the machine's reason stands
    assert not is_armed(layer)  # tuned: the wrapper stepped aside


def test_rule_autotune_switches_on_a_win_over_the_margin() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", "fake_faster", name="blocks.0.attn1")
    q, k, v = _qkv()
    first = layer(q, k, v)
    assert layer.backend.name == "fake_faster"
    assert layer.resolution.reason == "measured faster"
    assert layer.resolution.origin == "layer_default"
    judged = _measurements(layer.resolution.trace)
    assert judged["fake_faster"].verdict is Verdict.CHOSEN
    assert judged["fake_fast"].verdict is Verdict.OUTPACED
    step = _tuning_transition(layer.resolution.trace)
    assert (step.event, step.reason, step.candidate.name) == (
        Event.MEASURED_FASTER,
        "measured faster",
        "fake_faster",
    )
    assert layer.resolution.trace.outcome.backend.name == "fake_faster"
    # the winner runs from now on, and gives the same attention
    before = CALLS.get("fake_faster", 0)
    torch.testing.assert_close(layer(q, k, v), first)
    assert CALLS["fake_faster"] == before + 1
    # the ledger shows it like any other decision
    last = attnres.decisions()[-1]
    assert (last.layer, last.backend, last.reason, last.origin) == (
        "blocks.0.attn1",
        "fake_faster",
        "measured faster",
        "layer_default",
    )
    assert last.trace is layer.resolution.trace


def test_rule_autotune_rejects_a_faster_candidate_that_disagrees() -> None:
    set_selection_config(_config())
    layer = _layer("fake_wrong", "fake_fast", name="attn")
    layer(*_qkv())
    judged = _measurements(layer.resolution.trace)
    wrong = judged["fake_wrong"]
    assert wrong.verdict is Verdict.DISAGREES
    assert wrong.median_ns == 100  # the fastest by far, and still refused
    assert wrong.deviation is not None and wrong.deviation > DEFAULT_TOLERANCES["float32"]
    assert judged["fake_fast"].deviation == 0.0
    assert layer.backend.name == "fake_fast"


def test_rule_autotune_skips_a_candidate_that_raises_and_records_its_error() -> None:
    set_selection_config(_config())
    layer = _layer("fake_raising", name="attn")
    layer(*_qkv())
    raised = _measurements(layer.resolution.trace)["fake_raising"]
    assert raised.verdict is Verdict.RAISED
    assert raised.error == "RuntimeError: fake_raising cannot run this call"
    assert raised.median_ns is None and raised.deviation is None
    assert layer.backend.name == "fake_incumbent"


def test_rule_autotune_leaves_small_calls_alone_and_stays_armed() -> None:
    set_selection_config(_config(autotune_min_elements=1024))
    layer = _layer("fake_fast", name="attn")
    layer(*_qkv(SMALL))  # 256 elements
    assert is_armed(layer)
    assert layer.backend.name == "fake_incumbent"
    assert "fake_fast" not in CALLS
    construction = attnres.decisions()[-1].trace  # only the construction: no tuning record
    assert not any(isinstance(r, TuningRecord) for r in construction.records)
    layer(*_qkv((1, 32, HEADS, SIZE)))  # 1024 elements: measured now
    assert not is_armed(layer)
    assert layer.backend.name == "fake_fast"
    tuning = next(r for r in layer.resolution.trace.records if isinstance(r, TuningRecord))
    assert tuning.elements == 1024


@pytest.mark.parametrize(
    "how",
    ["layer", "forced", "role_override", "component_override", "global_cli", "config_component"],
)
def test_rule_autotune_never_tunes_explicit_choices(how: str) -> None:
    set_selection_config(_config())
    if how == "global_cli":
        set_selection_config(_config(global_backend="fake_incumbent"))
    if how == "config_component":
        set_selection_config(_config(component_backends={"dit": "fake_incumbent"}))
    scope: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if how == "role_override":
        scope = component_scope("dit", role_backends={"self": "fake_incumbent"})
    elif how == "component_override":
        scope = component_scope("dit", backend="fake_incumbent")
    elif how == "config_component":
        scope = component_scope("dit")
    elif how == "forced":
        scope = force_backend("fake_incumbent")
    kwargs = {"backend": "fake_incumbent"} if how == "layer" else {}
    with scope:
        layer = _layer("fake_fast", name="attn", **kwargs)
    origin = "component_override" if how == "config_component" else how
    assert layer.resolution.origin == origin
    assert Origin(origin) not in TUNABLE_ORIGINS
    assert not is_armed(layer)
    layer(*_qkv())
    assert "fake_fast" not in CALLS
    assert layer.backend.name == "fake_incumbent"
    report = autotune(layer, *_qkv())  # an explicit autotune() call does not either
    assert report.decisions == ()
    assert report.untuned == (("attn", f"origin {origin}: only automatic decisions are tuned"),)


def test_rule_autotune_tunes_exactly_the_automatic_origins() -> None:
    assert {o.value for o in TUNABLE_ORIGINS} == {"none", "layer_default", "global_preference"}
    set_selection_config(_config(global_backend="fake_incumbent", global_backend_explicit=False))
    layer = _layer("fake_fast", name="attn")
    assert layer.resolution.origin == "global_preference"
    layer(*_qkv())
    assert (layer.backend.name, layer.resolution.origin) == ("fake_fast", "global_preference")


def test_rule_autotune_is_off_by_default_and_costs_nothing_then() -> None:
    layer = _layer("fake_fast", name="attn")
    assert not is_armed(layer)
    # the forward body is the plain closure: no wrapper, no extra branch
    assert not hasattr(layer.__dict__["_run"], "attnres_incumbent")
    layer(*_qkv())
    assert "fake_fast" not in CALLS


def test_rule_autotune_candidates_are_the_backends_that_pass_every_check() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", "fake_kernelless", name="attn")
    layer(*_qkv())
    trace = layer.resolution.trace
    measured = set(_measurements(trace))
    assert measured == {"fake_incumbent", "fake_fast"}
    # a candidate outside the supported set failed its check at the measuring stage
    failed = {
        r.candidate.name
        for r in trace.records
        if getattr(r, "stage", None) is State.MEASURING and getattr(r, "passed", True) is False
    }
    assert "fake_faster" in failed and "eager" in failed
    skips = {
        r.candidate.name: r.detail
        for r in trace.records
        if isinstance(r, SkipRecord) and r.stage is State.MEASURING
    }
    assert skips["fake_kernelless"] == "no kernel in this process: no kernel is registered for it"
    assert skips["fake_incumbent"].endswith("(the incumbent)")


def test_the_incumbents_own_error_propagates_and_leaves_the_tuner_armed() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head size"):
        layer(q[..., :8], k[..., :8], v[..., :8])
    assert is_armed(layer) and "fake_fast" not in CALLS


def test_the_tuner_does_not_run_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layer(*_qkv())
    assert is_armed(layer) and "fake_fast" not in CALLS
    monkeypatch.undo()
    layer(*_qkv())
    assert layer.backend.name == "fake_fast"


@pytest.mark.slow
def test_an_armed_layer_compiles_as_one_graph_and_does_not_tune_inside_it() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    q, k, v = _qkv()
    torch.testing.assert_close(compiled(q, k, v), layer.kernel(q, k, v, None, False, None))
    assert is_armed(layer) and "fake_fast" not in CALLS
    layer(q, k, v)  # eager again: it measures now
    assert layer.backend.name == "fake_fast"


def test_tolerance_is_per_dtype_and_configurable() -> None:
    config = SelectionConfig(autotune_tolerance={"bf16": 0.01})
    assert tolerance_for(config, "bfloat16") == 0.01
    assert tolerance_for(config, "float32") == DEFAULT_TOLERANCES["float32"]
    with pytest.raises(ValueError, match=r"autotune_tolerance\['float16'\]"):
        SelectionConfig(autotune_tolerance={"fp16": 2})
    with pytest.raises(ValueError, match="autotune_margin"):
        SelectionConfig(autotune_margin=-0.1)
    with pytest.raises(ValueError, match="autotune_min_elements"):
        SelectionConfig(autotune_min_elements=-1)
    # a looser tolerance admits the wrong kernel: the rule, not the kernel, decides
    set_selection_config(_config(autotune_tolerance={"float32": 0.9}))
    layer = _layer("fake_wrong", name="attn")
    layer(*_qkv())
    assert layer.backend.name == "fake_wrong"


def test_verdicts_rule_edges() -> None:
    inc, a, b = (attnres.backends.Backend(n) for n in ("torch_sdpa", "eager", "flex_attention"))
    judged, winner = verdicts([Measured(inc, 100, 0, 0.0)], 0.02, 1e-3)
    assert judged == (Verdict.INCUMBENT,) and winner is None
    # exactly the margin is not "more than" the margin
    judged, winner = verdicts([Measured(inc, 100, 0, 0.0), Measured(a, 98, 0, 0.0)], 0.02, 1e-3)
    assert judged[1] is Verdict.WITHIN_MARGIN and winner is None
    # a tie between two winners goes to the first in order
    judged, winner = verdicts(
        [Measured(inc, 100, 0, 0.0), Measured(a, 50, 0, 0.0), Measured(b, 50, 0, 0.0)], 0.02, 1e-3
    )
    assert judged[1:] == (Verdict.CHOSEN, Verdict.OUTPACED) and winner == a
    # an output that was not finite (deviation unknown) disagrees
    judged, _ = verdicts([Measured(inc, 100, 0, 0.0), Measured(a, 1, 0, None)], 0.02, 1e-3)
    assert judged[1] is Verdict.DISAGREES
    with pytest.raises(ValueError):
        verdicts([], 0.02, 1e-3)


def test_rule_verdict_rules_first_row_that_holds_wins() -> None:
    """VERDICT_RULES: a candidate gets the first row's verdict whose condition holds,
    in table order (raised before disagrees before outpaced), and every row is
    reachable."""
    from attnres.machine import VERDICT_RULES

    inc, a = (attnres.backends.Backend(n) for n in ("torch_sdpa", "eager"))
    base = Measured(inc, 100, 0, 0.0)
    # each candidate holds every row from its own down (a faster one that raised
    # also disagrees and is faster): the first row decides
    cases = {
        Verdict.RAISED: Measured(a, None, None, None, "boom"),
        # issue 34: over the layer's numeric error budget (0.02 below)
        Verdict.OVER_BUDGET: Measured(a, 1, 0, 0.5, None, 0.5),
        Verdict.DISAGREES: Measured(a, 1, 0, 0.5),
        Verdict.OUTPACED: Measured(a, 1, 0, 0.0),
        Verdict.WITHIN_MARGIN: Measured(a, 100, 0, 0.0),
    }
    assert {v for v, _, _ in VERDICT_RULES} == set(cases)
    for verdict, candidate in cases.items():
        judged, _ = verdicts([base, candidate, Measured(a, 99, 0, 0.0)], 0.02, 1e-3, 0.02)
        assert judged[1] is (Verdict.CHOSEN if verdict is Verdict.OUTPACED else verdict)


# -- sharing, autotune(), audit ------------------------------------------------------


class Blocks(torch.nn.Module):
    def __init__(self, n: int, **kwargs: object) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            _layer(*kwargs.pop("candidates", ("fake_fast",)), name=f"blocks.{i}.attn1", **kwargs)  # type: ignore[arg-type]
            for i in range(n)
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            q = block(q, k, v)
        return q


def test_layers_of_one_shape_share_one_measurement() -> None:
    set_selection_config(_config())
    model = Blocks(48)
    model(*_qkv())
    # one measurement (warm-up 1 + 3 repeats per candidate); each layer's first
    # forward itself ran the incumbent
    assert CALLS["fake_fast"] == 4
    assert CALLS["fake_incumbent"] == 48 + 4
    model(*_qkv())
    assert CALLS["fake_fast"] == 4 + 48 and CALLS["fake_incumbent"] == 52
    backends = {b.backend.name for b in model.blocks}  # type: ignore[union-attr]
    assert backends == {"fake_fast"}
    traces = [b.resolution.trace for b in model.blocks]  # type: ignore[union-attr]
    assert len({t.records for t in traces}) == 1  # identical evidence...
    assert len({t.input.layer.name for t in traces}) == 48  # ...for each named layer
    tuned = [d for d in attnres.decisions() if d.reason == "measured faster"]
    assert [d.layer for d in tuned] == [f"blocks.{i}.attn1" for i in range(48)]


def test_autotune_tunes_before_compile_and_reports() -> None:
    # the config does not ask for autotune: calling autotune() is the opt-in
    model = Blocks(4)
    with component_scope("dit", backend="fake_incumbent"):
        explicit = _layer("fake_fast", name="explicit")
    model.add_module("explicit", explicit)
    model.add_module("unused", _layer("fake_fast", name="unused"))
    q, k, v = _qkv()
    report = autotune(model, q, k, v, min_elements=0)
    assert (report.measured, report.loaded, report.reused) == (1, 0, 3)
    assert [d.layer for d in report.decisions] == [f"blocks.{i}.attn1" for i in range(4)]
    assert dict(report.untuned) == {
        "explicit": "origin component_override: only automatic decisions are tuned",
        "unused": "not called by the example inputs",
    }
    assert not any(is_armed(m) for m in model.modules() if isinstance(m, Attention))
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        autotune("model", q)  # type: ignore[arg-type]


def test_autotune_reports_small_calls() -> None:
    model = Blocks(1)
    report = autotune(model, *_qkv(), min_elements=10**6)
    assert report.decisions == ()
    assert report.untuned == (("blocks.0.attn1", "query of 256 elements < min_elements 1000000"),)


class _Gated(torch.nn.Module):
    """One layer whose forward first waits for the other thread's forward."""

    def __init__(self, name: str, gate: threading.Barrier) -> None:
        super().__init__()
        self.attn = _layer("fake_fast", name=name)
        self.gate = gate

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.gate.wait()  # both autotune() calls are collecting now
        return self.attn(q, k, v)  # type: ignore[no-any-return]


def test_concurrent_autotune_calls_keep_their_own_reports() -> None:
    # issue 33: autotune() collected into one process-wide stack, so the layer
    # events of two concurrent calls went to whichever call started last
    gate = threading.Barrier(2, timeout=30)
    models = {name: _Gated(name, gate) for name in ("one.attn", "two.attn")}
    reports: dict[str, object] = {}

    def tune(name: str) -> None:
        reports[name] = autotune(models[name], *_qkv(), min_elements=10**6)

    threads = [threading.Thread(target=tune, args=(name,)) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for name in models:
        report = reports[name]
        assert isinstance(report, attnres.autotuner.AutotuneReport)
        assert report.untuned == ((name, "query of 256 elements < min_elements 1000000"),)


def test_a_tuned_decision_is_in_the_audit_log() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    with capture_logs() as logs:
        layer(*_qkv())
    selected = [e for e in logs if e["event"] == "attention backend selected"]
    assert selected[-1]["backend"] == "fake_fast"
    assert selected[-1]["reason"] == "measured faster"
    kinds = {e.get("kind") for e in logs if e["event"] == "attention record"}
    assert {"tuning", "measurement"} <= kinds


def test_pickling_an_armed_layer_keeps_it_armed() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    clone = pickle.loads(pickle.dumps(layer))
    assert is_armed(clone)
    clone(*_qkv())
    assert clone.backend.name == "fake_fast"
    tuned = pickle.loads(pickle.dumps(clone))
    assert not is_armed(tuned) and tuned.backend.name == "fake_fast"


# -- replay ----------------------------------------------------------------------


def test_a_tuned_trace_round_trips_and_replays_without_a_device(tmp_path: Path) -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", "fake_wrong", "fake_raising", name="attn")
    layer(*_qkv())
    trace = layer.resolution.trace
    assert trace.schema_version == 4  # tuned (3), with the kernel facts of a layer (4)
    path = dump_trace(trace, tmp_path / "tuned.json")
    loaded = load_trace(path)
    assert loaded.records == trace.records and loaded.digest == trace.digest
    result = replay(path)
    assert result.ok, result.diff


def test_replay_rederives_the_verdicts_from_the_recorded_facts() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    layer(*_qkv())
    trace = layer.resolution.trace
    # tamper with a fact: the recorded win is now inside the margin
    records = tuple(
        MeasurementRecord(r.candidate, 995, r.spread_ns, r.deviation, r.error, r.verdict)
        if isinstance(r, MeasurementRecord) and r.candidate.name == "fake_fast"
        else r
        for r in trace.records
    )
    result = replay(Trace(trace.input, records, trace.outcome, 3))
    assert not result.ok
    assert "verdict" in result.diff and '"within_margin"' in result.diff
    assert "outcome: selected fake_fast (measured faster) -> selected fake_incumbent" in result.diff


def test_a_trace_older_than_version_3_cannot_hold_autotune_records() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    layer(*_qkv())
    doc = layer.resolution.trace.to_dict()
    doc["schema_version"] = 2
    doc["digest"] = Trace(
        layer.resolution.trace.input,
        layer.resolution.trace.records,
        layer.resolution.trace.outcome,
        2,
    ).digest
    expected = r"belongs to schema version 3 \(autotune\), but the file says version 2"
    with pytest.raises(TraceFormatError, match=expected):
        trace_from_json(json.dumps(doc))


def test_measurement_records_are_loaded_strictly() -> None:
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    layer(*_qkv())
    doc = layer.resolution.trace.to_dict()
    index = next(i for i, r in enumerate(doc["records"]) if r["kind"] == "measurement")
    doc["records"][index]["median_ns"] = "900"
    where = rf"records\[{index}\]\.median_ns"
    with pytest.raises(TraceFormatError, match=where + ": expected an integer"):
        trace_from_json(json.dumps(doc))
    doc["records"][index]["median_ns"] = 900
    doc["records"][index]["verdict"] = "fastest"
    with pytest.raises(TraceFormatError, match='unknown verdict "fastest"'):
        trace_from_json(json.dumps(doc))


# -- the real CPU candidates ---------------------------------------------------------


def test_real_cpu_candidates_are_measured_and_the_evidence_replays(tmp_path: Path) -> None:
    with use_timer(__import__("time").perf_counter_ns):
        set_selection_config(_config())
        layer = Attention(
            HEADS,
            SIZE,
            supported={"torch_sdpa", "eager", "flex_attention"},
            name="real",
            dtype=torch.float32,
        )
        assert layer.resolution.origin == "none" and is_armed(layer)
        q, k, v = _qkv((1, 64, HEADS, SIZE))
        out = layer(q, k, v)
    trace = layer.resolution.trace
    judged = _measurements(trace)
    assert list(judged) == ["torch_sdpa", "eager", "flex_attention"]
    for record in judged.values():
        assert record.error is None and record.median_ns is not None and record.median_ns > 0
        assert record.deviation is not None and record.deviation < 1e-4
        assert record.verdict in {
            Verdict.INCUMBENT,
            Verdict.CHOSEN,
            Verdict.OUTPACED,
            Verdict.WITHIN_MARGIN,
        }
    assert layer.backend.name in judged
    torch.testing.assert_close(layer(q, k, v), out, rtol=1e-5, atol=1e-5)
    result = replay(dump_trace(trace, tmp_path / "real.json"))
    assert result.ok, result.diff


# -- results files -----------------------------------------------------------------


def test_results_save_and_load_skip_the_measurement(tmp_path: Path) -> None:
    set_selection_config(_config())
    _layer("fake_fast", name="first")(*_qkv())
    path = save_results(tmp_path / "tune.json")
    clear_results()
    CALLS.clear()
    report = load_results(path)
    assert report.usable == 1 and report.ignored == ()
    layer = _layer("fake_fast", name="second")
    layer(*_qkv())
    assert CALLS == {"fake_incumbent": 1}  # the forward itself; nothing was timed
    tuning = next(r for r in layer.resolution.trace.records if isinstance(r, TuningRecord))
    assert (tuning.source, tuning.detail) == ("loaded", f"loaded from {path}")
    assert layer.backend.name == "fake_fast"
    assert replay(layer.resolution.trace).ok


def test_results_from_another_torch_version_are_ignored_with_a_reason(tmp_path: Path) -> None:
    set_selection_config(_config())
    _layer("fake_fast", name="first")(*_qkv())
    path = save_results(tmp_path / "tune.json")
    doc = json.loads(path.read_text())
    doc["entries"][0]["platform"]["torch_version"] = "1.0.0"
    path.write_text(json.dumps(doc))
    clear_results()
    CALLS.clear()
    report = load_results(path)
    assert report.usable == 0
    [(_call, why)] = report.ignored
    assert why.startswith('recorded with torch version "1.0.0", this process has')
    layer = _layer("fake_fast", name="second")
    layer(*_qkv())
    assert CALLS == {"fake_incumbent": 1 + 4, "fake_fast": 4}  # measured again
    tuning = next(r for r in layer.resolution.trace.records if isinstance(r, TuningRecord))
    assert tuning.source == "measured"
    assert f'ignored loaded results ({path}: recorded with torch version "1.0.0"' in tuning.detail


def test_results_files_never_clobber_and_are_bounded(tmp_path: Path) -> None:
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    with pytest.raises(ResultsFileError, match="not an attnres autotune results file"):
        save_results(notes)
    assert notes.read_text() == '{"mine": true}\n'
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:
        fh.truncate(5 << 20)
    with pytest.raises(ResultsFileError, match="over the 4 MiB limit for a results file"):
        load_results(huge)
    with pytest.raises(ResultsFileError, match="cannot read"):
        load_results(tmp_path / "missing.json")
    # a results file is merged, not replaced: another platform's entries stay
    set_selection_config(_config())
    _layer("fake_fast", name="first")(*_qkv())
    path = save_results(tmp_path / "tune.json")
    doc = json.loads(path.read_text())
    other = json.loads(json.dumps(doc["entries"][0]))
    other["platform"]["device_name"] = "another machine"
    doc["entries"].append(other)
    path.write_text(json.dumps(doc))
    save_results(path)
    assert len(json.loads(path.read_text())["entries"]) == 2


# -- the CLI -------------------------------------------------------------------------


def test_cli_autotune_flags_build_the_config() -> None:
    import argparse

    from attnres.cli import UsageError, add_selection_arguments, selection_config_from_args

    parser = argparse.ArgumentParser()
    add_selection_arguments(parser)
    config = selection_config_from_args(
        parser.parse_args(["--autotune", "--autotune-min-elements", "1024"])
    )
    assert (config.autotune, config.autotune_min_elements) == (True, 1024)
    assert selection_config_from_args(parser.parse_args([])).autotune is False
    with pytest.raises(UsageError, match="--autotune-min-elements needs --autotune"):
        selection_config_from_args(parser.parse_args(["--autotune-min-elements", "5"]))


def test_cli_explain_says_whether_autotune_would_measure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from attnres.cli import main

    base = ["explain", "--head-size", "64", "--dtype", "fp32", "--platform", "cpu", "--json"]
    assert main([*base, "--autotune"]) == 0
    plan = json.loads(capsys.readouterr().out)["autotune"]
    assert plan["tunable"] is True and "torch_sdpa stays unless" in plan["detail"]
    assert main([*base, "--autotune", "--attention-backend", "eager"]) == 0
    plan = json.loads(capsys.readouterr().out)["autotune"]
    assert plan == {
        "tunable": False,
        "detail": "not measured: origin global_cli is an explicit choice (only none, "
        "layer_default and global_preference are tuned)",
    }
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["autotune"] is None
    assert main([*base[:-1], "--autotune-min-elements", "5"]) == 2
    assert "--autotune-min-elements needs --autotune" in capsys.readouterr().err


def test_attnres_autotune_is_the_entry_point_and_import_attnres_stays_light() -> None:
    import subprocess
    import sys

    assert attnres.autotune is autotune
    code = (
        "import sys, attnres; assert 'torch' not in sys.modules; "
        "assert 'attnres.autotuner' not in sys.modules and 'attnres.tuning' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: "not json{", "not valid JSON"),
        (lambda d: {**d, "version": 9}, "autotune results version 9; this attnres reads version 1"),
        (lambda d: {**d, "entries": {}}, r"\$\.entries: expected a list"),
        (
            lambda d: {**d, "entries": [{**d["entries"][0], "warmup": "3"}]},
            r"\$\.entries\[0\]\.warmup: unexpected value '3'",
        ),
        (
            lambda d: {**d, "entries": [{**d["entries"][0], "incumbent": "os:system"}]},
            "Unknown attention backend",
        ),
    ],
)
def test_a_bad_results_file_is_an_error_that_names_it(
    tmp_path: Path, edit: Callable[[dict[str, object]], object], message: str
) -> None:
    set_selection_config(_config())
    _layer("fake_fast", name="first")(*_qkv())
    path = save_results(tmp_path / "tune.json")
    doc = edit(json.loads(path.read_text()))
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ResultsFileError, match=message) as info:
        load_results(path)
    assert str(path) in str(info.value)


def test_a_failure_of_the_tuner_itself_keeps_the_incumbent_and_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import attnres.autotuner as tuner

    def broken(*args: object) -> None:
        raise KeyError("a bug in the tuner")

    monkeypatch.setattr(tuner, "_measure_all", broken)
    set_selection_config(_config())
    layer = _layer("fake_fast", name="attn")
    q, k, v = _qkv()
    with capture_logs() as logs:
        out = layer(q, k, v)
    torch.testing.assert_close(out, _SDPA(q, k, v, None, False, None))
    assert not is_armed(layer) and layer.backend.name == "fake_incumbent"
    [warning] = [e for e in logs if e["event"] == "attention autotune failed"]
    assert warning["log_level"] == "warning"
    assert (warning["layer"], warning["backend"]) == ("attn", "fake_incumbent")
    assert warning["error"] == "KeyError: 'a bug in the tuner'"


def test_cli_plan_counts_the_layers_autotune_would_measure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from attnres.cli import main

    pipeline = str(Path(__file__).resolve().parent.parent / "examples" / "audio-video.toml")
    assert main(["plan", pipeline, "--platform", "cpu", "--autotune", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    flags = {(lay["origin"], lay["autotune"]) for c in doc["components"] for lay in c["layers"]}
    assert flags and all(
        tunable == (origin in {"none", "layer_default"}) for origin, tunable in flags
    )
    assert (
        main(
            [
                "plan",
                pipeline,
                "--platform",
                "cpu",
                "--autotune",
                "--attention-backend",
                "torch_sdpa",
            ]
        )
        == 0
    )
    text = " ".join(capsys.readouterr().out.split())
    assert "Autotune: 0 of 208 layers would be measured" in text
    assert main(["plan", pipeline, "--platform", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all("autotune" not in lay for c in doc["components"] for lay in c["layers"])


def test_results_for_other_candidates_are_ignored_with_a_reason(tmp_path: Path) -> None:
    set_selection_config(_config())
    _layer("fake_fast", name="first")(*_qkv())
    path = save_results(tmp_path / "tune.json")
    clear_results()
    assert load_results(path).usable == 1  # the platform matches...
    layer = _layer("fake_fast", "fake_faster", name="second")
    layer(*_qkv())  # ...but this layer has another candidate
    tuning = next(r for r in layer.resolution.trace.records if isinstance(r, TuningRecord))
    assert tuning.source == "measured"
    assert tuning.detail.endswith(
        f"ignored loaded results ({path}: measured candidates fake_fast, this decision's are "
        f"fake_fast, fake_faster)"
    )
    assert layer.backend.name == "fake_faster"


def test_candidates_run_with_the_layers_softcap_and_window() -> None:
    with use_timer(__import__("time").perf_counter_ns):
        set_selection_config(_config())
        layer = Attention(
            HEADS,
            SIZE,
            supported={"torch_sdpa", "eager", "flex_attention"},
            softcap=5.0,
            window=(2, 2),
            name="capped",
            dtype=torch.float32,
        )
        q, k, v = _qkv((1, 16, HEADS, SIZE))
        out = layer(q, k, v)
    tuning = next(r for r in layer.resolution.trace.records if isinstance(r, TuningRecord))
    assert tuning.call.endswith("softcap=5.0, window=(2, 2)")
    judged = _measurements(layer.resolution.trace)
    assert len(judged) >= 2
    # every candidate computed the same capped, windowed attention as the incumbent
    assert all(r.deviation is not None and r.deviation < 1e-4 for r in judged.values()), judged
    torch.testing.assert_close(layer(q, k, v), out, rtol=1e-5, atol=1e-5)


# -- one ledger entry per layer; loaded results outlive a registry change (issue 21) --


def _entries(name: str) -> list[attnres.Decision]:
    return [d for d in attnres.decisions() if d.layer == name]


def test_a_tuned_layer_has_one_ledger_entry_the_tuned_decision() -> None:
    attnres.clear_decisions()
    set_selection_config(_config())
    layer = _layer("fake_fast", "fake_faster", name="one.entry")
    layer(*_qkv())
    entries = _entries("one.entry")
    assert [(d.backend, d.reason) for d in entries] == [("fake_faster", "measured faster")]
    assert entries[0].trace is layer.resolution.trace


def test_a_cast_after_tuning_replaces_the_tuned_entry() -> None:
    attnres.clear_decisions()
    set_selection_config(_config())
    layer = _layer("fake_fast", "fake_faster", name="cast.after.tune")
    layer(*_qkv())
    layer.double()
    entries = _entries("cast.after.tune")
    assert len(entries) == 1
    assert entries[0].trace.input.layer.dtype == "float64"
    assert entries[0].trace is layer.resolution.trace


def test_loaded_results_survive_a_registry_change(tmp_path: Path) -> None:
    set_selection_config(_config())
    _layer("fake_fast", name="first")(*_qkv())
    path = save_results(tmp_path / "tune.json")
    clear_results()
    load_results(path)
    register_backend(
        BackendSpec(name="fake_unrelated", sparse=False, platforms=("cuda",), dtypes=("float16",))
    )
    unregister_backend("fake_unrelated")
    CALLS.clear()
    layer = _layer("fake_fast", name="second")
    layer(*_qkv())
    assert CALLS == {"fake_incumbent": 1}  # the loaded result decided; nothing was timed
    tuning = next(r for r in layer.resolution.trace.records if isinstance(r, TuningRecord))
    assert tuning.source == "loaded"


# -- issue 34: error against float64 beside the time, under a numeric budget ----------


def test_autotune_measures_error_against_float64_under_a_budget(tmp_path: Path) -> None:
    """Under ``--attention-error 1e-3`` each candidate's relative L2 error against a
    float64 reference is measured beside its time; one over the budget is
    ``over_budget`` (never chosen); results files keep the figure."""
    from attnres.autotuner import save_results
    from attnres.tuning import read_results

    set_selection_config(_config(attention_error={"*": 1e-3}))
    layer = _layer("fake_fast", "fake_wrong", name="blocks.0.attn1")
    layer(*_qkv())
    trace = layer.resolution.trace
    judged = _measurements(trace)
    assert judged["fake_wrong"].verdict is Verdict.OVER_BUDGET
    assert judged["fake_wrong"].rel_l2 is not None and judged["fake_wrong"].rel_l2 > 1e-3
    assert judged["fake_fast"].rel_l2 is not None and judged["fake_fast"].rel_l2 < 1e-5
    assert layer.backend.name == "fake_fast" and trace.schema_version == 6
    assert attnres.replay(trace).ok
    path = save_results(tmp_path / "results.json")
    (entry,) = read_results(path)
    figures = {m.candidate.name: m.rel_l2 for m in entry.measured}
    assert figures["fake_wrong"] == judged["fake_wrong"].rel_l2
    # without a budget: no figure is taken, the verdicts are as before
    clear_results()
    set_selection_config(_config())
    plain = _layer("fake_fast", "fake_wrong", name="blocks.1.attn1")
    plain(*_qkv())
    again = _measurements(plain.resolution.trace)
    assert again["fake_wrong"].verdict is Verdict.DISAGREES
    assert all(m.rel_l2 is None for m in again.values())
