"""Per-step schedules, ``attnres.schedule(module, {first_step: backend})`` (issue 23)."""

from __future__ import annotations

import pytest
import structlog
import torch
from structlog.testing import capture_logs
from torch import nn

import attnres
from attnres import Attention, RequestBackendError

CPU = attnres.Platform.simulate("cpu")


class Denoiser(nn.Module):
    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Attention(4, 16, platform=CPU, name=f"blocks.{i}.attn1", **kwargs)  # type: ignore[arg-type]
            for i in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, x, x)
        return x


def _backends(model: Denoiser) -> set[str]:
    return {layer.backend.name for layer in model.blocks}  # type: ignore[union-attr]


def test_rule_schedule_switches_per_step_and_restores() -> None:
    model = Denoiser()
    attnres.bind(model)
    x = torch.randn(1, 5, 4, 16)
    seen = []
    with attnres.schedule(model, {0: "eager", 2: "torch_sdpa"}) as stepper:
        for step in range(4):
            stepper.step(step)
            seen.append(_backends(model))
            model(x)
    assert seen == [{"eager"}, {"eager"}, {"torch_sdpa"}, {"torch_sdpa"}]
    assert stepper.switches == 2  # step 0 and step 2, not every step
    assert _backends(model) == {"torch_sdpa"}


def test_rule_schedule_is_prepared_in_two_phases_all_or_nothing() -> None:
    model = Denoiser()
    model.blocks[1] = Attention(4, 16, platform=CPU, name="pinned", supported={"torch_sdpa"})
    attnres.bind(model)
    with (
        pytest.raises(RequestBackendError, match="no layer was switched"),
        attnres.schedule(model, {0: "torch_sdpa", 3: "eager"}),
    ):
        pytest.fail("the block must not run")
    assert _backends(model) == {"torch_sdpa"}


def test_rule_schedule_keeps_required_backends() -> None:
    model = Denoiser()
    model.blocks[0] = Attention(4, 16, platform=CPU, name="pinned", required="torch_sdpa")
    attnres.bind(model)
    with attnres.schedule(model, {0: "eager"}) as stepper:
        stepper.step(0)
        assert model.blocks[0].backend.name == "torch_sdpa"  # type: ignore[union-attr]
        assert model.blocks[1].backend.name == "eager"  # type: ignore[union-attr]
    pinned = [row for row in stepper.record.layers if row[0] == "blocks.0"]
    assert pinned == [("blocks.0", "eager", "torch_sdpa", pinned[0][3])]


def test_rule_schedule_has_one_record_with_every_layer_and_step_backend() -> None:
    model = Denoiser()
    attnres.bind(model)
    with attnres.schedule(model, {10: "torch_sdpa", 0: "eager"}) as stepper:
        pass
    record = stepper.record
    assert [(first, b.name) for first, b in record.steps] == [(0, "eager"), (10, "torch_sdpa")]
    assert {(row[0], row[1]) for row in record.layers} == {
        (f"blocks.{i}", b) for i in range(3) for b in ("eager", "torch_sdpa")
    }
    assert all(len(row[3]) == 64 for row in record.layers)  # trace digests


def test_rule_schedule_emits_an_audit_event_per_switch() -> None:
    # structlog's own capture: order-independent (an earlier test may have configured
    # structlog, and then nothing reaches the stdlib logger that caplog reads)
    model = Denoiser()
    attnres.bind(model)
    try:
        with (
            capture_logs() as logs,
            attnres.schedule(model, {0: "eager", 1: "torch_sdpa"}) as stepper,
        ):
            for step in range(3):
                stepper.step(step)
    finally:
        structlog.reset_defaults()
    switches = [e for e in logs if e["event"] == "attention backend switched for step"]
    assert [(e["step"], e["backend"]) for e in switches] == [(0, "eager"), (1, "torch_sdpa")]


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ({}, "non-empty mapping"),
        ({1: "eager"}, "what runs from step 0"),
        ({0: "eagr"}, "eager"),
        ({-1: "eager"}, "integer >= 0"),
    ],
)
def test_rule_schedule_validates_its_steps(steps: dict[int, str], message: str) -> None:
    model = Denoiser()
    with pytest.raises(ValueError, match=message), attnres.schedule(model, steps):
        pass


def test_rule_schedule_cli_flag_shows_each_steps_backend(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from attnres import cli

    args = ["explain", "--head-size", "128", "--dtype", "bf16", "--supported", "fa,torch_sdpa"]
    args += ["--platform", "cuda:sm90+flash_attn", "--json"]
    assert cli.main([*args, "--schedule", "0:fa,40:torch_sdpa"]) == 0
    rows = json.loads(capsys.readouterr().out)["schedule"]
    assert [(r["from_step"], r["requested"], r["backend"]) for r in rows] == [
        (0, "fa", "fa"),
        (40, "torch_sdpa", "torch_sdpa"),
    ]
    # a step the layer cannot run: the schedule would refuse to start, so exit 1
    assert cli.main([*args, "--schedule", "0:fa,40:sage_attn"]) == 1
    rows = json.loads(capsys.readouterr().out)["schedule"]
    assert rows[1]["code"] == "not_in_supported_set"


def test_rule_schedule_cli_flag_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    from attnres import cli

    base = ["explain", "--head-size", "128", "--dtype", "bf16", "--platform", "cpu"]
    assert cli.main([*base, "--schedule", "5:eager"]) == 2
    assert "what runs from step 0" in capsys.readouterr().err
    assert cli.main([*base, "--schedule", "0:eagr"]) == 2
    assert "eager" in capsys.readouterr().err


def test_schedule_stepper_used_after_its_block_exits_is_refused() -> None:
    """Issue 32 item 3: a stepper kept past its block switched every layer for good
    while attnres.decisions() still recorded the original backend."""
    from attnres.errors import InvalidStateError

    model = Denoiser()
    attnres.bind(model)
    with attnres.schedule(model, {0: "eager", 2: "torch_sdpa"}) as stepper:
        stepper.step(0)
    assert _backends(model) == {"torch_sdpa"}
    for step in (2, 0, 7):  # the step's backend differs, equals the last one, or is later
        with pytest.raises(InvalidStateError, match=r"after the schedule's with block exited"):
            stepper.step(step)
        assert _backends(model) == {"torch_sdpa"}
    assert issubclass(InvalidStateError, RuntimeError)


def test_schedule_stepper_after_an_error_exit_is_refused_too() -> None:
    from attnres.errors import InvalidStateError

    model = Denoiser()
    attnres.bind(model)
    with pytest.raises(KeyError), attnres.schedule(model, {0: "eager"}) as stepper:
        raise KeyError("the sampler failed")
    with pytest.raises(InvalidStateError):
        stepper.step(0)
    assert _backends(model) == {"torch_sdpa"}


def test_schedule_refuses_a_compiled_module_as_request_backend_does() -> None:
    """Issue 32 item 3: one two-phase switch, the same refusals as request_backend."""
    from attnres.errors import CompiledGraphError

    model = Denoiser()
    attnres.bind(model)
    compiled = torch.compile(model, backend="eager")
    for enter in (
        lambda m: attnres.schedule(m, {0: "eager"}),
        lambda m: attnres.request_backend(m, "eager"),
    ):
        with pytest.raises(CompiledGraphError, match=r"torch\.compile wrapper"), enter(compiled):
            pytest.fail("the block must not run")
    model.blocks[1].compile(backend="eager")
    with (
        pytest.raises(CompiledGraphError, match=r"'blocks\.1' was compiled with Module\.compile"),
        attnres.schedule(model, {0: "eager", 1: "torch_sdpa"}),
    ):
        pytest.fail("the block must not run")
    torch._dynamo.reset()
    assert _backends(model) == {"torch_sdpa"}


def test_schedule_refuses_cuda_graph_capture_as_request_backend_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from attnres.errors import CompiledGraphError

    model = Denoiser()
    attnres.bind(model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for enter in (
        lambda: attnres.schedule(model, {0: "eager"}),
        lambda: attnres.request_backend(model, "eager"),
    ):
        with pytest.raises(CompiledGraphError, match="during CUDA graph capture"), enter():
            pytest.fail("the block must not run")
    monkeypatch.undo()
    assert _backends(model) == {"torch_sdpa"}


def test_schedule_refuses_a_module_that_is_not_one() -> None:
    with (
        pytest.raises(TypeError, match=r"attnres\.schedule: expected a torch\.nn\.Module"),
        attnres.schedule("model", {0: "eager"}),  # type: ignore[arg-type]
    ):
        pytest.fail("the block must not run")


def test_rule_schedule_cli_flag_plans_each_step_in_the_component_scope(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``explain --component C --schedule``: each step is planned in the scope the
    explained trace records (the component's override included), as
    :func:`plan_schedule` plans it inside ``component_scope``; without
    ``--component`` the steps' traces differ."""
    import json

    from attnres import LayerSpec, Platform, SelectionConfig, cli
    from attnres._schedule_plan import parse_schedule, plan_schedule
    from attnres.runtime import component_scope

    args = ["explain", "--head-size", "128", "--dtype", "bf16", "--supported", "fa,torch_sdpa"]
    args += ["--platform", "cuda:sm90+flash_attn", "--json", "--schedule", "0:fa,40:torch_sdpa"]
    scoped = [*args, "--component", "vae", "--component-backend", "torch_sdpa"]
    assert cli.main(scoped) == 0
    shown = json.loads(capsys.readouterr().out)
    trace = shown["trace"]["input"]
    assert trace["scope"]["component"] == "vae" and trace["scope"]["backend"] == "torch_sdpa"
    layer = LayerSpec(head_size=128, dtype="bf16", supported=frozenset({"fa", "torch_sdpa"}))
    platform = Platform.simulate("cuda:sm90+flash_attn")
    with component_scope("vae", backend="torch_sdpa", require_selection=False) as handle:
        expected = plan_schedule(
            layer, parse_schedule("0:fa,40:torch_sdpa"), SelectionConfig(), platform, handle.state
        )
    assert [r["digest"] for r in shown["schedule"]] == [t.digest for _, _, t in expected]
    assert cli.main(args) == 0
    unscoped = json.loads(capsys.readouterr().out)["schedule"]
    assert [r["digest"] for r in unscoped] != [r["digest"] for r in shown["schedule"]]
