"""Issue 20: the fuzz targets (fuzz/fuzz_attnres.py, ``make fuzz``) stay runnable,
and every input in their corpus -- the seeds, and every crash fuzzing found,
saved there as ``crash-*`` -- is answered by each loader with attnres's own
input error or a result, never anything else. Runs without atheris."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "fuzz" / "corpus"


def _module() -> object:
    spec = importlib.util.spec_from_file_location("fuzz_attnres", ROOT / "fuzz" / "fuzz_attnres.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_attnres", module)
    spec.loader.exec_module(module)
    return module


def test_every_loader_has_a_target_and_a_seed_corpus() -> None:
    fuzz = _module()
    targets = set(fuzz.TARGETS)  # type: ignore[attr-defined]
    # issue 32: what 0.3 parses has a target too
    names = ["trace", "replay", "pipeline", "folder", "config", "header", "results",
             "cli", "option", "schedule", "layout", "platform", "dtype"]  # fmt: skip
    assert targets == set(names) == set(fuzz.ERRORS)  # type: ignore[attr-defined]
    for name in targets:
        assert any((CORPUS / name).iterdir()), name
    makefile = (ROOT / "Makefile").read_text()
    assert "FUZZ_TARGETS ?= " + " ".join(names) in makefile


def test_a_target_accepts_only_its_documented_error() -> None:
    """Issue 32: not any ValueError: Python's own (int() of a huge or a non-ASCII
    number) or another type is a crash."""
    fuzz = _module()

    def raises(exc: BaseException) -> object:
        def target(data: bytes) -> None:
            raise exc

        return target

    from attnres.errors import PipelineError, TraceFormatError

    targets = fuzz.TARGETS  # type: ignore[attr-defined]
    saved = dict(targets)
    try:
        targets["trace"] = raises(TraceFormatError("t.json: $: bad"))
        fuzz.run_one(targets["trace"], b"")  # type: ignore[attr-defined]
        for exc in (
            PipelineError("p", path="p"),
            ValueError("plain"),
            ValueError("invalid literal for int() with base 10: '\u00b2'"),
            UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
        ):
            targets["trace"] = raises(exc)
            with pytest.raises(type(exc)):
                fuzz.run_one(targets["trace"], b"")  # type: ignore[attr-defined]
        targets["schedule"] = raises(ValueError("Exceeds the limit (4300 digits)"))
        with pytest.raises(ValueError):
            fuzz.run_one(targets["schedule"], b"")  # type: ignore[attr-defined]
        # the parsers whose docs say "any other bad value": InvalidArgumentError,
        # not a plain ValueError (which these targets used to accept)
        from attnres.errors import InvalidArgumentError, UnknownBackendError

        for name in ("schedule", "platform", "dtype"):
            targets[name] = raises(InvalidArgumentError(f"--{name}: bad"))
            fuzz.run_one(targets[name], b"")  # type: ignore[attr-defined]
            for exc in (ValueError("plain"), ValueError("math domain error")):
                targets[name] = raises(exc)
                with pytest.raises(ValueError):
                    fuzz.run_one(targets[name], b"")  # type: ignore[attr-defined]
        targets["schedule"] = raises(UnknownBackendError("step 0: nope", "nope", None))
        fuzz.run_one(targets["schedule"], b"")  # type: ignore[attr-defined]
    finally:
        targets.clear()
        targets.update(saved)


@pytest.mark.parametrize(
    "path",
    sorted(p for p in CORPUS.rglob("*") if p.is_file()),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_the_corpus_replays_without_a_crash(path: Path) -> None:
    fuzz = _module()
    target = fuzz.TARGETS[path.parent.name]  # type: ignore[attr-defined]
    fuzz.run_one(target, path.read_bytes())  # type: ignore[attr-defined]
