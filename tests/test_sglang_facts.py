"""The SGLang plugin registers SGLang's backends attnres lacks with facts read from
SGLang's own classes (issue 23), without SGLang: a small package on disk mirrors
the API of SGLang 0.5.23's
``sglang/multimodal_gen/runtime/layers/attention/backends/attention_backend.py``
(``AttentionBackend`` with ``get_enum``/``get_impl_cls``/``accept_output_buffer``/
``supports_packed_varlen``/``supports_ring_rotation``, an optional
``get_supported_head_sizes``; ``AttentionImpl`` whose ``forward_varlen`` a
packed-varlen impl overrides) and ``AttentionBackendEnum.is_sparse``. The same
reader runs on SGLang's real classes in ``tests/sglang/test_attnres_plugin.py``
(make test-sglang).
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnres import LayerSpec, Requirements
from attnres._vocab import Requirement
from attnres.backends import get_spec, lookup_spec, unregister_backend
from attnres.errors import ResolutionError
from attnres.integrations import sglang as plugin
from attnres.platform import Platform
from attnres.runtime import resolve

PACKAGE = "fake_sglang_i23"

_ENUM = """
import enum

class AttentionBackendEnum(enum.Enum):
    FA2 = enum.auto()
    TORCH_SDPA = enum.auto()
    FAKESG_WINDOW_H3 = enum.auto()
    FAKESG_DENSE = enum.auto()
    FAKESG_PLAIN = enum.auto()
    FAKESG_BROKEN = enum.auto()
    FAKESG_NESTED = enum.auto()
    FAKESG_ORPHAN = enum.auto()

    @property
    def is_sparse(self):
        return self in {AttentionBackendEnum.FAKESG_WINDOW_H3, AttentionBackendEnum.FAKESG_BROKEN}
"""

# SGLang's abstract API, as attention_backend.py defines it (the parts the reader reads)
_BASE = f"""
from {PACKAGE}.platforms import AttentionBackendEnum

class AttentionBackend:
    accept_output_buffer: bool = False

    @staticmethod
    def get_enum():
        raise NotImplementedError

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError

    @classmethod
    def supports_packed_varlen(cls):
        return cls.get_impl_cls().forward_varlen is not AttentionImpl.forward_varlen

    @classmethod
    def supports_ring_rotation(cls):
        return False

class AttentionImpl:
    def __init__(self, num_heads, head_size, softmax_scale, causal=False,
                 num_kv_heads=None, prefix="", **extra_impl_args):
        raise NotImplementedError

    def forward_varlen(self, query, key, value, *, cu_seqlens, max_seqlen):
        raise NotImplementedError
"""

_MODULES = {
    "window_h3": """
        class WindowImpl(AttentionImpl):
            def __init__(self, num_heads, head_size, causal, softmax_scale,
                         num_kv_heads=None, prefix="", **extra_impl_args):
                pass
            def forward_varlen(self, query, key, value, *, cu_seqlens, max_seqlen):
                return query

        class WindowH3Backend(AttentionBackend):
            @staticmethod
            def get_supported_head_sizes():
                return [64, 128]
            @staticmethod
            def get_enum():
                return AttentionBackendEnum.FAKESG_WINDOW_H3
            @staticmethod
            def get_impl_cls():
                return WindowImpl
        """,
    "dense": """
        class DenseImpl(AttentionImpl):
            def __init__(self, num_heads, head_size, causal, softmax_scale, prefix=""):
                pass

        class DenseBackend(AttentionBackend):
            accept_output_buffer = True
            @staticmethod
            def get_supported_head_sizes():
                return [128]
            @staticmethod
            def get_enum():
                return AttentionBackendEnum.FAKESG_DENSE
            @staticmethod
            def get_impl_cls():
                return DenseImpl
        """,
    "plain": """
        class PlainImpl(AttentionImpl):
            def __init__(self, num_heads, head_size, softmax_scale, causal=False,
                         num_kv_heads=None, prefix="", dropout_p=0.0, **extra_impl_args):
                pass

        class PlainBackend(AttentionBackend):
            @classmethod
            def supports_ring_rotation(cls):
                return True
            @staticmethod
            def get_enum():
                return AttentionBackendEnum.FAKESG_PLAIN
            @staticmethod
            def get_impl_cls():
                return PlainImpl
        """,
    # what laser_attn.py does on a host without its kernel package
    "fakesg_broken": """
        raise ImportError("The required 'attentions' package is not installed.")
        """,
}
_NESTED = """
    class NestedImpl(AttentionImpl):
        def __init__(self, num_heads, head_size, causal=False, prefix=""):
            pass

    class NestedBackend(AttentionBackend):
        @staticmethod
        def get_supported_head_sizes():
            return [96]
        @staticmethod
        def get_enum():
            return AttentionBackendEnum.FAKESG_NESTED
        @staticmethod
        def get_impl_cls():
            return NestedImpl
    """
_HEADER = f"from {PACKAGE}.backends.attention_backend import AttentionBackend, AttentionImpl\n"
_HEADER += f"from {PACKAGE}.platforms import AttentionBackendEnum\n"
NAMES = ("fakesg_window_h3", "fakesg_dense", "fakesg_plain", "fakesg_broken")
NAMES += ("fakesg_nested", "fakesg_orphan")


@pytest.fixture
def fake_sglang(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """The fake package on ``sys.path``; its backends unregistered afterwards."""
    root = tmp_path / PACKAGE
    (root / "backends" / "nested").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "platforms.py").write_text(_ENUM)
    (root / "backends" / "__init__.py").write_text("")
    (root / "backends" / "attention_backend.py").write_text(_BASE)
    for name, body in _MODULES.items():
        (root / "backends" / f"{name}.py").write_text(_HEADER + textwrap.dedent(body))
    (root / "backends" / "nested" / "__init__.py").write_text("")
    (root / "backends" / "nested" / "backend.py").write_text(_HEADER + textwrap.dedent(_NESTED))
    sys.path.insert(0, str(tmp_path))
    try:
        enum = importlib.import_module(f"{PACKAGE}.platforms").AttentionBackendEnum
        base = importlib.import_module(f"{PACKAGE}.backends.attention_backend").AttentionBackend
        yield enum, base
    finally:
        sys.path.remove(str(tmp_path))
        for module in [m for m in sys.modules if m.partition(".")[0] == PACKAGE]:
            del sys.modules[module]
        for name in NAMES:
            if lookup_spec(plugin.Backend(name)) is not None:
                unregister_backend(name)
            plugin._FACTS.pop(name, None)


def _facts(fake_sglang: tuple[Any, Any]) -> dict[str, plugin.BackendFacts]:
    return {f.name: f for f in plugin.register_backends(*fake_sglang)}


def test_rule_sglang_backends_attnres_lacks_are_enumerated_from_sglangs_enum(
    fake_sglang: tuple[Any, Any],
) -> None:
    facts = _facts(fake_sglang)
    # torch_sdpa is attnres's own, fa2 an attnres alias of fa: neither is registered
    assert sorted(facts) == sorted(NAMES)
    assert plugin.backend_facts() == tuple(facts[n] for n in sorted(NAMES))
    for name in NAMES:
        assert get_spec(name).kernel is None  # SGLang runs it, attnres does not
    assert plugin.register_backends(*fake_sglang) == ()  # already registered


def test_rule_sglang_backend_facts_are_read_from_its_classes(
    fake_sglang: tuple[Any, Any],
) -> None:
    facts = _facts(fake_sglang)
    window = facts["fakesg_window_h3"]
    assert window.classes == (f"{PACKAGE}.backends.window_h3.WindowH3Backend",)
    assert (window.sparse, window.head_sizes, window.packed_varlen) == (True, (64, 128), True)
    assert (window.ring_rotation, window.accept_output_buffer, window.unknown) == (
        False,
        False,
        (),
    )
    spec = get_spec("fakesg_window_h3")
    assert spec.sparse and spec.head_sizes.allowed == {64, 128}
    assert spec.implements == {
        Requirement.CAUSAL,
        Requirement.GQA,
        Requirement.CUSTOM_SCALE,
        Requirement.PACKED_VARLEN,
    }
    assert spec.masks == () and spec.lse is None
    # a class without num_kv_heads does not claim GQA; no forward_varlen, no packed varlen
    dense = get_spec("fakesg_dense")
    assert dense.implements == {Requirement.CAUSAL, Requirement.CUSTOM_SCALE}
    assert facts["fakesg_dense"].accept_output_buffer is True
    # a class in a sub-package is found too (SGLang's cube_sparse_attn/backend.py)
    assert get_spec("fakesg_nested").head_sizes.allowed == {96}
    assert facts["fakesg_nested"].classes == (f"{PACKAGE}.backends.nested.backend.NestedBackend",)


def test_rule_sglang_fact_a_class_does_not_state_is_permissive_with_its_reason(
    fake_sglang: tuple[Any, Any],
) -> None:
    facts = _facts(fake_sglang)
    plain = facts["fakesg_plain"]
    assert plain.head_sizes is None
    assert plain.unknown == (
        ("head_sizes", "PlainBackend does not define get_supported_head_sizes()"),
    )
    spec = get_spec("fakesg_plain")
    assert spec.head_sizes.allowed is None and spec.head_sizes.failures(80) == []
    assert "head_sizes: PlainBackend does not define" in spec.description
    assert Requirement.DROPOUT in spec.implements  # its impl takes dropout_p
    assert Requirement.PACKED_VARLEN not in spec.implements  # and not forward_varlen
    assert spec.lse is not None and "supports_ring_rotation" in spec.lse


def test_rule_sglang_backend_whose_module_cannot_import_is_unknown_with_the_error(
    fake_sglang: tuple[Any, Any],
) -> None:
    facts = _facts(fake_sglang)
    broken = facts["fakesg_broken"]
    assert broken.classes == () and broken.head_sizes is None and broken.packed_varlen is None
    ((fact, why),) = broken.unknown
    assert fact == "classes"
    assert why == (
        "no class importable here returns it from get_enum(); not importable here: "
        "fakesg_broken (ImportError: The required 'attentions' package is not installed.)"
    )
    spec = get_spec("fakesg_broken")
    assert spec.sparse  # from the enum, which does not need the module
    assert Requirement.PACKED_VARLEN in spec.implements  # unknown: permissive
    assert spec.lse is None  # an lse source is never assumed (fail closed)
    assert why in spec.description
    orphan = facts["fakesg_orphan"]
    assert orphan.unknown[0][1].startswith("no class importable here returns it")


def test_rule_sglang_backend_facts_of_several_classes_combine_permissively(
    fake_sglang: tuple[Any, Any],
) -> None:
    # one member served by one class per platform (SGLang's FA: flash_attn.py and
    # ascend_fa.py): a fact holds when one class states it; head sizes are the union
    enum, _ = fake_sglang
    module = importlib.import_module(f"{PACKAGE}.backends")
    window = importlib.import_module(f"{module.__name__}.window_h3").WindowH3Backend
    dense = importlib.import_module(f"{module.__name__}.dense").DenseBackend
    plain = importlib.import_module(f"{module.__name__}.plain").PlainBackend
    both = plugin.read_backend_facts(enum.FAKESG_DENSE, (dense, window), {})
    assert (both.head_sizes, both.packed_varlen, both.accept_output_buffer) == (
        (64, 128),
        True,
        True,
    )
    assert "num_kv_heads" in (both.impl_parameters or ())
    # one class that declares no head sizes leaves them open for the member
    open_sizes = plugin.read_backend_facts(enum.FAKESG_DENSE, (dense, plain), {})
    assert open_sizes.head_sizes is None
    assert open_sizes.unknown[0][0] == "head_sizes"


def test_rule_sglang_backend_facts_decide_in_attnres_own_profile(
    fake_sglang: tuple[Any, Any],
) -> None:
    _facts(fake_sglang)
    cuda = Platform("cuda")
    ok = resolve(LayerSpec(head_size=128, dtype="bf16"), backend="fakesg_dense", platform=cuda)
    assert ok.backend.name == "fakesg_dense"
    with pytest.raises(ResolutionError, match=r"head size 64 is not one of \[128\]"):
        resolve(LayerSpec(head_size=64, dtype="bf16"), backend="fakesg_dense", platform=cuda)
    varlen = LayerSpec(head_size=128, dtype="bf16", requirements=Requirements(packed_varlen=True))
    with pytest.raises(ResolutionError, match="packed varlen"):
        resolve(varlen, backend="fakesg_dense", platform=cuda)
