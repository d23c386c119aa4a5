"""Component scopes (SPEC 3.6): isolation across threads and tasks, reset on exit,
nesting, BackendNotAppliedError and the per-component summary line."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

import attnres
from attnres import (
    BackendNotAppliedError,
    LayerSpec,
    Platform,
    ResolutionError,
    SelectionConfig,
    UnknownBackendError,
    component_scope,
    force_backend,
    resolve,
)
from attnres.scope import ScopeHandle, ScopeState, current_scope

CPU = Platform.simulate("cpu")
CUDA_SAGE = Platform.simulate("cuda:sm90+flash_attn+sageattention")
CUDA_ALL = Platform.simulate("cuda:sm90+all")
SAGE = SelectionConfig(global_backend="sage_attn")
FA_SDPA_DEFAULT = LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}, default="torch_sdpa")
CROSS_128 = LayerSpec(128, "bf16", role="cross")


@pytest.fixture
def fresh_structlog() -> Iterator[None]:
    """capture_logs() leaves structlog 'configured': put the defaults back."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


# -- basics --------------------------------------------------------------------


def test_scope_is_visible_inside_and_reset_after() -> None:
    assert current_scope() is None
    with component_scope("audio_vae") as handle:
        assert isinstance(handle, ScopeHandle)
        state = current_scope()
        assert state is handle.state
        assert isinstance(state, ScopeState)
        assert (state.component, state.kind, state.loader) == (
            "audio_vae",
            "audio_vae",
            "AudioVAELoader",
        )
        assert state.allow_global_fallback is True
        assert state.require_selection is False
    assert current_scope() is None


def test_scope_kind_keyword_overrides_the_name() -> None:
    with component_scope("main_model", kind="transformer") as handle:
        assert handle.state.kind == "transformer"
        assert handle.state.allow_global_fallback is False


def test_scope_require_selection_defaults_on_for_explicit_overrides() -> None:
    with component_scope("vae", backend="torch_sdpa", require_selection=False) as h:
        assert h.state.require_selection is False
    with component_scope("vae") as h:
        assert h.state.require_selection is False
    with pytest.raises(BackendNotAppliedError), component_scope("vae", backend="sdpa") as h:
        assert h.state.require_selection is True
        assert h.state.backend is not None and h.state.backend.name == "torch_sdpa"


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_scope_name_must_be_a_non_empty_string(name: object) -> None:
    with (
        pytest.raises(ValueError, match="name must be a non-empty string"),
        component_scope(
            name  # type: ignore[arg-type]
        ),
    ):
        pass


def test_scope_validates_backends() -> None:
    with (
        pytest.raises(UnknownBackendError, match=r"^backend: "),
        component_scope("vae", backend="sdpaaa_q"),
    ):
        pass
    with (
        pytest.raises(UnknownBackendError, match=r"role_backends\['cross'\]"),
        component_scope("vae", role_backends={"cross": "nope_q"}),
    ):
        pass
    with (
        pytest.raises(ValueError, match="role must be 'self' or 'cross'"),
        component_scope("vae", role_backends={"both": "fa"}),
    ):
        pass
    with (
        pytest.raises(ValueError, match="must not be None"),
        component_scope(
            "vae",
            role_backends={"cross": None},  # type: ignore[dict-item]
        ),
    ):
        pass
    assert current_scope() is None


def test_scope_records_its_decisions() -> None:
    with component_scope("vae") as handle:
        a = resolve(LayerSpec(64, "fp32", name="a"), platform=CPU)
        b = resolve(LayerSpec(64, "fp32", name="b"), platform=CPU)
    assert [d.layer for d in handle.decisions] == ["a", "b"]
    assert [d.component for d in handle.decisions] == ["vae", "vae"]
    assert (a.component, b.component) == ("vae", "vae")


# -- exceptions and nesting -------------------------------------------------------


def test_rule_3_6_reset_on_exit_when_the_body_raised_and_the_exception_is_unchanged() -> None:
    boom = RuntimeError("boom")
    with pytest.raises(RuntimeError) as info, component_scope("vae"):
        assert current_scope() is not None
        raise boom
    assert info.value is boom
    assert current_scope() is None


def test_rule_3_6_body_exception_wins_over_not_applied() -> None:
    boom = KeyError("boom")
    with pytest.raises(KeyError) as info, component_scope("vae", backend="fa"):
        raise boom
    assert info.value is boom
    assert current_scope() is None


def test_scope_resolution_error_in_body_propagates_unchanged() -> None:
    with pytest.raises(ResolutionError) as info, component_scope("vae", backend="fa"):
        try:
            resolve(LayerSpec(64, "fp32"), platform=CPU)
        except ResolutionError as exc:
            caught = exc
            raise
    assert info.value is caught
    assert current_scope() is None


def test_rule_3_6_nested_innermost_is_visible_and_outer_restored() -> None:
    with component_scope("transformer") as outer:
        with component_scope("text_encoder") as inner:
            assert current_scope() is inner.state
            r_inner = resolve(LayerSpec(64, "fp32", name="x"), platform=CPU)
        assert current_scope() is outer.state
        r_outer = resolve(LayerSpec(64, "fp32", name="x"), platform=CPU)
    assert current_scope() is None
    assert (r_inner.component, r_outer.component) == ("text_encoder", "transformer")
    assert [d.component for d in inner.decisions] == ["text_encoder"]
    assert [d.component for d in outer.decisions] == ["transformer"]


def test_scope_nested_outer_restored_after_inner_raised() -> None:
    with component_scope("transformer") as outer:
        with pytest.raises(ValueError), component_scope("vae"):
            raise ValueError("inner")
        assert current_scope() is outer.state
    assert current_scope() is None


# -- threads and tasks ---------------------------------------------------------------


def test_rule_3_6_isolated_across_16_threads() -> None:
    n = 16
    barrier = threading.Barrier(n + 1)
    errors: list[BaseException] = []
    seen: dict[int, tuple[str | None, list[str | None], list[str | None]]] = {}

    def work(i: int) -> None:
        try:
            name = f"text_encoder_{i}"
            with component_scope(name) as handle:
                barrier.wait(timeout=30)  # every thread is inside its own scope now
                comps = []
                for j in range(20):
                    state = current_scope()
                    assert state is not None and state.component == name
                    res = resolve(LayerSpec(64, "fp32", name=f"l{j}"), platform=CPU)
                    comps.append(res.component)
                barrier.wait(timeout=30)
                seen[i] = (
                    current_scope().component,  # type: ignore[union-attr]
                    comps,
                    [d.component for d in handle.decisions],
                )
            assert current_scope() is None
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait(timeout=30)
    assert current_scope() is None  # the main thread sees none of them
    barrier.wait(timeout=30)
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    for i in range(n):
        name = f"text_encoder_{i}"
        assert seen[i] == (name, [name] * 20, [name] * 20)
    by_component: dict[str | None, int] = {}
    for d in attnres.decisions():
        by_component[d.component] = by_component.get(d.component, 0) + 1
    assert by_component == {f"text_encoder_{i}": 20 for i in range(n)}


def test_rule_3_6_isolated_across_asyncio_tasks() -> None:
    n = 16

    async def task(i: int) -> tuple[str, list[str | None], list[str | None]]:
        name = f"vae_{i}"
        comps: list[str | None] = []
        with component_scope(name) as handle:
            for j in range(5):
                await asyncio.sleep(0)  # let every other task run in between
                state = current_scope()
                assert state is not None and state.component == name
                comps.append(resolve(LayerSpec(64, "fp32", name=f"l{j}"), platform=CPU).component)
        outer = current_scope()  # the parent's scope, inherited by the task, is back
        assert outer is not None and outer.component == "transformer"
        return name, comps, [d.component for d in handle.decisions]

    async def main() -> list[tuple[str, list[str | None], list[str | None]]]:
        with component_scope("transformer"):
            results = await asyncio.gather(*(task(i) for i in range(n)))
            # the tasks' scopes never leaked into the parent
            assert current_scope() is not None
            assert current_scope().component == "transformer"  # type: ignore[union-attr]
        return results

    results = asyncio.run(main())
    assert current_scope() is None
    for name, comps, decided in results:
        assert comps == [name] * 5
        assert decided == [name] * 5


# -- BackendNotAppliedError ---------------------------------------------------------


def test_rule_3_6_not_applied_component_backend_with_no_layers_built() -> None:
    with pytest.raises(BackendNotAppliedError) as info, component_scope("vae", backend="fa"):
        pass
    assert isinstance(info.value, ValueError)
    text = str(info.value)
    assert "backend 'fa' was requested for component 'vae'" in text
    assert "built no attnres attention layer" in text
    assert "require_selection=False" in text
    assert current_scope() is None


def test_rule_3_6_not_applied_when_every_layer_had_a_layer_level_backend() -> None:
    with pytest.raises(BackendNotAppliedError) as info, component_scope("vae", backend="eager"):
        for i in range(2):
            res = resolve(LayerSpec(64, "fp32", name=f"l{i}"), platform=CPU, backend="torch_sdpa")
            assert res.origin == "layer"
    assert "ran on none of its 2 layer(s)" in str(info.value)
    assert "origin layer" in str(info.value)


def test_not_applied_when_a_forced_backend_decided_every_layer() -> None:
    with (
        pytest.raises(BackendNotAppliedError, match="origin forced"),
        force_backend("torch_sdpa"),
        component_scope("vae", backend="eager"),
    ):
        resolve(LayerSpec(64, "fp32"), platform=CPU)


def test_rule_3_6_not_applied_role_override_whose_role_built_no_layer() -> None:
    with (
        pytest.raises(BackendNotAppliedError) as info,
        component_scope("transformer", role_backends={"cross": "torch_sdpa"}),
    ):
        resolve(LayerSpec(64, "fp32", role="self"), platform=CPU)
    text = str(info.value)
    assert "backend 'torch_sdpa' was requested for the cross-attention layers" in text
    assert "'transformer'" in text


def test_rule_3_6_not_applied_names_both_problems() -> None:
    with (
        pytest.raises(BackendNotAppliedError) as info,
        component_scope("transformer", backend="eager", role_backends={"cross": "torch_sdpa"}),
    ):
        pass
    text = str(info.value)
    assert "backend 'eager' was requested for component 'transformer'" in text
    assert "cross-attention layers" in text


def test_rule_3_6_applied_component_and_role_backends_do_not_raise() -> None:
    with component_scope(
        "transformer", backend="eager", role_backends={"cross": "torch_sdpa"}
    ) as handle:
        resolve(LayerSpec(64, "fp32", role="self"), platform=CPU)
        resolve(LayerSpec(64, "fp32", role="cross"), platform=CPU)
    assert [d.origin for d in handle.decisions] == ["component_override", "role_override"]


def test_rule_overrides_explain_every_layer_one_unexplained_layer_raises() -> None:
    # v2: some layers running the override is not enough; every other layer needs a reason
    with (
        pytest.raises(BackendNotAppliedError) as info,
        component_scope("vae", backend="eager") as handle,
    ):
        resolve(LayerSpec(64, "fp32", name="a"), platform=CPU, backend="torch_sdpa")
        resolve(LayerSpec(64, "fp32", name="b"), platform=CPU)
    assert [d.backend for d in handle.decisions] == ["torch_sdpa", "eager"]
    assert "1 layer(s) chose another backend without a recorded reason" in str(info.value)
    assert "a runs torch_sdpa (origin layer)" in str(info.value)


def test_rule_overrides_explain_every_layer_a_recorded_reason_explains_a_layer() -> None:
    with component_scope("transformer", backend="sliding_tile_attn") as handle:
        resolve(LayerSpec(128, "bf16", name="self"), platform=CUDA_ALL)
        res = resolve(CROSS_128, platform=CUDA_ALL)
    assert (res.backend.name, res.reason) == ("fa3", "dense cross-attention fallback")
    assert [d.backend for d in handle.decisions] == ["sliding_tile_attn", "fa3"]


def test_rule_overrides_explain_every_layer_an_override_that_ran_nowhere_raises() -> None:
    # every layer recorded a reason, but the operator's backend never ran
    with (
        pytest.raises(BackendNotAppliedError) as info,
        component_scope("transformer", backend="sliding_tile_attn") as handle,
    ):
        res = resolve(CROSS_128, platform=CUDA_ALL)
    assert (res.backend.name, res.reason) == ("fa3", "dense cross-attention fallback")
    assert handle.decisions[0].origin == "component_override"
    assert "it ran on none of its 1 layer(s)" in str(info.value)
    assert "recorded reasons: dense cross-attention fallback" in str(info.value)


def test_rule_overrides_explain_every_layer_role_overrides_count_as_explained() -> None:
    # 0.1.0 raised "controlled none of its 1 layer(s)" here
    with component_scope(
        "transformer", backend="eager", role_backends={"self": "torch_sdpa"}
    ) as handle:
        res = resolve(LayerSpec(64, "fp32", name="attn1"), platform=CPU)
    assert (res.backend.name, res.origin) == ("torch_sdpa", "role_override")
    assert len(handle.decisions) == 1


def test_rule_overrides_explain_every_layer_role_overrides_checked_without_require_selection() -> (
    None
):
    with (
        pytest.raises(BackendNotAppliedError) as info,
        component_scope("vae", role_backends={"cross": "eager"}, require_selection=False),
    ):
        resolve(LayerSpec(64, "fp32", name="self"), platform=CPU)
    assert "no cross-attention layer that used it" in str(info.value)


def test_rule_overrides_explain_every_layer_a_role_override_that_ran_nowhere_raises() -> None:
    found = []
    with (
        pytest.raises(BackendNotAppliedError) as info,
        component_scope("transformer", role_backends={"cross": "video_sparse_attn"}),
    ):
        found.append(resolve(CROSS_128, platform=CUDA_ALL))
    assert (found[0].origin, found[0].reason) == ("role_override", "dense cross-attention fallback")
    assert "it ran on none of its 1 cross-attention layer(s)" in str(info.value)
    assert "recorded reasons: dense cross-attention fallback" in str(info.value)


def test_rule_3_6_not_raised_with_require_selection_false() -> None:
    with component_scope("vae", backend="fa", require_selection=False):
        pass
    with component_scope("vae", backend="eager", require_selection=False):
        resolve(LayerSpec(64, "fp32"), platform=CPU, backend="torch_sdpa")


def test_rule_3_6_not_raised_when_the_body_raised() -> None:
    boom = RuntimeError("from the body")
    with (
        pytest.raises(RuntimeError) as info,
        component_scope("vae", backend="fa", role_backends={"cross": "eager"}),
    ):
        raise boom
    assert info.value is boom


def test_require_selection_without_an_explicit_backend_checks_nothing() -> None:
    with component_scope("vae", require_selection=True):
        pass


# -- the summary line ----------------------------------------------------------------


def _summaries(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in logs if e.get("summary")]


@pytest.mark.usefixtures("fresh_structlog")
def test_rule_3_6_summary_line_per_component_on_exit() -> None:
    with capture_logs() as logs, component_scope("audio_vae"):
        resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    summaries = _summaries(logs)
    assert len(summaries) == 1
    assert summaries[0]["event"] == (
        "Attention backends for audio_vae: torch_sdpa (global backend fallback)"
    )
    assert summaries[0]["log_level"] == "info"
    assert summaries[0]["component"] == "audio_vae"


@pytest.mark.usefixtures("fresh_structlog")
def test_rule_3_6_summary_line_counts_and_mixes() -> None:
    with capture_logs() as logs, component_scope("transformer"):
        resolve(LayerSpec(64, "fp32", name="a"), platform=CPU)
        resolve(LayerSpec(64, "fp32", name="b"), platform=CPU)
        resolve(LayerSpec(64, "fp32", name="c"), platform=CPU, backend="eager")
    (summary,) = _summaries(logs)
    assert summary["event"] == "Attention backends for transformer: torch_sdpa x2, eager"


@pytest.mark.usefixtures("fresh_structlog")
def test_summary_line_per_nested_component_and_when_the_body_raised() -> None:
    with capture_logs() as logs:
        with component_scope("transformer"):
            with component_scope("text_encoder"):
                resolve(LayerSpec(64, "fp32"), platform=CPU)
            resolve(LayerSpec(64, "fp32", name="x"), platform=CPU, backend="eager")
        with pytest.raises(RuntimeError), component_scope("vae"):
            raise RuntimeError("x")
        with pytest.raises(BackendNotAppliedError), component_scope("vocoder", backend="fa"):
            pass
    assert [e["event"] for e in _summaries(logs)] == [
        "Attention backends for text_encoder: torch_sdpa",
        "Attention backends for transformer: eager",
        "Attention backends for vae: no attention layers",
        "Attention backends for vocoder: no attention layers",
    ]


@pytest.mark.usefixtures("fresh_structlog")
def test_summary_line_through_stdlib_logging_when_structlog_is_not_configured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="attnres"), component_scope("audio_vae"):
        resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    lines = [r.getMessage() for r in caplog.records if r.name == "attnres"]
    assert any(
        "Attention backends for audio_vae: torch_sdpa (global backend fallback)" in line
        for line in lines
    ), lines


@pytest.mark.parametrize("flag", ["allow_global_fallback", "require_selection"])
def test_scope_flags_are_strict(flag: str) -> None:
    with (
        pytest.raises(ValueError, match=rf"^{flag}: expected True, False or None, got 'no'"),
        component_scope("vae", **{flag: "no"}),
    ):
        pass


# -- the scope checks are the machine's, each problem with its code (issue 21) --


def test_rule_3_6_each_problem_carries_its_scope_code() -> None:
    from attnres._states import ScopeCode
    from attnres.machine import SCOPE_CHECKS

    assert {code for code, _, _ in SCOPE_CHECKS} == set(ScopeCode)
    with (
        pytest.raises(BackendNotAppliedError) as info,
        component_scope("transformer", backend="eager", role_backends={"cross": "eager"}),
    ):
        pass
    assert [p.code for p in info.value.problems] == [
        ScopeCode.NO_LAYER,
        ScopeCode.ROLE_NO_LAYER,
    ]
    assert all(p.message in str(info.value) for p in info.value.problems)
