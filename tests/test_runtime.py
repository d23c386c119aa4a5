"""The runtime around the machine (``attnres.runtime``): typed errors, one cache."""

from __future__ import annotations

import pytest

from attnres import BackendSpec, LayerSpec, Platform, register_backend, resolve
from attnres import runtime as runtime_mod
from attnres._states import Code
from attnres.backends import unregister_backend
from attnres.errors import ResolutionError
from attnres.trace import Trace

CPU = Platform.simulate("cpu")


def test_resolution_error_code_is_a_code_like_the_outcomes() -> None:
    with pytest.raises(ResolutionError) as info:
        resolve(LayerSpec(head_size=16, dtype="float32"), platform=CPU, backend="fa")
    error = info.value
    assert isinstance(error.code, Code)
    assert error.code is error.trace.outcome.code


def test_the_resolution_cache_follows_the_registry_generation() -> None:
    spec = LayerSpec(head_size=16, dtype="float32", name="cached")
    resolve(spec, platform=CPU)
    assert runtime_mod.cache_info()["size"] >= 1
    register_backend(
        BackendSpec(name="rt_extra", sparse=False, platforms=("cuda",), dtypes=("float16",))
    )
    try:
        assert runtime_mod.cache_info()["size"] == 0
    finally:
        unregister_backend("rt_extra")


# -- issue 23: a trace the caller computed (the SGLang plugin's cold path) -----------


def _computed() -> tuple[int, Trace]:
    from attnres.backends import registry_generation
    from attnres.layer import SelectionConfig
    from attnres.machine import run_machine
    from attnres.trace import TraceInput

    runtime_mod.clear_cache()
    inp = TraceInput(LayerSpec(64, "bf16"), SelectionConfig(), None, Platform("cpu"), None)
    generation = registry_generation()
    return generation, run_machine(inp)


def test_lookup_traced_caches_and_audits_the_callers_trace_without_running_it_again() -> None:
    import structlog
    from structlog.testing import capture_logs

    generation, trace = _computed()
    try:
        with capture_logs() as logs:
            resolution, decision, traced = runtime_mod.lookup_traced(trace, generation)
    finally:
        structlog.reset_defaults()
    assert traced is trace and decision.trace is trace  # the caller's run, not a second one
    assert resolution is not None and resolution.backend == trace.outcome.backend
    assert [e["event"] for e in logs][-1] == "attention backend selected"
    inp = trace.input
    hit = runtime_mod.lookup(inp.layer, inp.config, inp.scope, inp.platform, None)
    assert hit[2] is trace  # cached exactly where lookup() looks
    runtime_mod.clear_cache()
    fresh = runtime_mod.lookup(inp.layer, inp.config, inp.scope, inp.platform, None)
    assert fresh[2].digest == trace.digest


def test_lookup_traced_caches_nothing_when_the_registry_changed_since_the_run() -> None:
    from attnres.backends import kernels_changed

    generation, trace = _computed()
    kernels_changed()  # a registration change between the machine's run and the store
    _, decision, _ = runtime_mod.lookup_traced(trace, generation)
    assert decision.trace is trace
    assert runtime_mod.cache_info()["size"] == 0
