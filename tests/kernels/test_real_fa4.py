"""fa4 adapter through flash-attn-4 4.0.0b36's own ``flash_attn/cute/interface.py``.

FA4 has no compiled extension: ``_flash_attn_fwd`` / ``_flash_attn_bwd`` compile
and launch CuTe-DSL kernels, and those two functions are replaced by
stubs/_fa4_launch.py (which binds their real signatures and runs their argument
asserts); the DSL modules are answered by stubs/_stub_modules.py.
``flash_attn_func``, ``flash_attn_varlen_func`` and their autograd functions
run as published.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _real import close, grads_close, key_padding, qkv, reference
from conftest import load_dists

from attnres._varlen import padded_kernel


@pytest.fixture(scope="module", autouse=True)
def flash_attn_4() -> Iterator[None]:
    with load_dists("flash-attn-4"):
        import _fa4_launch
        import _stub_modules

        _stub_modules.install(["cutlass", "cuda", "quack", "tvm_ffi", "einops"])
        try:
            from flash_attn.cute import interface

            assert "return_lse" in interface._flash_attn_fwd.__code__.co_varnames
            _fa4_launch.install(interface)
            yield
        finally:
            _stub_modules.uninstall()


def _adapters() -> tuple[Any, Any]:
    from attnres.kernels import fa4

    return fa4.make_kernel(), fa4.make_varlen_kernel()


@pytest.mark.parametrize(
    ("shape", "causal", "features"),
    [({}, False, {}), ({}, True, {}), ({"heads_kv": 2}, True, {}),
     ({"seq_q": 5, "seq_kv": 11}, False, {}), ({}, False, {"softcap": 5.0}),
     ({}, False, {"window": (3, 1)}), ({}, False, {"deterministic": True})],
)  # fmt: skip
def test_dense_forward(shape: dict[str, int], causal: bool, features: dict[str, Any]) -> None:
    dense, _ = _adapters()
    q, k, v = qkv(**shape)
    out = dense(q, k, v, None, causal, 0.3, **features)
    want = reference(
        q,
        k,
        v,
        None,
        causal,
        0.3,
        softcap=features.get("softcap", 0.0),
        window=features.get("window"),
    )
    close(out, want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grad", [False, True])  # no grad: the span route (seqused)
def test_key_padding_through_varlen(causal: bool, grad: bool) -> None:
    dense, varlen = _adapters()
    assert varlen.takes_seqused
    kernel = padded_kernel("fa4", dense, lambda: varlen)
    q, k, v = qkv(batch=3, heads_kv=2, grad=grad)
    mask = key_padding(3, 9, [9, 4, 6])
    want = reference(q, k, v, mask, causal, None)
    if causal:
        want = want * mask[:, 0, 0, :, None, None]
    close(kernel(q, k, v, mask, causal, None, deterministic=True), want)


@pytest.mark.parametrize("causal", [False, True])
def test_backward(causal: bool) -> None:
    dense, _ = _adapters()
    q, k, v = qkv(heads_kv=2, grad=True)
    grads_close(
        lambda: dense(q, k, v, None, causal, None),
        lambda a, b, c: reference(a, b, c, None, causal, None),
        (q, k, v),
    )


def test_backward_through_varlen() -> None:
    dense, varlen = _adapters()
    kernel = padded_kernel("fa4", dense, lambda: varlen)
    q, k, v = qkv(batch=2, grad=True)
    mask = key_padding(2, 9, [9, 5])
    grads_close(
        lambda: kernel(q, k, v, mask, False, None),
        lambda a, b, c: reference(a, b, c, mask, False, None),
        (q, k, v),
    )


def test_lse_only_with_return_lse_or_a_grad() -> None:
    """A fact the ring relies on (issue 31): FA4 returns ``(out, None)`` unless
    ``return_lse=True`` or an input requires grad."""
    from flash_attn.cute import flash_attn_func

    q, k, v = qkv()
    assert flash_attn_func(q, k, v)[1] is None
    _out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    q.requires_grad_(True)
    assert flash_attn_func(q, k, v)[1] is not None


def test_int64_cu_seqlens_fail_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnres.kernels import _common

    monkeypatch.setattr(_common, "_int32", lambda cu: cu.long())
    with pytest.raises(AssertionError, match="must be int32"):
        test_key_padding_through_varlen(False, False)
