"""One invalidation for every cache (issue 21 section 3; issue 23 item 4).

Every cache of specs, kernels, closures, per-request and training bindings,
platform probes and measurements is cleared by, or keyed on, the one registry
generation: a backend or kernel registered, replaced or removed -- or
``clear_kernel_cache()`` -- never leaves a stale answer to be served.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
import torch
from torch import Tensor

from attnres import (
    Attention,
    BackendSpec,
    Platform,
    register_backend,
    request_backend,
    unregister_backend,
)
from attnres.errors import UnknownBackendError
from attnres.kernels import (
    clear_kernel_cache,
    get_kernel,
    register_kernel,
    unregister_kernel,
)
from attnres.modules import KernelNotRegisteredError
from attnres.platform import detected_platform

CPU = Platform.simulate("cpu")
_SDPA = get_kernel("torch_sdpa")
assert _SDPA is not None
CALLS: list[str] = []


def _kernel(label: str) -> Callable[..., Tensor]:
    def kernel(q, k, v, attn_mask, causal, scale):  # type: ignore[no-untyped-def]
        CALLS.append(label)
        assert _SDPA is not None
        return _SDPA(q, k, v, attn_mask, causal, scale)

    kernel.__qualname__ = f"kernel_{label}"
    return kernel


KA, KB = _kernel("a"), _kernel("b")
FAKE = types.ModuleType("attnres_i21_fake_kernels")
FAKE.make_a = lambda: KA  # type: ignore[attr-defined]
FAKE.make_b = lambda: KB  # type: ignore[attr-defined]
FAKE.current = KA  # type: ignore[attr-defined]
FAKE.make_current = lambda: FAKE.current  # type: ignore[attr-defined]


def _spec(name: str, **kwargs: object) -> BackendSpec:
    kwargs.setdefault("implements", ("backward",))
    return BackendSpec(
        name=name,
        sparse=False,
        platforms=("cpu",),
        dtypes=("float32",),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(autouse=True)
def fake_module() -> Iterator[None]:
    sys.modules[FAKE.__name__] = FAKE
    FAKE.current = KA  # type: ignore[attr-defined]
    CALLS.clear()
    names: list[str] = []
    yield
    sys.modules.pop(FAKE.__name__, None)
    for name in ("inv_x", "inv_a", "inv_b", "inv_req", "inv_nobwd", "inv_bwd", "inv_pkg"):
        with contextlib.suppress(ValueError, KeyError):
            unregister_backend(name)
        unregister_kernel(name)
    del names


def _layer(**kwargs: object) -> Attention:
    return Attention(2, 16, dtype=torch.float32, platform=CPU, **kwargs)  # type: ignore[arg-type]


def _qkv(grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(torch.randn(1, 4, 2, 16, requires_grad=grad) for _ in range(3))  # type: ignore[return-value]


def test_replacing_a_backend_spec_serves_its_new_kernel() -> None:
    spec = _spec("inv_x", kernel=f"{FAKE.__name__}:make_a")
    register_backend(spec)
    assert inspect.unwrap(_layer(backend="inv_x").kernel) is KA
    register_backend(attrs.evolve(spec, kernel=f"{FAKE.__name__}:make_b"), replace=True)
    assert inspect.unwrap(_layer(backend="inv_x").kernel) is KB


def test_clear_kernel_cache_reaches_layers_built_afterwards() -> None:
    register_backend(_spec("inv_x", kernel=f"{FAKE.__name__}:make_current"))
    before = _layer(backend="inv_x", name="before")
    assert inspect.unwrap(before.kernel) is KA
    FAKE.current = KB  # type: ignore[attr-defined]  # the package was reinstalled
    clear_kernel_cache()
    assert inspect.unwrap(_layer(backend="inv_x", name="after").kernel) is KB
    assert inspect.unwrap(before.kernel) is KA  # a layer keeps the kernel it bound


def test_a_layer_built_after_an_alias_moved_follows_it() -> None:
    register_backend(_spec("inv_a", aliases=("inv_fast",)))
    register_kernel("inv_a", KA)
    register_kernel("inv_b", KB)
    assert _layer(default="inv_fast").backend.name == "inv_a"  # type: ignore[union-attr]
    unregister_backend("inv_a")
    register_backend(_spec("inv_b", aliases=("inv_fast",)))
    layer = _layer(default="inv_fast")
    assert layer.backend.name == "inv_b"  # type: ignore[union-attr]
    assert inspect.unwrap(layer.kernel) is KB


def test_a_replaced_kernel_reaches_the_prepared_request_bindings() -> None:
    register_backend(_spec("inv_req"))
    register_kernel("inv_req", KA)
    layer = _layer()
    q, k, v = _qkv()
    with request_backend(layer, "inv_req"):
        assert inspect.unwrap(layer.kernel) is KA
        layer(q, k, v)
    register_kernel("inv_req", KB, replace=True)
    with request_backend(layer, "inv_req"):
        assert inspect.unwrap(layer.kernel) is KB
        layer(q, k, v)
    assert CALLS == ["a", "b"]


def test_a_replaced_kernel_reaches_the_training_binding() -> None:
    register_backend(_spec("inv_nobwd", implements=()))
    register_backend(_spec("inv_bwd"))
    register_kernel("inv_nobwd", _kernel("inference"))
    register_kernel("inv_bwd", KA)
    layer = _layer(supported={"inv_nobwd", "inv_bwd"}, default="inv_nobwd")
    assert layer.backend.name == "inv_nobwd"  # type: ignore[union-attr]
    layer(*_qkv(grad=True))
    assert layer.backward_resolution.backend.name == "inv_bwd"  # type: ignore[union-attr]
    register_kernel("inv_bwd", KB, replace=True)
    layer(*_qkv(grad=True))
    assert CALLS == ["a", "b"]


def test_a_backend_registered_after_detection_has_its_package_probed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "attnres_i21_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("__version__ = '1.2'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    detected_platform()  # detected before the backend exists
    register_backend(_spec("inv_pkg", package="attnres_i21_pkg"))
    fact = detected_platform().package("attnres_i21_pkg")
    assert (fact.status, fact.version) == ("present", "1.2")
    assert Platform.detect().package("attnres_i21_pkg").usable


def test_register_replace_unregister_serves_nothing_stale() -> None:
    register_backend(_spec("inv_x"))
    register_kernel("inv_x", KA)
    first = _layer(backend="inv_x", name="l")
    assert inspect.unwrap(first.kernel) is KA
    register_kernel("inv_x", KB, replace=True)
    assert inspect.unwrap(_layer(backend="inv_x", name="l").kernel) is KB
    with request_backend(_layer(name="m"), "inv_x") as backend:
        assert backend.name == "inv_x"
    unregister_kernel("inv_x")
    with pytest.raises((KernelNotRegisteredError, ValueError), match="inv_x"):
        _layer(backend="inv_x", name="l")
    unregister_backend("inv_x")
    with pytest.raises(UnknownBackendError):
        _layer(backend="inv_x", name="l")


def test_a_layer_built_again_reuses_its_binding_until_the_registry_changes() -> None:
    # issue 32: an identical layer (a second model) reads its binding back from a
    # memo; a backend registered in between changes the next one's decision
    register_backend(_spec("inv_a", aliases=("inv_fast",), implements=()))
    register_backend(_spec("inv_bwd"))
    register_kernel("inv_a", KA)
    register_kernel("inv_bwd", _kernel("training"))
    register_kernel("inv_b", KB)
    first, second = (
        _layer(supported={"inv_a", "inv_bwd"}, default="inv_fast", name="g") for _ in range(2)
    )
    assert first.backend.name == "inv_a"  # type: ignore[union-attr]
    assert second._binding is first._binding  # the memo's hit
    # the training guard (inv_a has no backward pass) is each layer's own
    second(*_qkv(grad=True))
    assert second.backward_resolution.backend.name == "inv_bwd"  # type: ignore[union-attr]
    assert first.backward_resolution is None
    unregister_backend("inv_a")
    register_backend(_spec("inv_b", aliases=("inv_fast",)))  # with a backward pass
    third = _layer(supported={"inv_b", "inv_bwd"}, default="inv_fast", name="g")
    assert third.backend.name == "inv_b"  # type: ignore[union-attr]
    assert inspect.unwrap(third.kernel) is KB
    third(*_qkv(grad=True))  # no guard: inv_b runs it
    assert third.backward_resolution is None
    assert inspect.unwrap(second.kernel) is KA  # a layer keeps the kernel it bound
    assert CALLS == ["training", "b"]


def test_every_memo_is_keyed_on_the_generation_and_none_subscribes() -> None:
    # issue 33: one discipline -- every module-level memo of what the registry
    # decides is a GenerationMemo (it reads empty after any change); no module
    # registers a hook to clear its caches
    from attnres import _memo, _varlen, autotuner, backends, modules, runtime
    from attnres.integrations import sglang
    from attnres.kernels import lse

    assert not hasattr(backends, "on_registry_change")
    memos = [
        runtime._CACHE,
        runtime._SHAPES,
        runtime._NO_KERNEL,
        runtime._SCOPES,
        modules._SPECS,
        modules._RUNS,
        modules._HAS_BACKWARD,
        modules._BOUND,
        modules._BINDINGS,
        modules._GUARDED,
        modules._BUILT,
        autotuner._SHARED,
        autotuner._MEASURED,
        _varlen._VARLEN,
        _varlen._PLANS,
        sglang._MEMO,
        lse._BUILT,
    ]
    assert all(isinstance(m, _memo.GenerationMemo) for m in memos)
    for _ in range(2):  # fills the resolver and layer memos
        Attention(4, 16, dtype=torch.float32, name="filled")
    assert runtime._CACHE and modules._SPECS and modules._BUILT
    for memo in memos:
        memo[("marker",)] = 1
    register_backend(
        BackendSpec(name="inv_memo", sparse=False, platforms=("cpu",), dtypes=("float32",))
    )
    try:
        assert not any(memo for memo in memos)
        assert runtime.cache_info()["size"] == 0
    finally:
        unregister_backend("inv_memo")


def test_a_value_computed_against_an_older_registry_is_not_kept() -> None:
    from attnres._memo import GenerationMemo
    from attnres.backends import registry_generation

    memo: GenerationMemo[str, int] = GenerationMemo(maxsize=8)
    before = registry_generation()
    register_backend(
        BackendSpec(name="inv_stale", sparse=False, platforms=("cpu",), dtypes=("float32",))
    )
    try:
        memo.put("stale", 1, before)  # computed before the change: refused
        memo.put("fresh", 2, registry_generation())
        assert dict(memo.items()) == {"fresh": 2}
        for i in range(9):  # bounded: the oldest eighth goes when full
            memo.put(str(i), i)
        assert len(memo) <= 8 and "fresh" not in memo
    finally:
        unregister_backend("inv_stale")


def _built_twice(**kwargs: object) -> tuple[Attention, Attention]:
    """Two identical layers: the second is built from the construction memo."""
    first, second = (_layer(name="built", **kwargs) for _ in range(2))
    assert second._binding is first._binding and second._decision is first._decision
    return first, second


def test_a_layer_built_again_after_clear_cache_resolves_again() -> None:
    # issue 32: the construction memo (modules._BUILT) holds lookup's cache
    # entries; a cleared or evicted entry is never served from it (the layer
    # resolves again, with a new entry, audited as a resolution, not a hit)
    from structlog.testing import capture_logs

    from attnres import clear_cache, decisions, runtime

    first, _ = _built_twice()
    clear_cache()
    with capture_logs() as logs:
        again = _layer(name="built")
    assert again._decision is not first._decision
    assert runtime.cache_info()["size"] == 1
    assert "attention cache hit" not in [e["event"] for e in logs]
    with capture_logs() as logs:
        hit = _layer(name="built")
    assert hit._decision is again._decision and hit._binding is again._binding
    assert [e["event"] for e in logs] == ["attention cache hit"]
    assert decisions()[-1] is hit._decision
    # an entry that leaves the cache any other way (evicted) is not served either
    runtime._CACHE.pop(next(iter(runtime._CACHE)))
    assert _layer(name="built")._decision is not hit._decision


def test_the_construction_memo_follows_a_registry_change() -> None:
    register_backend(_spec("inv_a", aliases=("inv_fast",)))
    register_kernel("inv_a", KA)
    first, _ = _built_twice(default="inv_fast")
    assert first.backend.name == "inv_a"  # type: ignore[union-attr]
    unregister_backend("inv_a")
    register_backend(_spec("inv_b", aliases=("inv_fast",)))
    register_kernel("inv_b", KB)
    later = _layer(name="built", default="inv_fast")
    assert later.backend.name == "inv_b"  # type: ignore[union-attr]
    assert later._decision is not first._decision
    later(*_qkv())
    assert CALLS == ["b"]


def test_the_construction_memo_keys_on_the_scope_and_the_config() -> None:
    from attnres import (
        SelectionConfig,
        component_scope,
        force_backend,
        selection_config,
        set_selection_config,
    )

    with component_scope("vae") as vae:
        in_vae = _built_twice()[1]
    with component_scope("text_encoder", backend="eager") as text:
        in_text = _layer(name="built")
    assert in_vae.resolution.component == "vae"  # type: ignore[union-attr]
    assert in_text.resolution.component == "text_encoder"  # type: ignore[union-attr]
    assert in_text.backend.name == "eager"  # type: ignore[union-attr]
    assert [d.layer for d in vae.decisions] == ["built", "built"]
    assert text.decisions == (in_text._decision,)
    plain = _layer(name="built")
    assert plain.resolution.component is None  # type: ignore[union-attr]
    with force_backend("eager"):
        forced = _layer(name="built")
    assert str(forced.resolution.origin) == "forced"  # type: ignore[union-attr]
    previous = set_selection_config(SelectionConfig(global_backend="eager"))
    try:
        configured = _layer(name="built")
        assert str(configured.resolution.origin) == "global_cli"  # type: ignore[union-attr]
        assert configured._context.config is selection_config()
    finally:
        set_selection_config(previous)
    assert _layer(name="built")._decision is plain._decision  # back to the first config
