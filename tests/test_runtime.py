"""The runtime around the machine (``attnres.runtime``): typed errors, one cache."""

from __future__ import annotations

import pytest

from attnres import BackendSpec, LayerSpec, Platform, register_backend, resolve
from attnres import runtime as runtime_mod
from attnres._states import Code
from attnres.backends import unregister_backend
from attnres.errors import ResolutionError

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
