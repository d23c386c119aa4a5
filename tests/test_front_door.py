"""Selection contract v2, section 4: the operator's front door.

``--attention-backend`` takes role overrides (``transformer.cross=X``) and
comma-separated lists; component names are normalised wherever they are given;
``ATTNRES_ATTENTION_BACKEND`` sets the global backend when the flag is absent
(origin ``global_env``, relaxed and strict like the flag; the flag beats it).
"""

from __future__ import annotations

import argparse
import json

import pytest

import attnres
from attnres import (
    LayerSpec,
    Platform,
    ResolutionError,
    SelectionConfig,
    cli,
    component_scope,
    resolve,
)
from attnres import runtime as runtime_mod
from attnres.cli import add_selection_arguments, selection_config_from_args
from attnres.layer import ENV_VAR

CPU = Platform.simulate("cpu")
HOPPER = Platform.simulate("cuda:sm90+all")
LAYER = LayerSpec(64, "bf16", name="attn")


def _parse(*argv: str) -> SelectionConfig:
    parser = argparse.ArgumentParser()
    add_selection_arguments(parser)
    return SelectionConfig.from_args(parser.parse_args(list(argv)))


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


# -- role overrides and comma lists ------------------------------------------------------


def test_rule_front_door_role_override_from_the_command_line() -> None:
    config = _parse("--attention-backend", "transformer.cross=eager")
    assert config.component_backends == (("transformer.cross", attnres.Backend("eager")),)
    with component_scope("transformer"):
        cross = resolve(LayerSpec(64, "fp32", role="cross"), config=config, platform=CPU)
        self_ = resolve(LayerSpec(64, "fp32"), config=config, platform=CPU)
    assert (cross.backend.name, cross.origin) == ("eager", "role_override")
    assert "(--attention-backend transformer.cross=...)" in cross.trace.records[0].detail
    assert (self_.backend.name, self_.origin) == ("torch_sdpa", "none")


def test_rule_front_door_comma_separated_lists() -> None:
    config = _parse("--attention-backend", "vae=torch_sdpa, Text-Encoder=eager,sage")
    assert dict(config.component_backends) == {
        "vae": attnres.Backend("torch_sdpa"),
        "text_encoder": attnres.Backend("eager"),
    }
    assert config.global_backend == attnres.Backend("sage_attn")
    assert config.global_backend_explicit


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("transformer.crosss=eager", "must be a role, self or cross"),
        ("vae=torch_sdpa,,fa", "comma-separated"),
        ("vae=nope", "nope"),
    ],
)
def test_front_door_bad_items_are_parse_errors(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _parse("--attention-backend", value)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spelling", ["text-encoder", "Text_Encoder", " TEXT-ENCODER "])
def test_rule_front_door_component_names_are_normalised_everywhere(spelling: str) -> None:
    config = SelectionConfig(component_backends={spelling: "eager"})
    assert config.component_backends[0][0] == "text_encoder"
    with component_scope(spelling) as scope:
        res = resolve(LayerSpec(64, "fp32"), config=config, platform=CPU)
    assert scope.state.component == "text_encoder"
    assert scope.state.kind == "text_encoder"  # not the strict generic kind
    assert scope.state.allow_global_fallback
    assert (res.backend.name, res.origin) == ("eager", "component_override")


# -- ATTNRES_ATTENTION_BACKEND -----------------------------------------------------------


def test_rule_front_door_env_sets_the_global_backend_with_its_own_origin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "Sage")
    config = _parse()
    assert config.global_backend == attnres.Backend("sage_attn")
    assert config.global_backend_env == ENV_VAR
    with component_scope("vae"):  # relaxed, like the flag
        relaxed = resolve(LayerSpec(64, "fp32"), config=config, platform=HOPPER)
    # fp32: sage_attn takes none, the VAE falls back as under the flag
    assert (relaxed.origin, relaxed.reason) == ("global_env", "global backend fallback")
    assert relaxed.backend.name != "sage_attn"
    assert relaxed.trace.input.config.global_backend_env == ENV_VAR
    assert relaxed.trace.records[0].detail.startswith(f"{ENV_VAR} set in the environment")
    with pytest.raises(ResolutionError) as info, component_scope("transformer"):
        resolve(LayerSpec(64, "fp32"), config=config, platform=HOPPER)  # strict, like the flag
    assert info.value.trace.outcome.origin == "global_env"


def test_rule_front_door_the_flag_beats_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "sage_attn")
    config = _parse("--attention-backend", "eager")
    assert (config.global_backend, config.global_backend_env) == (attnres.Backend("eager"), None)
    # the env beats a program default (a preference, not the operator's choice)
    parser = argparse.ArgumentParser()
    add_selection_arguments(parser, default="fa")
    preferred = selection_config_from_args(parser.parse_args([]))
    assert (preferred.global_backend, preferred.global_backend_env) == (
        attnres.Backend("sage_attn"),
        ENV_VAR,
    )


def test_rule_front_door_the_default_config_reads_the_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "eager")
    monkeypatch.setattr(runtime_mod, "_CONFIG", None)  # as in a fresh process
    res = resolve(LayerSpec(64, "fp32"), platform=CPU)
    assert (res.backend.name, res.origin) == ("eager", "global_env")
    assert attnres.selection_config().global_backend_env == ENV_VAR


def test_front_door_a_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "sagee")
    with pytest.raises(ValueError, match=rf"{ENV_VAR}: .*sagee"):
        SelectionConfig.from_env()
    monkeypatch.setenv(ENV_VAR, "vae=eager")
    with pytest.raises(ValueError, match="sets the global backend only"):
        SelectionConfig.from_env()
    monkeypatch.setenv(ENV_VAR, "  ")
    assert SelectionConfig.from_env() == SelectionConfig()


def test_front_door_env_needs_an_explicit_global_backend() -> None:
    with pytest.raises(ValueError, match="global_backend_env"):
        SelectionConfig(global_backend_env=ENV_VAR)
    with pytest.raises(ValueError, match="global_backend_env"):
        SelectionConfig(
            global_backend="fa", global_backend_explicit=False, global_backend_env=ENV_VAR
        )


def test_rule_front_door_the_cli_reads_the_env_and_doctor_shows_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV_VAR, "sage_attn")
    code = cli.main(
        [
            "explain",
            "--head-size",
            "64",
            "--dtype",
            "bf16",
            "--platform",
            "cuda:sm90+all",
            "--component",
            "vae",
            "--json",
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["origin"] == "global_env"
    assert cli.main(["doctor", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)["environment"]
    assert (env["variable"], env["value"], env["status"], env["backend"]) == (
        ENV_VAR,
        "sage_attn",
        "set",
        "sage_attn",
    )
    assert cli.main(["doctor"]) == 0
    assert f"{ENV_VAR}: sage_attn (global backend, origin global_env" in capsys.readouterr().out
    monkeypatch.setenv(ENV_VAR, "nope")
    assert cli.main(["doctor", "--json"]) == 0  # doctor reports it, never fails on it
    assert json.loads(capsys.readouterr().out)["environment"]["status"] == "invalid"
    explain = ["explain", "--head-size", "64", "--dtype", "bf16", "--component", "vae"]
    assert cli.main(explain) == 2  # a user mistake: exit 2
    assert ENV_VAR in capsys.readouterr().err
