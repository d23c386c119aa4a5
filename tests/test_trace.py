"""Trace files: canonical JSON, digests, round trips, determinism across
processes, every malformed-file case, and the data-only security stance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scenarios import SCENARIOS, scenario_by_name, scope_state

import attnres
from attnres import LayerSpec, Platform, SelectionConfig, TraceFormatError
from attnres.machine import run_machine
from attnres.platform import PackageFact
from attnres.replayer import replay
from attnres.trace import (
    RECORD_KINDS,
    SCHEMA_VERSION,
    Trace,
    TraceInput,
    canonical_json,
    dump_trace,
    load_trace,
    record_to_dict,
    trace_from_dict,
    trace_from_json,
    trace_to_dict,
)

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
SEED = scenario_by_name("audio-vae-global-sage-falls-back-to-default")


@pytest.fixture
def seed_trace() -> Trace:
    return SEED.run()


@pytest.fixture
def seed_file(tmp_path: Path, seed_trace: Trace) -> Path:
    return dump_trace(seed_trace, tmp_path / "seed.json")


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    tests = str(Path(__file__).resolve().parent)  # the scenario table lives in tests/
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), tests, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


# =============================================================================
# Canonical form, digest, round trip
# =============================================================================


def test_dump_writes_canonical_json(seed_file: Path, seed_trace: Trace) -> None:
    raw = seed_file.read_bytes()
    text = raw.decode("utf-8")
    doc = json.loads(text)
    assert text == json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert b"\r" not in raw
    assert list(doc) == sorted(doc) == ["digest", "input", "outcome", "records", "schema_version"]
    assert doc["schema_version"] == 2  # a rule-based trace: the lowest version that says it
    assert doc["digest"] == seed_trace.digest
    assert text == seed_trace.to_json()


def test_digest_is_sha256_of_the_canonical_json_without_the_digest(seed_trace: Trace) -> None:
    import hashlib

    doc = trace_to_dict(seed_trace)
    digest = doc.pop("digest")
    assert digest == hashlib.sha256(canonical_json(doc).encode("utf-8")).hexdigest()
    assert len(digest) == 64


def test_records_are_tagged_by_kind(seed_trace: Trace) -> None:
    doc = trace_to_dict(seed_trace)
    kinds = [r["kind"] for r in doc["records"]]
    assert kinds[0] == "origin" and kinds[-1] == "selected"
    assert set(kinds) <= set(RECORD_KINDS)
    for record, obj in zip(seed_trace.records, doc["records"], strict=True):
        assert record_to_dict(record) == obj
        assert RECORD_KINDS[obj["kind"]] is type(record)


def test_round_trip_is_exact(seed_file: Path, seed_trace: Trace, tmp_path: Path) -> None:
    loaded = load_trace(seed_file)
    assert loaded == seed_trace
    assert loaded.digest == seed_trace.digest
    again = dump_trace(loaded, tmp_path / "again.json")
    assert again.read_bytes() == seed_file.read_bytes()


def test_round_trip_of_every_scenario() -> None:
    for scenario in SCENARIOS:
        trace = scenario.run()
        text = trace.to_json()
        loaded = trace_from_json(text, source=scenario.name)
        assert loaded == trace, scenario.name
        assert loaded.to_json() == text, scenario.name


def test_dump_is_atomic_and_leaves_no_temporary_file(
    seed_file: Path, seed_trace: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = seed_file.read_bytes()
    other = SCENARIOS[1].run()

    def fail(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        dump_trace(other, seed_file)
    monkeypatch.undo()
    assert seed_file.read_bytes() == before
    assert [p.name for p in seed_file.parent.iterdir()] == ["seed.json"]
    dump_trace(other, seed_file)
    assert load_trace(seed_file) == other
    assert [p.name for p in seed_file.parent.iterdir()] == ["seed.json"]


def test_dump_trace_rejects_what_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="takes a Trace"):
        dump_trace({"schema_version": 1}, tmp_path / "x.json")  # type: ignore[arg-type]


def test_public_names() -> None:
    assert attnres.dump_trace is dump_trace
    assert attnres.load_trace is load_trace
    assert issubclass(attnres.TraceFormatError, ValueError)


# =============================================================================
# Property: any input round-trips and replays
# =============================================================================

_BACKENDS = [
    "torch_sdpa",
    "eager",
    "fa",
    "fa3",
    "sage_attn",
    "xformers",
    "aiter",
    "ascend_fa",
    "torch_cudnn_sdpa",
    "dynamic_cudnn_sdpa",
    "flex_attention",
    "sliding_tile_attn",
    "video_sparse_attn",
]
_PLATFORMS = [
    "cpu",
    "cuda:sm90+all",
    "cuda:sm80+flash_attn",
    "cuda:sm75",
    "cuda:sm120+all",
    "rocm:gfx942+aiter",
    "rocm:gfx90a",
    "mps",
    "xpu",
    "npu+torch_npu",
]
_COMPONENTS = ["transformer", "audio_vae", "text_encoder_2", "motion_prior", "vocoder"]
_maybe_backend = st.none() | st.sampled_from(_BACKENDS)


@st.composite
def _inputs(draw: st.DrawFn) -> TraceInput:
    layer = LayerSpec(
        head_size=draw(st.sampled_from([32, 36, 64, 80, 128, 256])),
        dtype=draw(st.sampled_from(["float16", "bfloat16", "float32"])),
        supported=draw(st.none() | st.sets(st.sampled_from(_BACKENDS), min_size=1, max_size=3)),
        default=draw(_maybe_backend),
        role=draw(st.sampled_from(["self", "cross"])),
        requirements=draw(st.sets(st.sampled_from(["causal", "attn_mask", "packed_varlen"]))),
        name=draw(st.none() | st.sampled_from(["blocks.0.attn1", "ünïcode.attn"])),
    )
    config = SelectionConfig(
        global_backend=draw(_maybe_backend),
        global_backend_explicit=draw(st.booleans()),
        forced_backend=draw(st.none() | st.sampled_from(_BACKENDS))
        if draw(st.booleans())
        else None,
    )
    scope = None
    if draw(st.booleans()):
        roles = {"cross": draw(st.sampled_from(_BACKENDS))} if draw(st.booleans()) else None
        scope = scope_state(
            draw(st.sampled_from(_COMPONENTS)), backend=draw(_maybe_backend), role_backends=roles
        )
    platform = Platform.simulate(draw(st.sampled_from(_PLATFORMS)))
    return TraceInput(layer, config, scope, platform, draw(_maybe_backend))


@given(_inputs())
def test_any_trace_round_trips_and_replays(inp: TraceInput) -> None:
    trace = run_machine(inp)
    text = trace.to_json()
    loaded = trace_from_json(text)
    assert loaded == trace
    assert loaded.digest == trace.digest
    assert loaded.to_json() == text
    assert replay(loaded).ok


# =============================================================================
# Byte-identical across processes (hash seeds)
# =============================================================================

_WRITE_ALL = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from scenarios import SCENARIOS
    from attnres.trace import dump_trace
    out = Path(sys.argv[1])
    for s in SCENARIOS:
        dump_trace(s.run(), out / s.filename)
    """
)


@pytest.mark.slow
def test_same_input_gives_byte_identical_files_across_hash_seeds(tmp_path: Path) -> None:
    dirs = []
    for seed in ("0", "2718281828"):
        out = tmp_path / f"seed-{seed}"
        out.mkdir()
        subprocess.run(
            [sys.executable, "-c", _WRITE_ALL, str(out)],
            env=_subprocess_env(PYTHONHASHSEED=seed),
            check=True,
            timeout=120,
        )
        dirs.append(out)
    first, second = ({p.name: p.read_bytes() for p in d.iterdir()} for d in dirs)
    assert len(first) == len(SCENARIOS)
    assert first == second
    golden = ROOT / "traces"
    for name, data in first.items():
        assert (golden / name).read_bytes() == data, name


# =============================================================================
# Malformed files: TraceFormatError naming the file and a JSON path
# =============================================================================


def _edit(doc: dict[str, Any], path: list[Any], value: Any = ..., *, delete: bool = False) -> None:
    target = doc
    for step in path[:-1]:
        target = target[step]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value


def _seed_doc() -> dict[str, Any]:
    return trace_to_dict(SEED.run())


def _json(mutate: Callable[[dict[str, Any]], Any]) -> bytes:
    doc = _seed_doc()
    mutate(doc)
    return json.dumps(doc, indent=2).encode("utf-8")


def _seed_bytes() -> bytes:
    return SEED.render().encode("utf-8")


def _first_record_of(kind: str) -> int:
    return next(i for i, r in enumerate(_seed_doc()["records"]) if r["kind"] == kind)


MALFORMED: dict[str, tuple[Callable[[], bytes], str, str]] = {
    # case: (file content, JSON path named, a phrase of the message)
    "empty": (lambda: b"", "$", "empty"),
    "blank": (lambda: b"  \n\n", "$", "empty"),
    "truncated": (lambda: _seed_bytes()[: len(_seed_bytes()) // 2], "$", "truncated"),
    "not-json": (lambda: b"schema_version = 1\n", "$", "not valid JSON"),
    "top-level-list": (lambda: b"[]\n", "$", "must be a JSON object, got a list"),
    "top-level-string": (lambda: b'"trace"\n', "$", "must be a JSON object"),
    "missing-field": (
        lambda: _json(lambda d: _edit(d, ["input", "layer", "dtype"], delete=True)),
        "$.input.layer.dtype",
        "missing field",
    ),
    "missing-top-level-field": (
        lambda: _json(lambda d: _edit(d, ["outcome"], delete=True)),
        "$.outcome",
        "missing field",
    ),
    "missing-schema-version": (
        lambda: _json(lambda d: _edit(d, ["schema_version"], delete=True)),
        "$.schema_version",
        "missing field",
    ),
    "unexpected-field": (
        lambda: _json(lambda d: _edit(d, ["input", "platform", "pickle"], "gASVAAAA")),
        "$.input.platform.pickle",
        "unexpected field",
    ),
    "mistyped-head-size": (
        lambda: _json(lambda d: _edit(d, ["input", "layer", "head_size"], "64")),
        "$.input.layer.head_size",
        'expected an integer, got the string "64"',
    ),
    "mistyped-bool": (
        lambda: _json(lambda d: _edit(d, ["input", "config", "global_backend_explicit"], "false")),
        "$.input.config.global_backend_explicit",
        "expected true or false",
    ),
    "mistyped-capability": (
        lambda: _json(lambda d: _edit(d, ["input", "platform", "capability"], [9])),
        "$.input.platform.capability",
        "expected a list of 2 items",
    ),
    "mistyped-record-field": (
        lambda: _json(lambda d: _edit(d, ["records", 2, "passed"], 1)),
        "$.records[2].passed",
        "expected true or false",
    ),
    "records-not-a-list": (
        lambda: _json(lambda d: _edit(d, ["records"], {"0": {}})),
        "$.records",
        "expected a list",
    ),
    "unknown-record-kind": (
        lambda: _json(lambda d: _edit(d, ["records", 1, "kind"], "teleport")),
        "$.records[1].kind",
        'unknown record kind "teleport"',
    ),
    "record-without-kind": (
        lambda: _json(lambda d: _edit(d, ["records", 1, "kind"], delete=True)),
        "$.records[1].kind",
        "missing field",
    ),
    "unknown-backend": (
        lambda: _json(lambda d: _edit(d, ["input", "config", "global_backend"], "sage_atten")),
        "$.input.config.global_backend",
        "Unknown attention backend 'sage_atten'. Did you mean 'sage_attn'?",
    ),
    "unknown-backend-in-record": (
        lambda: _json(lambda d: _edit(d, ["records", 2, "candidate"], "turbo_attn")),
        "$.records[2].candidate",
        "Unknown attention backend 'turbo_attn'",
    ),
    "unknown-backend-in-supported-set": (
        lambda: _json(lambda d: _edit(d, ["input", "layer", "supported", 1], "flash3")),
        "$.input.layer.supported[1]",
        "Unknown attention backend 'flash3'",
    ),
    "unknown-platform-kind": (
        lambda: _json(lambda d: _edit(d, ["input", "platform", "kind"], "tpu")),
        "$.input.platform.kind",
        'unknown platform kind "tpu"',
    ),
    "unknown-state": (
        lambda: _json(lambda d: _edit(d, ["records", 1, "target"], "limbo")),
        "$.records[1].target",
        'unknown state "limbo"',
    ),
    "unknown-reason": (
        lambda: _json(lambda d: _edit(d, ["outcome", "reason"], "because")),
        "$.outcome.reason",
        'unknown reason "because"',
    ),
    "newer-schema-version": (
        lambda: _json(lambda d: _edit(d, ["schema_version"], SCHEMA_VERSION + 1)),
        "$.schema_version",
        f"schema version {SCHEMA_VERSION + 1} is newer",
    ),
    "schema-version-zero": (
        lambda: _json(lambda d: _edit(d, ["schema_version"], 0)),
        "$.schema_version",
        "unsupported schema version 0",
    ),
    "digest-mismatch-after-hand-edit": (
        lambda: _seed_bytes().replace(b'"decoder.mid.attn"', b'"decoder.mid.attn_0"'),
        "$.digest",
        "does not match the content",
    ),
    "hand-edited-outcome": (
        lambda: _seed_bytes().replace(
            b'"backend": "torch_sdpa",\n    "code"', b'"backend": "fa",\n    "code"'
        ),
        "$.digest",
        "edited by hand",
    ),
    "digest-not-hex": (
        lambda: _json(lambda d: _edit(d, ["digest"], "sha256:abc")),
        "$.digest",
        "expected a SHA-256 hex digest",
    ),
    "non-utf8-bytes": (
        lambda: _seed_bytes().replace(b"decoder.mid.attn", b"decoder.mid.\xff\xfe"),
        "$",
        "not UTF-8 text (byte 0xff",
    ),
    "duplicate-key": (
        lambda: _seed_bytes().replace(b'  "digest"', b'  "outcome": null,\n  "digest"', 1),
        "$",
        'duplicate key "outcome"',
    ),
    "nan": (
        lambda: _json(lambda d: _edit(d, ["input", "layer", "head_size"], 1)).replace(
            b'"head_size": 1', b'"head_size": NaN'
        ),
        "$",
        "NaN is not valid JSON",
    ),
    "deeply-nested": (lambda: b"[" * 100_000 + b"]" * 100_000, "$", "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_is_a_trace_format_error(case: str, tmp_path: Path) -> None:
    make, where, phrase = MALFORMED[case]
    path = tmp_path / f"{case}.json"
    path.write_bytes(make())
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    exc = info.value
    message = str(exc)
    assert isinstance(exc, ValueError)
    assert message.startswith(f"{path}: {where}: "), message
    assert phrase in message, message
    assert "\n" not in message
    assert exc.path == str(path)
    assert exc.where == where
    # replay reports the same error, and nothing is half-loaded
    with pytest.raises(TraceFormatError):
        replay(path)


def test_missing_file_and_folder_are_trace_format_errors(tmp_path: Path) -> None:
    for path in (tmp_path / "absent.json", tmp_path):
        with pytest.raises(TraceFormatError, match="cannot read the trace file") as info:
            load_trace(path)
        assert str(info.value).startswith(f"{path}: ")
        assert info.value.path == str(path)


def test_trace_from_dict_names_its_source() -> None:
    with pytest.raises(TraceFormatError, match=r"^explain --json: \$: a trace must be"):
        trace_from_dict([], source="explain --json")


def test_every_closed_vocabulary_is_checked(seed_trace: Trace) -> None:
    doc = trace_to_dict(seed_trace)
    check = _first_record_of("check")
    cases: list[tuple[list[Any], Any, str]] = [
        (["records", check, "check"], "vibes", "unknown check"),
        (["records", check, "stage"], "selected!", "unknown state"),
        (["records", 0, "origin"], "cli", "unknown origin"),
        (["records", 1, "event"], "teleported", "unknown event"),
        (["outcome", "status"], "maybe", "unknown outcome status"),
        (["input", "platform", "packages", 0, "status"], "half", "unknown package status"),
        (["input", "layer", "role"], "both", "unknown role"),
        (["input", "layer", "dtype"], "int4", "unknown dtype"),
        (["input", "layer", "head_size"], 0, "at least 1"),
        (["input", "layer", "supported"], [], "empty supported set"),
    ]
    for path, value, phrase in cases:
        bad = json.loads(json.dumps(doc))
        _edit(bad, path, value)
        with pytest.raises(TraceFormatError, match=phrase) as info:
            trace_from_dict(bad, source="x.json")
        where = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        assert info.value.where == where
        assert str(info.value).startswith(f"x.json: {where}: ")
    bad = json.loads(json.dumps(doc))
    bad["input"]["scope"]["role_backends"] = {"diagonal": "fa"}
    with pytest.raises(TraceFormatError, match="unknown role") as info:
        trace_from_dict(bad, source="x.json")
    assert info.value.where == "$.input.scope.role_backends.diagonal"


# =============================================================================
# Security: loading and replaying is reading data
# =============================================================================

_SENTINEL = textwrap.dedent(
    """
    import os
    with open(os.environ["ATTNRES_SENTINEL_MARK"], "a") as fh:
        fh.write("imported\\n")
    def main(*args, **kwargs):
        return None
    class Loader:
        pass
    """
)

_PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from attnres import TraceFormatError
    from attnres.backends import Backend, registered_backends
    from attnres.replayer import replay
    from attnres.trace import load_trace

    warmup, hostile = Path(sys.argv[1]), sorted(Path(sys.argv[2]).iterdir())
    registered_backends()                     # entry-point plugins: the registry's own
    replay(warmup)                            # warm every code path a valid trace uses
    for bad in ("sage_atten", "x:y"):
        try:
            Backend.parse(bad)
        except ValueError:
            pass
    before = set(sys.modules)
    outcome = {}
    for path in hostile:
        try:
            outcome[path.name] = "ok" if replay(path).ok else "diff"
        except TraceFormatError as exc:
            outcome[path.name] = "error: " + str(exc)
    print(json.dumps({"new_modules": sorted(set(sys.modules) - before), "outcome": outcome}))
    """
)


def _hostile_files(folder: Path) -> dict[str, str]:
    """Hostile traces, and what loading each must give ('ok' or an error phrase)."""
    folder.mkdir()
    base = _seed_doc()
    expected: dict[str, str] = {}

    def bad(name: str, path: list[Any], value: Any, phrase: str) -> None:
        doc = json.loads(json.dumps(base))
        _edit(doc, path, value)
        (folder / f"{name}.json").write_text(json.dumps(doc), encoding="utf-8")
        expected[f"{name}.json"] = phrase

    for i, name in enumerate(
        [
            "os:system",
            "subprocess.Popen",
            "attnres_sentinel:main",
            "attnres_sentinel.main",
            "__import__('attnres_sentinel')",
            "../attnres_sentinel",
        ]
    ):
        bad(f"backend-{i}", ["input", "config", "global_backend"], name, "is not a backend name")
    bad(
        "backend-module-name",
        ["input", "layer", "default"],
        "attnres_sentinel",
        "Unknown attention backend 'attnres_sentinel'",
    )
    bad("record-kind-eval", ["records", 0, "kind"], "builtins.eval", "unknown record kind")
    bad(
        "record-kind-module",
        ["records", 0, "kind"],
        "attnres_sentinel.Record",
        "unknown record kind",
    )
    bad(
        "platform-kind-module",
        ["input", "platform", "kind"],
        "attnres_sentinel",
        "unknown platform kind",
    )
    bad("pickle-field", ["input", "platform", "__reduce__"], "attnres_sentinel", "unexpected field")

    # Loadable traces whose free-text fields name the sentinel: data, never imported.
    scope = attrs.evolve(
        scope_state("audio_vae"), kind="attnres_sentinel", loader="attnres_sentinel:Loader"
    )
    platform = attrs.evolve(
        Platform.simulate("cuda:sm90+all"),
        device_name="__import__('attnres_sentinel')",
        packages=(
            *Platform.simulate("cuda:sm90+all").packages,
            PackageFact("attnres_sentinel", "present", "1.0", None),
        ),
        notes=("attnres_sentinel:main",),
    )
    inp = attrs.evolve(SEED.input(), scope=scope, platform=platform)
    dump_trace(run_machine(inp), folder / "loadable-names-sentinel.json")
    expected["loadable-names-sentinel.json"] = "ok"
    return expected


@pytest.mark.slow
def test_hostile_traces_import_nothing(tmp_path: Path, seed_file: Path) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "attnres_sentinel.py").write_text(_SENTINEL, encoding="utf-8")
    mark = tmp_path / "imported.mark"
    expected = _hostile_files(tmp_path / "hostile")

    env = _subprocess_env(ATTNRES_SENTINEL_MARK=str(mark))
    env["PYTHONPATH"] = os.pathsep.join([str(modules), env["PYTHONPATH"]])
    # the sentinel works: importing it leaves the mark
    subprocess.run([sys.executable, "-c", "import attnres_sentinel"], env=env, check=True)
    assert mark.read_text() == "imported\n"
    mark.unlink()

    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(seed_file), str(tmp_path / "hostile")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert not mark.exists(), "a hostile trace imported the sentinel module"
    assert report["new_modules"] == []
    for name, phrase in expected.items():
        got = report["outcome"][name]
        if phrase == "ok":
            assert got == "ok", got
        else:
            assert got.startswith("error: ") and phrase in got, (name, got)
            assert str(tmp_path / "hostile" / name) in got


def test_key_lists_come_from_the_attrs_classes_and_match_what_is_written(
    seed_trace: Trace,
) -> None:
    """One source for the codec's field lists: the writer writes every field of the
    attrs class, and the loader requires each one it wrote (by its JSON path)."""
    from attnres import plan
    from attnres._codec import field_names
    from attnres.layer import LayerSpec, SelectionConfig
    from attnres.scope import ScopeState

    doc = trace_to_dict(seed_trace)
    assert seed_trace.input.scope is not None
    for key, cls in (("layer", LayerSpec), ("config", SelectionConfig), ("scope", ScopeState)):
        written = doc["input"][key]
        assert set(written) == set(field_names(cls))
        for name in field_names(cls):
            broken = json.loads(json.dumps(doc))
            del broken["input"][key][name]
            with pytest.raises(TraceFormatError) as err:
                trace_from_dict(broken, source="t.json")
            assert err.value.where == f"$.input.{key}.{name}"
            assert "missing field" in str(err.value)
    # the pipeline format names the same layer fields (requirements as "requires")
    spec_fields = set(field_names(LayerSpec)) - {"requirements"} | {"requires"}
    assert spec_fields <= set(plan._LAYER_KEYS)
    assert set(plan._LAYER_KEYS) - spec_fields == {"count", "backend"}


def test_exact_route_is_in_the_trace_only_when_set_and_replays() -> None:
    # LayerSpec.exact_route (issue 21): an integration route's exactness is part
    # of the machine's input; absent when unset, so older traces keep their bytes
    route = "transformers attention interface"
    cuda = Platform.simulate("cuda:sm90")
    layer = LayerSpec(64, "bf16", supported={"torch_sdpa"}, exact_route=route)
    trace = _rejected_trace(layer, cuda)
    doc = trace_to_dict(trace)
    assert doc["input"]["layer"]["exact_route"] == route
    again = trace_from_dict(json.loads(json.dumps(doc)))
    assert again.digest == trace.digest and run_machine(again.input) == trace
    plain = attnres.resolve(attrs.evolve(layer, exact_route=None), platform=cuda).trace
    assert "exact_route" not in trace_to_dict(plain)["input"]["layer"]
    doc["input"]["layer"]["supported"] = None
    with pytest.raises(TraceFormatError, match=r"exact_route.*needs a supported set"):
        trace_from_dict(doc)
    with pytest.raises(ValueError, match="exact_route: route 'r' runs exactly"):
        LayerSpec(64, "bf16", exact_route="r")


def _rejected_trace(layer: LayerSpec, platform: Platform) -> Trace:
    with pytest.raises(attnres.ResolutionError) as info:
        attnres.resolve(layer, platform=platform, backend="torch_cudnn_sdpa")
    return info.value.trace
