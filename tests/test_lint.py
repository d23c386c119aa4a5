"""The definition of done holds ruff and mypy --strict clean on src/: CI checks it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_ruff_is_clean_on_src_tests_and_benchmarks() -> None:
    proc = _run("ruff", "check", "src", "tests", "benchmarks", "scripts")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_strict_is_clean_on_src() -> None:
    proc = _run("mypy", "src")  # strict = true in pyproject.toml
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout
