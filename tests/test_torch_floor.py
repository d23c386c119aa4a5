"""The torch floor (attnres._torch_floor): declared once, tested (make test-floor),
refused below at import with the versions named."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from attnres._torch_floor import MIN_TORCH, check_torch, installed_torch
from attnres.errors import AttnresError, UnsupportedVersionError

ROOT = Path(__file__).resolve().parents[1]
FLOOR = f"{MIN_TORCH[0]}.{MIN_TORCH[1]}"


def test_pyproject_declares_the_floor_attnres_checks() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    declared = [d for d in project["project"]["dependencies"] if d.startswith("torch")]
    assert declared == [f"torch>={FLOOR}"]


def test_the_makefile_tests_the_floor_it_declares() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert f"FLOOR_TORCH_SPEC ?= torch=={FLOOR}.0\n" in makefile


def test_the_torch_running_this_suite_is_admitted() -> None:
    import torch

    assert installed_torch() == torch.__version__
    check_torch()


@pytest.mark.parametrize("version", [f"{FLOOR}.0", f"{FLOOR}.0+cu124", "2.13.0", "3.0.0a0"])
def test_the_floor_and_newer_are_admitted(version: str) -> None:
    check_torch(version)


@pytest.mark.parametrize("version", ["2.5.1", "2.5.1+cpu", "2.0.0", "1.13.1"])
def test_an_older_torch_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(UnsupportedVersionError) as info:
        check_torch(version)
    assert isinstance(info.value, AttnresError) and isinstance(info.value, ImportError)
    assert (info.value.package, info.value.installed, info.value.supported) == (
        "torch",
        version,
        f">={FLOOR}",
    )
    message = str(info.value)
    assert f"needs torch>={FLOOR}" in message and f"torch {version} is installed" in message
    assert f"pip install 'torch>={FLOOR}'" in message


def test_import_attnres_refuses_an_older_torch() -> None:
    # a torch already imported at 2.5.1 (as after pip install --no-deps on an old one)
    code = (
        "import sys, types\n"
        "sys.modules['torch'] = types.SimpleNamespace(__version__='2.5.1')\n"
        "try:\n"
        "    import attnres\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert run.stdout.startswith("UnsupportedVersionError attnres needs torch>=")
    assert "torch 2.5.1 is installed" in run.stdout
