"""Work the CLI used to do itself now lives in the library (issue 12 section 5)."""

from __future__ import annotations

import pytest

from attnres.documents import environment_document
from attnres.explain import autotune_plan, resolution_trace
from attnres.layer import ENV_VAR, LayerSpec, SelectionConfig
from attnres.platform import Platform


def test_environment_document_says_unset_set_and_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert environment_document()["status"] == "unset"
    monkeypatch.setenv(ENV_VAR, "SDPA")
    doc = environment_document()
    assert (doc["status"], doc["backend"], doc["error"]) == ("set", "torch_sdpa", None)
    monkeypatch.setenv(ENV_VAR, "no_such_kernel")
    doc = environment_document()
    assert doc["status"] == "invalid" and "no_such_kernel" in doc["error"]


def test_autotune_plan_is_none_unless_the_config_tunes() -> None:
    trace = resolution_trace(
        LayerSpec(64, "float16"), SelectionConfig(), Platform.simulate("cuda:sm90+all")
    )
    assert autotune_plan(trace, SelectionConfig()) is None
    plan = autotune_plan(trace, SelectionConfig(autotune=True))
    assert plan is not None and plan["tunable"] is True


def test_platform_device_is_describe_without_the_simulated_mark() -> None:
    plat = Platform.simulate("cuda:sm90")
    assert plat.device() == "cuda sm90"
    assert plat.describe() == "cuda sm90 (simulated)"
