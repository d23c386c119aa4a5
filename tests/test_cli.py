"""The ``attnres`` command line, as operators run it.

Exit codes, ``--json`` documents, stdout free of logs, one-paragraph errors
with no traceback, 100-column human output, and the examples of ``examples/``.
Commands run in-process through ``attnres.cli.main`` (what the console script
calls), with their own stdout and stderr; a subprocess only where it is the
point: the ``python -m attnres`` entry point and its exit codes, a changed
environment (broken or chatty packages), import time. The tests at the end
cover the argparse helpers other programs embed (``add_selection_arguments``,
``selection_config_from_args``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import attnres
from attnres.backends import registered_backends
from attnres.cli import add_selection_arguments, selection_config_from_args
from attnres.platform import KNOWN_PACKAGES
from attnres.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
HOPPER = "cuda:sm90+all"


def run(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``attnres ARGS``: in-process (``cli.main``), or in a subprocess when the
    environment (beyond the terminal width) or the interpreter's flags are part
    of the test."""
    if not prefix and set(env or {}) <= {"COLUMNS"}:
        return run_in_process(*args, cwd=cwd, columns=(env or {}).get("COLUMNS", "100"))
    return run_subprocess(*args, env=env, cwd=cwd, prefix=prefix)


def run_in_process(
    *args: str, cwd: Path = ROOT, columns: str = "100"
) -> subprocess.CompletedProcess[str]:
    """``cli.main(args)`` with its own stdout/stderr, ``columns`` wide, in ``cwd``,
    from a cold cache as a fresh process; argparse's own exits (``--help``, usage
    errors) give their exit code."""
    from attnres import cli
    from attnres.runtime import clear_cache

    clear_cache()
    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    patch = pytest.MonkeyPatch()
    try:
        patch.setenv("COLUMNS", columns)
        patch.delenv("FORCE_COLOR", raising=False)
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        os.chdir(previous)
        patch.undo()
    return subprocess.CompletedProcess(["attnres", *args], code, out.getvalue(), err.getvalue())


def run_subprocess(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "COLUMNS": "100", **(env or {})}
    full_env.pop("FORCE_COLOR", None)
    return subprocess.run(
        [sys.executable, *prefix, "-m", "attnres", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=180,
    )


@cache
def cached(*args: str) -> subprocess.CompletedProcess[str]:
    """Commands several tests read (each runs once per session)."""
    return run(*args)


def as_json(proc: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(proc.stdout)


def flat(text: str) -> str:
    """Error paragraphs are wrapped at 100 columns: compare without the breaks."""
    return " ".join(text.split())


def assert_fits(text: str, width: int = 100) -> None:
    for line in text.splitlines():
        assert len(line) <= width, f"{len(line)} columns: {line!r}"


def assert_usage_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert "error:" in proc.stderr
    for needle in needles:
        assert needle in flat(proc.stderr), proc.stderr


# =============================================================================
# generic
# =============================================================================


def test_version() -> None:
    proc = run_subprocess("--version")  # the python -m attnres entry point, exit 0
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"attnres {attnres.__version__}"


def test_help_lists_every_command() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    for command in ("explain", "plan", "replay", "doctor", "backends"):
        assert command in proc.stdout


def test_no_command_is_a_usage_error() -> None:
    proc = run_subprocess()  # the process's exit status is 2
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_console_script_entry_point_is_cli_main() -> None:
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("attnres") == "attnres.cli:main"


# =============================================================================
# explain
# =============================================================================

SEED = (
    "explain",
    "--head-size",
    "1536",
    "--dtype",
    "float32",
    "--supported",
    "fa,torch_sdpa",
    "--default",
    "torch_sdpa",
    "--component",
    "audio_vae",
    "--attention-backend",
    "sage_attn",
    "--platform",
    HOPPER,
)


def test_explain_seed_incident_human_output() -> None:
    proc = cached(*SEED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert out.startswith("Decision:  selected torch_sdpa")
    assert "global_cli" in out and "global backend fallback" in out
    # every check of the requested candidate, with verdict and reason
    table = out[out.index("Candidates") :]
    for check in ("known", "available", "platform", "role", "supported", "requirements"):
        assert re.search(rf"\b{check}\b", table), check
    assert "head size 1536 exceeds the maximum 128" in out
    assert "not in the layer's supported set" in out
    assert "FAIL" in out and "pass" in out
    assert "global_fallback: to component_default" in out
    assert "Why:" in out
    assert_fits(out)


def test_explain_json_selected() -> None:
    proc = cached(*SEED, "--json")
    assert proc.returncode == 0
    doc = as_json(proc)
    assert {"status", "backend", "reason", "origin", "error", "trace"} <= set(doc)
    assert doc["status"] == "selected"
    assert doc["backend"] == "torch_sdpa"
    assert doc["reason"] == "global backend fallback"
    assert doc["origin"] == "global_cli"
    assert doc["error"] is None
    trace = doc["trace"]
    assert trace["outcome"]["backend"] == "torch_sdpa"
    assert trace["input"]["scope"]["component"] == "audio_vae"
    assert re.fullmatch(r"[0-9a-f]{64}", trace["digest"])
    kinds = [r["kind"] for r in trace["records"]]
    assert kinds[0] == "origin" and kinds[-1] == "selected" and "check" in kinds


def test_explain_json_rejected_exit_1() -> None:
    proc = run(
        "explain",
        "--head-size",
        "128",
        "--dtype",
        "bf16",
        "--requires",
        "causal,packed_varlen",
        "--component",
        "transformer",
        "--component-backend",
        "sage_attn",
        "--platform",
        HOPPER,
        "--json",
    )
    assert proc.returncode == 1
    assert proc.stderr == ""
    doc = as_json(proc)
    assert doc["status"] == "rejected"
    assert doc["backend"] is None and doc["reason"] is None
    assert doc["origin"] == "component_override"
    assert doc["error"] == (
        "Attention backend 'sage_attn' does not implement packed varlen attention "
        "for component 'transformer'"
    )
    assert doc["trace"]["outcome"]["status"] == "rejected"


def test_explain_rejected_human_output() -> None:
    proc = run(
        "explain",
        "--head-size",
        "128",
        "--dtype",
        "bf16",
        "--supported",
        "fa,torch_sdpa",
        "--attention-backend",
        "sage_attn",
        "--platform",
        HOPPER,
    )
    assert proc.returncode == 1
    assert proc.stdout.startswith("Decision:  rejected")
    assert "Attention backend 'sage_attn' is not supported by this attention layer" in flat(
        proc.stdout
    )
    assert "strict_failure: to rejected" in proc.stdout
    assert_fits(proc.stdout)


def test_explain_typed_flag_is_explicit_and_implicit_is_a_preference() -> None:
    base = (
        "explain",
        "--head-size",
        "128",
        "--dtype",
        "bf16",
        "--component",
        "transformer",
        "--supported",
        "fa,torch_sdpa",
        "--attention-backend",
        "sage_attn",
        "--platform",
        HOPPER,
        "--json",
    )
    typed = run(*base)
    implicit = run(*base, "--implicit")
    assert typed.returncode == 1
    assert as_json(typed)["origin"] == "global_cli"
    assert implicit.returncode == 0
    doc = as_json(implicit)
    assert doc["origin"] == "global_preference"
    assert doc["backend"] in ("fa", "torch_sdpa")
    assert doc["reason"] == "platform default fallback"
    assert doc["trace"]["input"]["config"]["global_backend_explicit"] is False


def test_explain_sparse_request_on_cross_attention_falls_back_to_dense() -> None:
    proc = run(
        "explain",
        "--head-size",
        "128",
        "--dtype",
        "bf16",
        "--role",
        "cross",
        "--attention-backend",
        "video_sparse_attn",
        "--component",
        "transformer",
        "--platform",
        HOPPER,
        "--json",
    )
    assert proc.returncode == 0
    doc = as_json(proc)
    assert doc["reason"] == "dense cross-attention fallback"
    assert not attnres.Backend.parse(doc["backend"]).is_sparse


def test_explain_per_component_flag_form() -> None:
    proc = run(
        "explain",
        "--head-size",
        "64",
        "--dtype",
        "fp32",
        "--component",
        "vae",
        "--attention-backend",
        "vae=eager",
        "--platform",
        "cpu",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    doc = as_json(proc)
    assert (doc["backend"], doc["origin"]) == ("eager", "component_override")


def test_explain_trace_out_is_loadable_and_matches_the_json(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "trace.json"
    proc = run(*SEED, "--json", "--trace-out", str(out))
    assert proc.returncode == 0
    trace = load_trace(out)
    assert trace.digest == as_json(proc)["trace"]["digest"]
    assert trace.outcome.backend is not None and trace.outcome.backend.name == "torch_sdpa"


def test_replay_wiring(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    made = run(*SEED, "--trace-out", str(path))
    assert made.returncode == 0
    proc = run("replay", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok" in proc.stdout
    proc = run("replay", str(path), "--update")
    assert proc.returncode == 0
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    proc = run("replay", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    proc = run("replay", str(tmp_path / "missing.json"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--head-size", "abc", "--dtype", "bf16"), ["--head-size", "invalid int value"]),
        (("--head-size", "0", "--dtype", "bf16"), ["head_size: must be at least 1"]),
        (("--head-size", "64", "--dtype", "bfloat17"), ["unknown dtype 'bfloat17'"]),
        (("--head-size", "64"), ["--dtype"]),
        (
            ("--head-size", "64", "--dtype", "bf16", "--role", "sideways"),
            ["role must be 'self' or 'cross'"],
        ),
        (
            ("--head-size", "64", "--dtype", "bf16", "--requires", "causal,masks"),
            ["unknown requirement 'masks'", "attn_mask"],
        ),
        (
            ("--head-size", "64", "--dtype", "bf16", "--supported", "fa,flashy"),
            ["Unknown attention backend 'flashy'"],
        ),
        (
            ("--head-size", "64", "--dtype", "bf16", "--default", "sage_atn"),
            ["Did you mean 'sage_attn'?"],
        ),
        (
            ("--head-size", "64", "--dtype", "bf16", "--attention-backend", "sage_atn"),
            ["Unknown attention backend 'sage_atn'", "Did you mean 'sage_attn'?"],
        ),
        (
            (
                "--head-size",
                "64",
                "--dtype",
                "bf16",
                "--component",
                "vae",
                "--component-backend",
                "flash",
            ),
            ["Unknown attention backend 'flash'"],
        ),
        (
            ("--head-size", "64", "--dtype", "bf16", "--component-backend", "fa"),
            ["--component NAME"],
        ),
        (("--head-size", "64", "--dtype", "bf16", "--implicit"), ["--attention-backend"]),
        (
            (
                "--head-size",
                "64",
                "--dtype",
                "bf16",
                "--attention-backend",
                "fa",
                "--attention-backend",
                "eager",
            ),
            ["given twice"],
        ),
        (
            ("--head-size", "64", "--dtype", "bf16", "--attention-backend", "=fa"),
            ["COMPONENT=BACKEND"],
        ),
    ],
)
def test_explain_bad_input_exit_2(args: tuple[str, ...], needles: list[str]) -> None:
    assert_usage_error(run("explain", *args, "--platform", "cpu"), *needles)


def test_explain_bad_platform_shows_the_grammar() -> None:
    proc = run("explain", "--head-size", "64", "--dtype", "bf16", "--platform", "cuda:smx")
    assert_usage_error(proc, "KIND[:ARCH][+PACKAGE...]", "cuda:smx")
    assert proc.stderr.startswith("attnres explain: error: ")


# =============================================================================
# plan
# =============================================================================


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_plans_cleanly_on_cpu(path: Path) -> None:
    proc = run("plan", str(path.relative_to(ROOT)), "--platform", "cpu", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    doc = as_json(proc)
    assert doc["status"] == "ok"
    assert doc["components"]
    for component in doc["components"]:
        assert set(component) >= {"name", "kind", "layers"}
        assert component["layers"]
        for layer in component["layers"]:
            assert set(layer) >= {"name", "status", "backend", "reason", "origin", "error"}
            assert layer["status"] == "selected" and layer["backend"] == "torch_sdpa"
            assert layer["count"] >= 1


def test_make_run_first_command_detected_platform() -> None:
    proc = cached("plan", "examples/audio-video.toml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    assert "Verdict: ok" in proc.stdout
    assert_fits(proc.stdout)


def test_make_run_second_command_shows_the_auxiliary_fallback() -> None:
    proc = cached(
        "plan",
        "examples/audio-video.toml",
        "--platform",
        HOPPER,
        "--attention-backend",
        "sage_attn",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Verdict: ok" in out
    assert "global backend fallback" in out
    audio = out[out.index("audio_vae  [") :]
    assert "torch_sdpa" in audio and "global backend fallback" in audio
    transformer = out[out.index("transformer  [") : out.index("text_encoder  [")]
    assert "sage_attn" in transformer and "torch_sdpa" not in transformer
    assert_fits(out)


def test_plan_json_seed_incident() -> None:
    proc = run(
        "plan",
        "examples/audio-video.toml",
        "--platform",
        HOPPER,
        "--attention-backend",
        "sage_attn",
        "--json",
    )
    assert proc.returncode == 0
    doc = as_json(proc)
    assert doc["status"] == "ok"
    assert doc["attention_backend"] == "sage_attn" and doc["attention_backend_explicit"] is True
    components = {c["name"]: c for c in doc["components"]}
    assert components["audio_vae"]["kind"] == "audio_vae"
    for layer in components["audio_vae"]["layers"]:
        assert (layer["backend"], layer["reason"], layer["origin"]) == (
            "torch_sdpa",
            "global backend fallback",
            "global_cli",
        )
    for layer in components["transformer"]["layers"]:
        assert (layer["backend"], layer["reason"]) == ("sage_attn", None)


def test_plan_rejection_reports_every_layer_and_exits_1() -> None:
    proc = run(
        "plan",
        "examples/ltx2.toml",
        "--platform",
        HOPPER,
        "--attention-backend",
        "sage_attn",
        "--json",
    )
    assert proc.returncode == 1
    assert proc.stderr == ""  # no log line leaks without --log-level
    doc = as_json(proc)
    assert doc["status"] == "rejected"
    layers = [(c["name"], la) for c in doc["components"] for la in c["layers"]]
    rejected = {la["name"] for _, la in layers if la["status"] == "rejected"}
    assert rejected == {"transformer_blocks.attn2", "transformer_blocks.audio_attn2"}
    for _, layer in layers:
        if layer["status"] == "rejected":
            assert layer["backend"] is None
            assert "does not implement attention masks" in layer["error"]
        else:
            assert layer["backend"] and layer["error"] is None
    human = run(
        "plan", "examples/ltx2.toml", "--platform", HOPPER, "--attention-backend", "sage_attn"
    )
    assert human.returncode == 1
    assert "REJECTED" in human.stdout and "Verdict: rejected" in human.stdout
    assert_fits(human.stdout)


def test_plan_override_not_applied_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        textwrap.dedent(
            """
            [[components]]
            name = "transformer"
            role_backends = { cross = "torch_sdpa" }

            [[components.layers]]
            name = "attn1"
            head_size = 64
            dtype = "bf16"
            """
        ),
        encoding="utf-8",
    )
    proc = run("plan", str(path), "--platform", "cpu", "--json")
    assert proc.returncode == 1
    (component,) = as_json(proc)["components"]
    assert component["status"] == "rejected"
    assert "cross-attention" in component["error"]
    assert component["layers"][0]["status"] == "selected"


def test_plan_trace_out_writes_one_replayable_trace_per_distinct_layer(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    proc = run(
        "plan",
        "examples/ltx2.toml",
        "--platform",
        HOPPER,
        "--attention-backend",
        "sage_attn",
        "--json",
        "--trace-out",
        str(out),
    )
    assert proc.returncode == 1
    doc = as_json(proc)
    layers = [la for c in doc["components"] for la in c["layers"]]
    files = sorted(p for p in out.iterdir() if p.name != "attnres.manifest")
    assert len(files) == len(layers)
    manifest = json.loads((out / "attnres.manifest").read_text())
    assert manifest["complete"] is True
    assert manifest["files"] == [f.name for f in files]
    for file in files:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+\.json", file.name)
    for layer in layers:
        trace = load_trace(layer["trace_file"])
        assert trace.digest == layer["digest"]
        assert trace.outcome.status == layer["status"]
    assert (out / "transformer__transformer_blocks.attn2.json").exists()


def test_plan_global_options_after_the_command_and_logs_on_stderr() -> None:
    proc = run(
        "plan",
        "examples/cpu-small.toml",
        "--platform",
        "cpu",
        "--json",
        "--log-level",
        "debug",
    )
    assert proc.returncode == 0
    doc = as_json(proc)  # stdout is exactly one JSON document
    assert doc["status"] == "ok"
    assert "attention backend selected" in proc.stderr
    assert "attention record" in proc.stderr  # DEBUG events
    assert "Attention backends for unet" in proc.stderr  # the scope summary line


def test_json_log_format_writes_one_json_object_per_stderr_line() -> None:
    proc = run(
        "--log-format",
        "json",
        "--log-level",
        "info",
        "plan",
        "examples/cpu-small.toml",
        "--platform",
        "cpu",
        "--json",
    )
    assert proc.returncode == 0
    as_json(proc)
    events = [json.loads(line) for line in proc.stderr.splitlines()]
    assert events
    selected = [e for e in events if e["event"] == "attention backend selected"]
    assert selected
    for event in selected:
        assert {"backend", "reason", "origin", "component", "layer", "level"} <= set(event)
    assert not any(e["level"] == "debug" for e in events)


def test_log_level_warning_shows_rejections_only() -> None:
    proc = run(
        "plan",
        "examples/ltx2.toml",
        "--platform",
        HOPPER,
        "--attention-backend",
        "sage_attn",
        "--log-level",
        "warning",
        "--log-format",
        "json",
    )
    assert proc.returncode == 1
    events = [json.loads(line) for line in proc.stderr.splitlines()]
    assert {e["event"] for e in events} == {"attention backend rejected"}
    assert all(e["level"] == "warning" and e["error"] for e in events)


def _bad_pipeline(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return str(path)


GOOD_LAYER = 'name = "mid.attn"\nhead_size = 64\ndtype = "bf16"\n'


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            '[[components]]\nname = "vae"\n[[components.layers]]\nname = "a"\nhead_size = \n',
            ["bad.toml:5: invalid TOML"],
        ),
        (
            '[[components]]\nname = "vae"\n[[components.layers]]\nname = "mid.attn"\n'
            'dtype = "bf16"\n',
            ["component 'vae'", "layer 'mid.attn'", "missing required key 'head_size'"],
        ),
        (
            '[[components]]\nname = "vae"\n[[components.layers]]\n'
            + GOOD_LAYER
            + "head_sise = 3\n",
            ["layer 'mid.attn'", "unknown key 'head_sise'", "did you mean 'head_size'?"],
        ),
        (
            '[[components]]\nname = "vae"\n[[components.layers]]\nname = "a"\n'
            'head_size = "64"\ndtype = "bf16"\n',
            ["layer 'a'", "head_size must be an integer"],
        ),
        (
            '[[components]]\nname = "vae"\nbackend = "sage_atn"\n[[components.layers]]\n'
            + GOOD_LAYER,
            [
                "component 'vae'",
                "Unknown attention backend 'sage_atn'",
                "Did you mean 'sage_attn'?",
            ],
        ),
        (
            '[[components]]\nname = "vae"\n[[components.layers]]\n'
            + GOOD_LAYER
            + 'role = "crosss"\n',
            ["layer 'mid.attn'", "role must be 'self' or 'cross'"],
        ),
        ('[pipeline]\nname = "empty"\n', ["no components"]),
    ],
)
def test_plan_invalid_pipeline_exit_2(tmp_path: Path, text: str, needles: list[str]) -> None:
    path = _bad_pipeline(tmp_path, text)
    proc = run("plan", path, "--platform", "cpu")
    assert_usage_error(proc, path, *needles)
    assert proc.stderr.startswith("attnres plan: error: ")


def test_plan_unreadable_file_exit_2(tmp_path: Path) -> None:
    assert_usage_error(
        run("plan", str(tmp_path / "nope.toml"), "--platform", "cpu"),
        "nope.toml",
        "cannot read pipeline file",
    )


def test_plan_json_mode_errors_keep_stdout_empty(tmp_path: Path) -> None:
    path = _bad_pipeline(tmp_path, '[[components]]\nname = "vae"\n')
    assert_usage_error(run("plan", path, "--platform", "cpu", "--json"), "no layers")


def test_plan_bad_platform_and_unknown_component_flag() -> None:
    assert_usage_error(
        run("plan", "examples/cpu-small.toml", "--platform", "gpu"),
        "unknown platform kind 'gpu'",
        "KIND[:ARCH][+PACKAGE...]",
    )
    assert_usage_error(
        run(
            "plan",
            "examples/cpu-small.toml",
            "--platform",
            "cpu",
            "--attention-backend",
            "vea=eager",
        ),
        "no component 'vea'",
        "unet, text_encoder, vae",
    )
    assert_usage_error(
        run(
            "plan",
            "examples/cpu-small.toml",
            "--platform",
            "cpu",
            "--attention-backend",
            "sage_atn",
        ),
        "Did you mean 'sage_attn'?",
    )


# =============================================================================
# doctor and backends
# =============================================================================


def test_doctor_human() -> None:
    proc = cached("doctor")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for probe in KNOWN_PACKAGES:
        assert probe.name in out
    assert "default chain:" in out and "torch_sdpa" in out
    assert "Plugins" in out and "Platform notes" in out
    assert_fits(out)


@pytest.fixture
def broken_environment(tmp_path: Path) -> dict[str, str]:
    """A kernel package whose import fails, and a plugin that fails to load."""
    (tmp_path / "xformers").mkdir()
    (tmp_path / "xformers" / "__init__.py").write_text(
        'raise ImportError("libcudart.so.12: cannot open shared object file")\n'
    )
    (tmp_path / "attnres_fake_plugin.py").write_text('raise RuntimeError("plugin exploded")\n')
    dist = tmp_path / "attnres_fake_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: attnres-fake-plugin\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text("[attnres.backends]\nfake = attnres_fake_plugin:SPEC\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}


def test_doctor_json_reports_import_errors_and_plugin_failures(
    broken_environment: dict[str, str],
) -> None:
    proc = run("doctor", "--json", env=broken_environment)
    assert proc.returncode == 0, proc.stderr
    doc = as_json(proc)
    assert doc["attnres_version"] == attnres.__version__
    assert doc["platform"]["kind"] in ("cpu", "cuda", "rocm", "mps", "xpu", "npu")
    assert doc["platform"]["simulated"] is False
    assert doc["default_chain"][-1] == "torch_sdpa"
    assert {p["name"] for p in doc["packages"]} >= {p.name for p in KNOWN_PACKAGES}
    for package in doc["packages"]:
        assert package["status"] in ("present", "missing", "broken")
        assert package["version"] if package["status"] == "present" else package["detail"]
    assert isinstance(doc["notes"], list)
    xformers = next(p for p in doc["packages"] if p["name"] == "xformers")
    assert xformers["status"] == "broken"
    assert xformers["backends"] == ["xformers"]
    assert "libcudart.so.12" in xformers["detail"] and "ImportError" in xformers["detail"]
    (failure,) = doc["plugin_failures"]
    assert "attnres_fake_plugin" in failure["entry_point"]
    assert "plugin exploded" in failure["error"]
    backends = run("backends", "--json", env=broken_environment)
    assert as_json(backends)["plugin_failures"]
    human = run("backends", env=broken_environment)
    assert "plugin exploded" in flat(human.stdout)


def test_doctor_human_rendering_of_a_gpu_machine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnres import cli
    from attnres.backends import PluginFailure
    from attnres.platform import PackageFact, Platform

    fake = Platform(
        kind="cuda",
        device_name="NVIDIA H200",
        capability=(9, 0),
        arch="sm90",
        torch_version="2.13.0",
        packages=(
            PackageFact("flash_attn", "present", "2.8.3"),
            PackageFact(
                "xformers",
                "broken",
                None,
                "import failed: ImportError: libcudart.so.12: cannot open shared object file",
            ),
            PackageFact("sageattention", "missing", None, "not installed"),
        ),
        notes=("torch.xpu query failed: RuntimeError: boom",),
    )
    monkeypatch.setattr(cli.Platform, "detect", classmethod(lambda cls, **kw: fake))
    monkeypatch.setattr(
        cli, "plugin_failures", lambda: (PluginFailure("fake = x:SPEC", "RuntimeError: exploded"),)
    )
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "sm90" in out
    assert " -> ".join(b.name for b in fake.default_chain()) in out
    assert re.search(r"flash_attn\s+fa, vmoba_attn\s+present\s+2\.8\.3", out)
    assert "libcudart.so.12" in flat(out) and "broken" in out
    assert "fake = x:SPEC" in out and "exploded" in out
    assert "torch.xpu query failed" in out
    assert_fits(out)


def test_doctor_on_a_machine_with_sageattention_1_reports_sageattention_1(
    tmp_path: Path,
) -> None:
    """Issue 31: the registry's sageattention is 1.0.6 (SageAttention 1: Triton, head
    sizes 64/96/128); the probe reads its distribution version and doctor reports
    SageAttention 1's facts, not SageAttention 2's (<= 128, per-GPU functions)."""
    (tmp_path / "sageattention").mkdir()
    (tmp_path / "sageattention" / "__init__.py").write_text("def sageattn(*a, **k): pass\n")
    dist = tmp_path / "sageattention-1.0.6.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sageattention\nVersion: 1.0.6\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    doc = as_json(run("doctor", "--json", env={"PYTHONPATH": path}))
    package = next(p for p in doc["packages"] if p["name"] == "sageattention")
    assert (package["version"], package["distribution"]) == ("1.0.6", "sageattention")
    (sage,) = [k for k in doc["kernels"] if k["backend"] == "sage_attn"]
    assert sage["kernel"] == "SageAttention 1"
    assert sage["head_sizes"] == "{64, 96, 128}"
    assert sage["options"] == ["smooth_k"] and sage["lse"] is False
    assert "1.0.6" in sage["facts"][0]["source"]
    human = flat(run("doctor", env={"PYTHONPATH": path}).stdout)
    assert "sage_attn: SageAttention 1 (sageattention 1.0.6); head sizes {64, 96, 128}" in human


def test_backends_shows_releases_variants_and_refusals() -> None:
    out = flat(cached("backends").stdout)
    assert "sageattention < 2: SageAttention 1" in out
    assert "flash-attn (any version): flash-attn 2.x's early flash_attn.cute (0.1.0)" in out
    assert "refuses option deterministic=True with the backward pass on sm120-sm121" in out
    assert "refuses at call time: a key/value sequence of length 1" in out


def test_backends_human() -> None:
    proc = cached("backends")
    assert proc.returncode == 0
    assert proc.stderr == ""
    out = proc.stdout
    for spec in registered_backends():
        assert re.search(rf"^{spec.name}\s", out, re.MULTILINE), spec.name
        for alias in spec.aliases:
            assert alias in out
    for header in ("name", "kind", "runs on", "dtypes", "head size"):
        assert header in out
    assert "implements:" in out and "package:" in out
    assert_fits(out)


def test_backends_json() -> None:
    proc = run("backends", "--json")
    assert proc.returncode == 0
    doc = as_json(proc)
    names = [b["name"] for b in doc["backends"]]
    assert names == [s.name for s in registered_backends()]
    sage = next(b for b in doc["backends"] if b["name"] == "sage_attn")
    assert sage["kind"] == "dense"
    assert sage["platforms"] == ["cuda"]
    assert sage["package"] == "sageattention"
    assert sage["head_sizes"]["max"] == 128
    assert [9, 0] in sage["capabilities"]["cuda"]["exact"]
    assert sage["implements"] == ["causal", "gqa", "custom_scale"]
    assert "sage" in sage["aliases"]
    vsa = next(b for b in doc["backends"] if b["name"] == "video_sparse_attn")
    assert vsa["kind"] == "sparse"


def test_stdout_stays_clean_with_debug_logging() -> None:
    for args in (
        ("backends", "--json"),
        (*SEED, "--json"),
    ):
        proc = run("--log-level", "debug", *args)
        assert proc.returncode == 0
        as_json(proc)
    proc = run("--log-level", "debug", *SEED, "--json")
    assert "attention record" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("backends",),
        (
            "plan",
            "examples/audio-video.toml",
            "--platform",
            HOPPER,
            "--attention-backend",
            "sage_attn",
        ),
        ("explain", "--head-size", "64", "--dtype", "bf16", "--platform", "cpu"),
    ],
    ids=["backends", "plan", "explain"],
)
def test_torch_is_not_imported_without_platform_detection(args: tuple[str, ...]) -> None:
    proc = run(*args, prefix=("-X", "importtime"))
    assert proc.returncode == 0
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert imported, "no -X importtime output"
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


# =============================================================================
# In process: the helpers other programs embed
# =============================================================================


def _parser(default: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="serve")
    add_selection_arguments(parser, default=default)
    return parser


def test_typed_flag_is_explicit() -> None:
    args = _parser().parse_args(["--attention-backend", "SAGE"])
    config = selection_config_from_args(args)
    assert config.global_backend is not None and config.global_backend.name == "sage_attn"
    assert config.global_backend_explicit is True
    assert attnres.SelectionConfig.from_args(args) == config


def test_program_default_is_a_preference_not_explicit() -> None:
    config = selection_config_from_args(_parser(default="fa").parse_args([]))
    assert config.global_backend is not None and config.global_backend.name == "fa"
    assert config.global_backend_explicit is False
    typed = selection_config_from_args(
        _parser(default="fa").parse_args(["--attention-backend", "fa"])
    )
    assert typed.global_backend_explicit is True


def test_nothing_given_is_the_default_config() -> None:
    assert selection_config_from_args(_parser().parse_args([])) == attnres.SelectionConfig()


def test_per_component_form_is_repeatable_and_independent_of_the_global_flag() -> None:
    args = _parser(default="fa").parse_args(
        ["--attention-backend", "vae=sdpa", "--attention-backend", "audio_vae=torch_sdpa"]
    )
    config = selection_config_from_args(args)
    assert dict((n, b.name) for n, b in config.component_backends) == {
        "audio_vae": "torch_sdpa",
        "vae": "torch_sdpa",
    }
    assert config.global_backend is not None and config.global_backend.name == "fa"
    assert config.global_backend_explicit is False


def test_unknown_backend_is_a_parse_error_with_a_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["--attention-backend", "sage_atn"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Did you mean 'sage_attn'?" in err


def test_bad_program_default_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="Unknown attention backend"):
        _parser(default="nope")


def test_selection_arguments_work_in_an_argument_group() -> None:
    parser = argparse.ArgumentParser()
    add_selection_arguments(parser.add_argument_group("attention"))
    config = selection_config_from_args(parser.parse_args(["--attention-backend", "eager"]))
    assert config.global_backend is not None and config.global_backend_explicit


def test_main_in_process_restores_structlog(capsys: pytest.CaptureFixture[str]) -> None:
    import structlog

    from attnres.cli import main

    was_configured = structlog.is_configured()
    before = structlog.get_config()
    code = main(["--log-level", "info", "backends", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["backends"]
    assert structlog.is_configured() is was_configured
    assert structlog.get_config() == before


@pytest.fixture
def chatty_environment(tmp_path: Path) -> dict[str, str]:
    """Kernel packages that print when imported, at the Python and the fd level."""
    (tmp_path / "sageattention.py").write_text(
        "import os, sys\n"
        "print('sageattention says hello')\n"
        "os.write(1, b'written to fd 1\\n')\n"
        "sys.stdout.write('no newline')\n"
    )
    (tmp_path / "xformers").mkdir()
    (tmp_path / "xformers" / "__init__.py").write_text(
        "print('xformers: loading CUDA')\nraise ImportError('libcudart.so.12: not found')\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}


@pytest.mark.parametrize(
    "argv",
    [
        ("doctor", "--json"),
        ("explain", "--head-size", "64", "--dtype", "bf16", "--json"),
        ("plan", "examples/cpu-small.toml", "--json"),
    ],
    ids=["doctor", "explain", "plan"],
)
def test_json_output_stays_json_when_a_kernel_package_prints(
    argv: tuple[str, ...], chatty_environment: dict[str, str]
) -> None:
    """Issue 11, case 11: probing keeps third-party output off stdout (both levels)."""
    proc = run(*argv, env=chatty_environment)
    assert proc.returncode == 0, proc.stderr
    # the whole of stdout is one JSON document: nothing printed before or after it
    assert proc.stdout.startswith("{") and proc.stdout.endswith("}\n")
    json.loads(proc.stdout)


def test_what_a_package_printed_is_kept_in_its_probe_fact(
    chatty_environment: dict[str, str],
) -> None:
    doc = as_json(run("doctor", "--json", env=chatty_environment))
    facts = {p["name"]: p for p in doc["packages"]}
    sage = facts["sageattention"]
    assert sage["status"] == "present"
    assert "printed on import: sageattention says hello" in sage["detail"]
    assert "written to fd 1" in sage["detail"] and "no newline" in sage["detail"]
    xformers = facts["xformers"]
    assert xformers["status"] == "broken"
    assert xformers["detail"].startswith("import failed: ImportError: libcudart.so.12")
    assert xformers["detail"].endswith("printed on import: xformers: loading CUDA")


_WIDE_OUTPUTS = {
    "plan-ltx2-sparse": (
        "plan",
        "examples/ltx2.toml",
        "--platform",
        HOPPER,
        "--attention-backend",
        "video_sparse_attn",
    ),
    "plan-audio-video": (
        "plan",
        "examples/audio-video.toml",
        "--platform",
        HOPPER,
        "--attention-backend",
        "fa",
    ),
    "explain": (
        "explain",
        "--head-size",
        "64",
        "--dtype",
        "bf16",
        "--platform",
        HOPPER,
        "--attention-backend",
        "sage_attn",
        "--component",
        "audio_vae",
    ),
    "backends": ("backends",),
    "doctor": ("doctor",),
}


@pytest.mark.parametrize("columns", [60, 80, 100])
@pytest.mark.parametrize("name", sorted(_WIDE_OUTPUTS))
def test_text_output_fits_the_terminal_and_never_breaks_a_name(name: str, columns: int) -> None:
    """Issue 11, case 12: every line fits COLUMNS (60 to 100); names stay whole."""
    argv = _WIDE_OUTPUTS[name]
    proc = run(*argv, env={"COLUMNS": str(columns)})
    assert proc.returncode in (0, 1), proc.stderr
    long = [line for line in proc.stdout.splitlines() if len(line) > columns]
    assert not long, long
    words = set(proc.stdout.split())
    if argv[0] == "plan":
        for layer in (
            la for c in as_json(cached(*argv, "--json"))["components"] for la in c["layers"]
        ):
            assert layer["name"] in proc.stdout, layer["name"]
    if argv[0] == "backends":
        for spec in registered_backends():
            assert spec.name in words, spec.name


def test_plan_summaries_read_rightly(tmp_path: Path) -> None:
    """Issue 11, case 13: counts say what they count; singular is singular."""
    proc = run(
        "plan",
        "examples/audio-video.toml",
        "--platform",
        HOPPER,
        "--attention-backend",
        "sage_attn",
    )
    verdict = " ".join(proc.stdout.split("Verdict:")[1].split())
    assert re.search(r"fallbacks: global backend fallback \(\d+ layers\)", verdict), verdict
    one = tmp_path / "one.toml"
    one.write_text(
        '[pipeline]\nname = "one"\n[[components]]\nname = "vae"\n'
        '[[components.layers]]\nname = "mid.attn"\nhead_size = 64\ndtype = "float32"\n'
    )
    proc = run(
        "plan",
        str(one),
        "--platform",
        "cpu",
        "--attention-backend",
        "vae=torch_sdpa",
        "--trace-out",
        str(tmp_path / "traces"),
    )
    assert proc.returncode == 0, proc.stderr
    # a long temporary path wraps onto the next line: read the text unwrapped
    unwrapped = " ".join(proc.stdout.split())
    assert f"Traces: 1 file written to {tmp_path / 'traces'}" in unwrapped
    request = next(line for line in proc.stdout.splitlines() if line.startswith("Request:"))
    assert request.split(None, 1)[1] == (
        "no global --attention-backend; per component: --attention-backend vae=torch_sdpa"
    )
