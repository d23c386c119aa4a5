"""Shared test configuration.

- ``--update-golden`` regenerates the golden traces in ``traces/`` (``make golden``).
- Hypothesis profiles: ``default`` (bounded, for ``make test``) and ``deep``
  (``make test-deep``), chosen by ``HYPOTHESIS_PROFILE``.
- Every test starts with an empty decision ledger and resolution cache, and the
  process-wide selection config restored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

import attnres
from attnres.runtime import set_selection_config

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
