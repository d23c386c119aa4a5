"""Shared test configuration.

- ``--update-golden`` regenerates the golden traces in ``traces/`` (``make golden``).
- Hypothesis profiles: ``default`` (bounded, for ``make test``) and ``deep``
  (``make test-deep``), chosen by ``HYPOTHESIS_PROFILE``.
- Every test starts with an empty decision ledger and resolution cache, and the
  process-wide selection config restored.
- The CLI's text is 100 columns wide in every test process (``COLUMNS``; a test
  of another width sets its own), so a transcript wraps alike with and without
  pytest-xdist, whose workers would otherwise see 80.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import attnres
from attnres.runtime import set_selection_config

os.environ["COLUMNS"] = "100"

settings.register_profile(
    "default",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "deep",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

#: tests/sglang/ and tests/vllm_omni/ need their engine's own environment: `make test-sglang`
#: and `make test-vllm-omni` run them, `make test` never
collect_ignore = ["sglang", "vllm_omni"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="regenerate the golden trace files in traces/ and print what changed",
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(autouse=True)
def _fresh_attnres_state() -> Iterator[None]:
    attnres.clear_decisions()
    attnres.clear_cache()
    previous = set_selection_config(attnres.SelectionConfig())
    yield
    set_selection_config(previous)
    attnres.clear_decisions()
    attnres.clear_cache()


@pytest.fixture
def varlen_fakes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Issue 22: fakes of flash_attn, flash_attn.cute (FA4), flash_attn_interface,
    sageattention and aiter with their real varlen signatures (tests/test_masks.py),
    installed for one test; yields the ``Calls`` record every fake appends to."""
    from test_kernels_fakes import Calls, fake_flash_attn
    from test_masks import fake_aiter_varlen, fake_fa3, fake_fa4, fake_sage

    from attnres._varlen import clear_varlen_cache
    from attnres.kernels import clear_kernel_cache

    calls = Calls()
    for name in list(sys.modules):
        if name.split(".")[0] in (
            "flash_attn", "flash_attn_interface", "sageattention", "aiter",
        ):  # fmt: skip
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn(calls))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake_fa4(calls))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3(calls))
    monkeypatch.setitem(sys.modules, "sageattention", fake_sage(calls))
    monkeypatch.setitem(sys.modules, "aiter", fake_aiter_varlen(calls))
    clear_kernel_cache()
    clear_varlen_cache()
    yield calls
    clear_kernel_cache()
    clear_varlen_cache()


#: tests/kernels/ needs the kernel distributions downloaded by `make test-kernels`,
#: which runs it (with ATTNRES_KERNEL_DISTS set); `make test` does not collect it
if not os.environ.get("ATTNRES_KERNEL_DISTS"):
    collect_ignore.append("kernels")
