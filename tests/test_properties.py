"""Property-based tests (Hypothesis) of the selection contract over the whole
input space (SPEC 7 "Reliability"): random platforms of every kind (with
broken, missing and unprobed packages), configs (explicit, implicit, forced,
per component), scopes of every kind (component and role overrides) and layers
(odd and huge head sizes, every dtype and alias, roles, supported sets,
defaults, requirements).

One invariant per test, so a failure names the rule it broke. ``make test``
runs the ``default`` profile (60 examples each); ``make test-deep`` the
``deep`` one. The strategies live in ``tests/strategies.py``.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import strategies as S
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import attnres
from attnres import (
    BackendNotAppliedError,
    LayerSpec,
    ResolutionError,
    Role,
    component_scope,
    resolve,
)
from attnres import machine as M
from attnres import runtime as R
from attnres._states import Check, Code, Origin, Reason, State
from attnres.backends import (
    Backend,
    BackendSpec,
    HeadSizeRule,
    lookup_spec,
    register_backend,
    unregister_backend,
)
from attnres.replayer import replay
from attnres.scope import current_scope
from attnres.trace import (
    CheckRecord,
    OriginRecord,
    RejectedRecord,
    SelectedRecord,
    Trace,
    TraceInput,
    dump_trace,
    load_trace,
)

TERMINAL = (SelectedRecord, RejectedRecord)


def _evaluated(trace: Trace) -> list[tuple[State, str]]:
    """(stage, candidate) of every candidate the machine checked, in order."""
    return [
        (r.stage, r.candidate.name)
        for r in trace.records
        if isinstance(r, CheckRecord) and r.check is Check.KNOWN
    ]


def _origin(trace: Trace) -> OriginRecord:
    first = trace.records[0]
    assert isinstance(first, OriginRecord)
    return first


# =============================================================================
# Terminal states
# =============================================================================


@given(S.inputs())
def test_every_resolution_ends_in_exactly_one_terminal_record(inp: TraceInput) -> None:
    trace = M.run_machine(inp)
    *body, last = trace.records
    assert isinstance(last, TERMINAL)
    assert not any(isinstance(r, TERMINAL) for r in body)
    assert trace.outcome.status in ("selected", "rejected")
    if trace.outcome.status == "selected":
        assert isinstance(last, SelectedRecord)
        assert trace.outcome.backend == last.backend
        assert trace.outcome.reason == last.reason
        assert trace.outcome.code is None and trace.outcome.error is None
    else:
        assert isinstance(last, RejectedRecord)
        assert trace.outcome.backend is None and trace.outcome.reason is None
        assert (trace.outcome.code, trace.outcome.error) == (last.code, last.error)
    assert trace.outcome.origin is last.origin is _origin(trace).origin


@given(S.inputs())
def test_resolve_raises_exactly_when_the_machine_rejects(inp: TraceInput) -> None:
    trace = M.run_machine(inp)
    try:
        resolution = (
            resolve(inp.layer, config=inp.config, platform=inp.platform, backend=inp.backend)
            if inp.scope is None
            else _resolve_in(inp)
        )
    except ResolutionError as exc:
        assert trace.outcome.status == "rejected"
        assert isinstance(exc, ValueError)
        assert str(exc) == trace.outcome.error
        assert exc.code == trace.outcome.code
        assert exc.trace == trace
    else:
        assert trace.outcome.status == "selected"
        assert resolution.backend == trace.outcome.backend
        assert resolution.reason == trace.outcome.reason
        assert resolution.origin == str(trace.outcome.origin)


def _resolve_in(inp: TraceInput) -> R.Resolution:
    """``resolve`` with ``inp.scope`` as the visible scope snapshot."""
    from attnres.scope import enter_scope, exit_scope

    if inp.scope is None:
        return resolve(inp.layer, config=inp.config, platform=inp.platform, backend=inp.backend)
    _, token = enter_scope(inp.scope)
    try:
        return resolve(inp.layer, config=inp.config, platform=inp.platform, backend=inp.backend)
    finally:
        exit_scope(token)


# =============================================================================
# SPEC 3.3: sparse never serves cross-attention
# =============================================================================


@given(S.inputs(), st.sampled_from(S.SPARSE_NAMES), st.booleans())
def test_a_sparse_backend_is_never_selected_for_cross_attention(
    inp: TraceInput, sparse: str, force: bool
) -> None:
    # cross-attention, and half of the time a sparse backend forced on it as well
    layer = attrs.evolve(inp.layer, role=Role.CROSS)
    inp = attrs.evolve(inp, layer=layer)
    if force:
        inp = S.with_forced(inp, sparse)
    trace = M.run_machine(inp)
    if trace.outcome.status == "selected":
        assert trace.outcome.backend is not None
        assert not trace.outcome.backend.is_sparse, trace.outcome
    # and no sparse candidate ever passed the role check on a cross layer
    for r in trace.records:
        if isinstance(r, CheckRecord) and r.check is Check.ROLE:
            spec = lookup_spec(r.candidate)
            assert spec is not None
            assert r.passed is (not spec.sparse)


# =============================================================================
# Strict origins
# =============================================================================


@given(S.inputs())
def test_a_strict_origin_never_ends_on_a_different_backend(inp: TraceInput) -> None:
    trace = M.run_machine(inp)
    origin = _origin(trace)
    note(f"origin={origin}")
    assert origin.strict is (
        origin.origin in M.STRICT_ORIGINS
        or trace.records[0].detail.startswith("--attention-backend set by the operator; strict")
    )
    if not origin.strict:
        return
    assert origin.backend is not None
    outcome = trace.outcome
    sparse_on_cross = (
        inp.layer.role is Role.CROSS
        and lookup_spec(origin.backend) is not None
        and origin.backend.is_sparse
    )
    if outcome.status == "selected" and outcome.backend != origin.backend:
        # the one exception (SPEC 3.3)
        assert sparse_on_cross
        assert outcome.reason == Reason.DENSE_CROSS_ATTENTION_FALLBACK.value
    if outcome.status == "selected" and outcome.backend == origin.backend:
        assert outcome.reason is None
        assert _evaluated(trace) == [(State.REQUESTED, origin.backend.name)]
    if outcome.status == "rejected" and not sparse_on_cross:
        # no fallback: only the requested backend was evaluated
        assert _evaluated(trace) == [(State.REQUESTED, origin.backend.name)]
        assert outcome.code != Code.NO_COMPATIBLE_BACKEND.value


# =============================================================================
# The chosen backend passes every check, again
# =============================================================================


@given(S.inputs())
def test_the_selected_backend_passes_every_check_when_checked_again(inp: TraceInput) -> None:
    trace = M.run_machine(inp)
    if trace.outcome.status != "selected":
        return
    backend = trace.outcome.backend
    assert backend is not None
    results = M.check_candidate(backend, inp.layer, inp.platform)
    assert tuple(c for c, _ in results) == M.CHECK_ORDER
    assert all(not failures for _, failures in results), results
    # and the trace recorded exactly those passing checks for it
    recorded = [
        (r.check, r.failures)
        for r in trace.records
        if isinstance(r, CheckRecord) and r.candidate == backend
    ]
    assert recorded == [(c, ()) for c in M.CHECK_ORDER]


# =============================================================================
# A rejection names a reason for every candidate it evaluated
# =============================================================================


@given(S.inputs())
def test_every_evaluated_candidate_that_lost_has_a_recorded_failure(inp: TraceInput) -> None:
    trace = M.run_machine(inp)
    chosen = trace.outcome.backend
    for _, name in _evaluated(trace):
        failed = [
            r
            for r in trace.records
            if isinstance(r, CheckRecord) and r.candidate.name == name and not r.passed
        ]
        if chosen is not None and name == chosen.name:
            assert not failed
            continue
        assert failed, f"candidate {name} lost without a failed check"
        for r in failed:
            assert r.failures and all(f.code in set(Code) and f.message for f in r.failures)


@given(S.inputs())
def test_a_rejection_message_names_every_candidate_and_why(inp: TraceInput) -> None:
    trace = M.run_machine(inp)
    outcome = trace.outcome
    if outcome.status != "rejected":
        return
    error = outcome.error
    assert error
    if inp.scope is not None:
        assert error.endswith(f" for component {inp.scope.component!r}")
    failures = {
        name: [
            (r.check, f)
            for r in trace.records
            if isinstance(r, CheckRecord) and r.candidate.name == name
            for f in r.failures
        ]
        for _, name in _evaluated(trace)
    }
    if outcome.code == Code.NO_COMPATIBLE_BACKEND.value:
        # exhausted: every candidate, its stage and every failure message
        assert error.startswith("No compatible attention backend is available: tried ")
        for stage, name in _evaluated(trace):
            assert f"{name} ({stage.value}): " in error
            for _, f in failures[name]:
                assert f.message in error
        return
    # strict: one candidate, named, with the code of its most fundamental failure
    ((_, name),) = _evaluated(trace)
    assert f"{name!r}" in error
    failed_checks = [c for c, _ in failures[name]]
    primary = M.primary_check(set(failed_checks), inp.layer, lookup_spec(Backend(name)))
    assert outcome.code == next(f.code for c, f in failures[name] if c is primary)
    wording = {
        Check.KNOWN: f"Unknown attention backend {name!r}",
        Check.SUPPORTED: f"Attention backend {name!r} is not supported by this attention "
        f"layer; supported backends: ",
        Check.ROLE: f"Sparse attention backend {name!r} cannot serve cross-attention",
        Check.REQUIREMENTS: f"Attention backend {name!r} does not implement ",
        Check.PLATFORM: f"Attention backend {name!r} cannot run this layer on ",
        Check.AVAILABLE: f"Attention backend {name!r} is not available: ",
    }[primary]
    assert error.startswith(wording), (wording, error)
    for check, f in failures[name]:
        if check is primary and check is Check.SUPPORTED:
            continue  # replaced by the searchable wording, which lists the set
        if check is Check.REQUIREMENTS:
            assert f.message.removeprefix("does not implement ") in error
        else:
            assert f.message in error, (check, f.message, error)


# =============================================================================
# Dump, load, replay
# =============================================================================


@given(S.inputs())
def test_dump_load_and_replay_reproduce_the_trace_exactly(inp: TraceInput) -> None:
    trace = M.run_machine(inp)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nested" / "trace.json"
        dump_trace(trace, path)
        first_bytes = path.read_bytes()
        loaded = load_trace(path)
        assert loaded.records == trace.records
        assert loaded.outcome == trace.outcome
        assert loaded.input == trace.input
        assert loaded.digest == trace.digest
        assert loaded == trace
        result = replay(path)
        assert result.ok, result.diff
        assert result.diff == ""
        assert result.replayed.digest == trace.digest
        # stable: writing the loaded trace again gives the same bytes
        dump_trace(loaded, path)
        assert path.read_bytes() == first_bytes
        assert sorted(p.name for p in path.parent.iterdir()) == ["trace.json"]
    # and the digest is a function of the input only
    assert M.run_machine(inp).digest == trace.digest


# =============================================================================
# The cache never changes an answer
# =============================================================================


def _answer(layer: LayerSpec, **kwargs: Any) -> tuple[str, Trace, Any]:
    try:
        res = resolve(layer, **kwargs)
    except ResolutionError as exc:
        return "rejected", exc.trace, (exc.code, str(exc))
    return "selected", res.trace, (res.backend, res.reason, res.origin, res.component, res.layer)


@given(
    st.lists(
        st.tuples(
            S.layers(), S.configs(), S.scope_args() | st.none(), S.platforms, S.maybe_backend(4)
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
)
def test_the_cache_never_changes_an_answer(cases: list[tuple[Any, ...]], order: list[int]) -> None:
    R.clear_cache()
    for index in [i % len(cases) for i in order] + list(range(len(cases))):
        layer, config, args, platform, backend = cases[index]
        # (a role override that ran on no layer raises on scope exit: tested in test_scope)
        with contextlib.suppress(BackendNotAppliedError), contextlib.ExitStack() as stack:
            scope = None
            if args is not None:
                scope = stack.enter_context(component_scope(**args)).state
                assert scope == S.scope_state_from_args(args)
            kwargs = {"config": config, "platform": platform, "backend": backend}
            cached_or_cold = _answer(layer, **kwargs)
            hit = _answer(layer, **kwargs)
            expected = M.run_machine(TraceInput(layer, config, scope, platform, backend))
            saved = dict(R._CACHE)
            R.clear_cache()
            cold = _answer(layer, **kwargs)
            R._CACHE.current().update(saved)  # a GenerationMemo (issue 33)
        for status, trace, fields in (cached_or_cold, hit, cold):
            assert status == expected.outcome.status
            assert trace == expected
            assert trace.digest == expected.digest
            assert fields == cold[2]


_CUSTOM = "prop_kernel"

custom_specs = st.builds(
    lambda sparse, kinds, dtypes, most: BackendSpec(
        name=_CUSTOM,
        sparse=sparse,
        platforms=kinds,
        dtypes=dtypes,
        head_sizes=HeadSizeRule(max=most),
    ),
    st.booleans(),
    st.sets(st.sampled_from(["cpu", "cuda", "rocm"]), min_size=1),
    st.sets(st.sampled_from(["float16", "float32"]), min_size=1),
    st.sampled_from([None, 64, 256]),
)
_custom_layers = st.builds(
    lambda head, dtype, role, where: LayerSpec(
        head,
        dtype,
        role=role,
        default=Backend(_CUSTOM) if where == "default" else None,
        supported={Backend(_CUSTOM), Backend("eager")} if where == "supported" else None,
    ),
    st.sampled_from([64, 128]),
    st.sampled_from(["float16", "float32"]),
    st.sampled_from([Role.SELF, Role.CROSS]),
    st.sampled_from(["default", "supported", "layer"]),
)


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("register"), custom_specs),
            st.tuples(st.just("unregister"), st.none()),
            st.tuples(st.just("resolve"), _custom_layers),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_the_cache_never_outlives_a_registry_change(ops: list[tuple[str, Any]]) -> None:
    """register_backend / unregister_backend between two resolutions of one layer:
    the second answer is the machine's answer for the registry as it is now."""
    platform = attnres.Platform.simulate("cpu")
    R.clear_cache()  # each example on its own (the bug needs no help from another one)
    registered = False
    try:
        for op, arg in ops:
            if op == "register":
                register_backend(arg, replace=True)
                registered = True
            elif op == "unregister" and registered:
                unregister_backend(_CUSTOM)
                registered = False
            elif op == "resolve":
                unnamed = arg.default is None and arg.supported is None
                backend = Backend(_CUSTOM) if unnamed else None
                for _ in range(2):  # cold (or cached from an earlier op), then a hit
                    status, trace, _ = _answer(arg, platform=platform, backend=backend)
                    expected = M.run_machine(
                        TraceInput(arg, R.selection_config(), None, platform, backend)
                    )
                    assert (status, trace) == (expected.outcome.status, expected)
    finally:
        if registered:
            unregister_backend(_CUSTOM)


# =============================================================================
# Stateful: nested component scopes, raising inside them
# =============================================================================


class _Boom(Exception):
    pass


class NestedScopes(RuleBasedStateMachine):
    """Enter and leave nested scopes (and forced backends); raise inside them.

    The visible scope is always the innermost open one; a body's exception
    always propagates unchanged; leaving restores the enclosing scope.
    """

    names = Bundle("names")

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, Any, Any]] = []  # (what, context manager, entered value)

    @rule(target=names, name=st.sampled_from(S.COMPONENT_NAMES))
    def name(self, name: str) -> str:
        return name

    def _scopes(self) -> list[Any]:
        return [value for what, _, value in self.stack if what == "scope"]

    def _forced(self) -> list[Any]:
        return [value for what, _, value in self.stack if what == "forced"]

    @rule(
        name=names,
        backend=st.sampled_from([None, "torch_sdpa", "eager"]),
        cross=st.sampled_from([None, "torch_sdpa", "eager"]),
    )
    def enter_scope(self, name: str, backend: str | None, cross: str | None) -> None:
        cm = component_scope(
            name,
            backend=backend,
            role_backends=None if cross is None else {"cross": cross},
            require_selection=False,
        )
        handle = cm.__enter__()
        assert handle.state.component == name
        self.stack.append(("scope", cm, handle))

    @precondition(lambda self: len(self.stack) < 12)
    @rule(backend=st.sampled_from(["torch_sdpa", "eager"]))
    def enter_forced(self, backend: str) -> None:
        cm = R.force_backend(backend)
        self.stack.append(("forced", cm, cm.__enter__()))

    @precondition(lambda self: bool(self.stack))
    @rule()
    def leave(self) -> None:
        _, cm, _ = self.stack.pop()
        # (a role override that ran on no layer raises on exit: tested in test_scope)
        with contextlib.suppress(BackendNotAppliedError):
            assert cm.__exit__(None, None, None) in (None, False)

    @precondition(lambda self: bool(self.stack))
    @rule(exc_type=st.sampled_from([_Boom, ValueError, KeyboardInterrupt]))
    def raise_inside(self, exc_type: type[BaseException]) -> None:
        _, cm, _ = self.stack.pop()
        exc = exc_type("raised in the body")
        try:
            raise exc
        except BaseException as raised:
            try:
                suppressed = cm.__exit__(type(raised), raised, raised.__traceback__)
            except BaseException as out:  # the body's exception, re-raised unchanged
                assert out is exc
            else:
                assert not suppressed  # never swallowed

    @precondition(lambda self: bool(self._scopes()) and not self._forced())
    @rule(role=st.sampled_from([Role.SELF, Role.CROSS]))
    def resolve_here(self, role: Role) -> None:
        handle = self._scopes()[-1]
        before = len(handle.decisions)
        res = resolve(
            LayerSpec(64, "float32", role=role, name="probe"),
            platform=attnres.Platform.simulate("cpu"),
        )
        state = handle.state
        assert res.component == state.component
        expected = state.role_backend(role) or state.backend
        if expected is not None:
            assert res.backend == expected
        assert len(handle.decisions) == before + 1
        assert handle.decisions[-1].component == state.component

    @precondition(lambda self: bool(self.stack))
    @rule()
    def another_thread_sees_nothing(self) -> None:
        seen: list[Any] = []
        t = threading.Thread(target=lambda: seen.append((current_scope(), R._FORCED.get())))
        t.start()
        t.join()
        assert seen == [(None, None)]

    @invariant()
    def visible_scope_is_the_innermost_open_one(self) -> None:
        scopes = self._scopes()
        expected = scopes[-1].state if scopes else None
        assert current_scope() is expected
        forced = self._forced()
        assert R._FORCED.get() == (forced[-1] if forced else None)

    def teardown(self) -> None:
        while self.stack:
            with contextlib.suppress(BackendNotAppliedError):
                self.stack.pop()[1].__exit__(None, None, None)
        assert current_scope() is None
        assert R._FORCED.get() is None


TestNestedScopes = NestedScopes.TestCase


@pytest.fixture(autouse=True)
def _no_scope_leaks() -> Iterator[None]:
    assert current_scope() is None
    yield
    assert current_scope() is None
    assert R._FORCED.get() is None


def test_origin_vocabulary_matches_the_strict_set() -> None:
    """Sanity for the strictness property above: strict origins are exactly SPEC 3.1's."""
    assert {
        Origin.REQUEST,
        Origin.LAYER,
        Origin.FORCED,
        Origin.ROLE_OVERRIDE,
        Origin.COMPONENT_OVERRIDE,
    } == set(M.STRICT_ORIGINS)
