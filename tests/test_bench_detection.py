"""``make bench`` on a machine without SGLang (issue 32 item 19)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench_sglang() -> object:
    spec = importlib.util.spec_from_file_location(
        "_bench_sglang", ROOT / "benchmarks" / "bench_sglang.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None
    and getattr(importlib.util.find_spec("sglang"), "origin", None) is not None,
    reason="SGLang is installed here",
)
def test_bench_sglang_detection_ignores_the_tests_sglang_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With tests/ on the path (pytest's rootdir insertion), tests/sglang is found as
    a namespace package; the benchmark must not take it for SGLang."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    importlib.invalidate_caches()
    assert importlib.util.find_spec("sglang") is not None  # the folder, as a namespace
    bench = _bench_sglang()
    assert bench.HAVE_SGLANG is False  # type: ignore[attr-defined]
    assert bench.have_sglang() is False  # type: ignore[attr-defined]


def test_bench_sglang_detection_ignores_any_namespace_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sglang").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    importlib.invalidate_caches()
    assert _bench_sglang().have_sglang() is False  # type: ignore[attr-defined]
    (tmp_path / "sglang" / "__init__.py").write_text("")  # a real package: found
    importlib.invalidate_caches()
    assert _bench_sglang().have_sglang() is True  # type: ignore[attr-defined]
