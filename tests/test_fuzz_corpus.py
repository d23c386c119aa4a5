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
    assert targets == {"trace", "replay", "pipeline", "folder", "config", "header", "results"}
    for name in targets:
        assert any((CORPUS / name).iterdir()), name
    makefile = (ROOT / "Makefile").read_text()
    assert (
        "FUZZ_TARGETS ?= "
        + " ".join(["trace", "replay", "pipeline", "folder", "config", "header", "results"])
        in makefile
    )


@pytest.mark.parametrize(
    "path",
    sorted(p for p in CORPUS.rglob("*") if p.is_file()),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_the_corpus_replays_without_a_crash(path: Path) -> None:
    fuzz = _module()
    target = fuzz.TARGETS[path.parent.name]  # type: ignore[attr-defined]
    fuzz.run_one(target, path.read_bytes())  # type: ignore[attr-defined]
