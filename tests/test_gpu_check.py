"""``make gpu-check`` (scripts/gpu_check.py, issue 31): the no-GPU path says what it
would run and exits 0; its checks run on the CPU for the torch backends, so the
script the first GPU runs is exercised here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_what_it_would_run(
    gpu_check: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "no CUDA GPU on this machine" in text and "it would run" in text
    for line in (
        "fa (needs package flash_attn): forward (plain, causal, gqa); backward; varlen; lse; "
        "options deterministic; key-padding gather route vs packed tokens (cost)",
        "sage_attn (needs package sageattention)",
        "generic route: attnres.Attention per-call cost",
        "NCCL (2+ GPUs): verify_consensus",
        "(skipped with a note on 1 GPU)",
        "torch_cudnn_sdpa: forward (plain, causal, gqa); backward; lse; call-time refusals",
    ):
        assert line in text
    assert "ascend_fa" not in text and "aiter" not in text  # no CUDA kernel
    assert not out.exists()  # nothing written without a GPU
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    assert "--dry-run" in capsys.readouterr().out


def test_its_checks_run_and_pass_for_torch_sdpa_on_cpu(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same checks, on the CPU, for torch_sdpa: forward, GQA, backward and lse
    against the float64 reference all pass; a wrong reference fails them."""
    from attnres.backends import get_spec
    from attnres.platform import Platform

    monkeypatch.setattr(gpu_check, "_DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "_SHAPE", (1, 32, 4, 16))
    monkeypatch.setattr(gpu_check, "_TIMED_CALLS", 1)
    platform = Platform.simulate("cpu")
    report = gpu_check._Report(60.0)
    gpu_check._check_backend(report, get_spec("torch_sdpa"), platform)
    by_check: dict[tuple[str, str], dict[str, Any]] = {
        (c["backend"], c["check"]): c for c in report.checks
    }
    for check in ("forward", "forward causal", "forward gqa", "backward", "lse"):
        assert by_check[("torch_sdpa", check)]["status"] == "pass", by_check[("torch_sdpa", check)]
    monkeypatch.setattr(gpu_check, "_reference", lambda q, k, v, causal: (q.double() * 2, None))
    broken = gpu_check._Report(60.0)
    gpu_check._check_backend(broken, get_spec("torch_sdpa"), platform)
    assert {c["status"] for c in broken.checks if c["check"] == "forward"} == {"fail"}
    text = gpu_check._summary({"device": "cpu", "seconds": 1.0, "checks": broken.checks})
    assert "fail    torch_sdpa: forward" in text


def test_the_cudnn_refusal_check_holds_the_adapter_to_the_catalogue(
    gpu_check: ModuleType,
) -> None:
    """Issue 31: on a GPU, the check confirms torch's own refusal (seq_kv == 1,
    deterministic mode) and the adapter's KernelRefusedError; an adapter that let
    the call through fails it. (On this CPU torch refuses every cuDNN call.)"""
    import torch

    from attnres.kernels import get_kernel

    def tensors() -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(1, 4, 2, 16, dtype=torch.float16) for _ in range(3))

    result = gpu_check._cudnn_refusals(get_kernel("torch_cudnn_sdpa"), tensors)
    assert result["status"] == "pass", result
    assert result["seq_kv_1"] == {"torch": True, "adapter": True}
    assert not torch.are_deterministic_algorithms_enabled()  # restored
    lax = gpu_check._cudnn_refusals(get_kernel("torch_sdpa"), tensors)
    assert lax["status"] == "fail" and lax["seq_kv_1"]["adapter"] is False
