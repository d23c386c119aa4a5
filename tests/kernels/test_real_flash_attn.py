"""fa, fa3 and fa4 adapters through flash-attn 2.8.3's own wrappers (stubbed compiled layer).

``flash_attn/flash_attn_interface.py`` (fa), ``hopper/flash_attn_interface.py``
(fa3: the FlashAttention-3 interface of the same release, which has no
distribution of its own on the registry) and the release's early
``flash_attn/cute/interface.py`` (0.1.0: what the fa4 adapter imports on a
machine with flash-attn 2.8.3 and no flash-attn-4) run as published; below
them only ``flash_attn_2_cuda``, ``flash_attn_3._C`` and the CuTe-DSL launch
(``_flash_attn_fwd`` / ``_flash_attn_bwd``) are ours (tests/kernels/stubs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _real import allow_cpu_custom_ops, close, grads_close, key_padding, qkv, reference
from conftest import load_dists

from attnres._varlen import padded_kernel


@pytest.fixture(scope="module", autouse=True)
def flash_attn_283() -> Iterator[None]:
    with load_dists("flash-attn", "flash-attn-3", stubs=("fa3",)):
        import flash_attn
        from flash_attn import flash_attn_interface

        assert flash_attn.__version__ == "2.8.3"
        patched = allow_cpu_custom_ops(flash_attn_interface)
        assert "_flash_attn_forward" in patched and "_flash_attn_varlen_backward" in patched
        import _fa4_launch
        import _stub_modules

        _stub_modules.install(["cutlass", "cuda", "quack", "tvm_ffi"])
        try:
            import flash_attn.cute
            from flash_attn.cute import interface

            assert flash_attn.cute.__version__ == "0.1.0"
            _fa4_launch.install(interface)
            yield
        finally:
            _stub_modules.uninstall()


def _fa() -> tuple[Any, Any]:
    from attnres.kernels import fa

    return fa.make_kernel(), fa.make_varlen_kernel()


def _fa3() -> tuple[Any, Any]:
    from attnres.kernels import fa3

    return fa3.make_kernel(), fa3.make_varlen_kernel()


ADAPTERS = {"fa": _fa, "fa3": _fa3}


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
@pytest.mark.parametrize(
    ("shape", "causal", "features"),
    [
        ({}, False, {}),
        ({}, True, {}),
        ({"heads_kv": 2}, True, {}),  # GQA
        ({"seq_q": 5, "seq_kv": 11}, False, {}),  # cross-attention
        ({"size": 40}, False, {}),  # head size padded to 48 by the wrapper
        ({}, False, {"softcap": 5.0}),
        ({}, False, {"window": (3, 1)}),
        ({}, True, {"window": (2, -1)}),
    ],
)
def test_dense_forward(
    backend: str, shape: dict[str, int], causal: bool, features: dict[str, Any]
) -> None:
    dense, _ = ADAPTERS[backend]()
    q, k, v = qkv(**shape)
    out = dense(q, k, v, None, causal, 0.3, **features)
    window = features.get("window")
    if causal and window is not None:
        window = (window[0], 0)
        causal = False
    close(
        out,
        reference(q, k, v, None, causal, 0.3, softcap=features.get("softcap", 0.0), window=window),
    )


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_through_varlen(backend: str, causal: bool) -> None:
    dense, varlen = ADAPTERS[backend]()
    kernel = padded_kernel(backend, dense, lambda: varlen)
    q, k, v = qkv(batch=3, heads_kv=2)
    mask = key_padding(3, 9, [9, 4, 6])
    out = kernel(q, k, v, mask, causal, None)
    want = reference(q, k, v, mask, causal, None)
    if causal:  # queries are unpadded with the keys: padded rows come back as zeros
        want = want * mask[:, 0, 0, :, None, None]
    close(out, want)


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
def test_bottom_right_causal_cross_attention_runs_through_varlen(backend: str) -> None:
    dense, varlen = ADAPTERS[backend]()
    kernel = padded_kernel(backend, dense, lambda: varlen, bottom_right=True)
    q, k, v = qkv(seq_q=4, seq_kv=9)
    out = kernel(q, k, v, None, True, None)
    keep = torch.ones(4, 9, dtype=torch.bool).tril(9 - 4)
    close(out, reference(q, k, v, keep, False, None))


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
@pytest.mark.parametrize(
    ("causal", "features"),
    [(False, {}), (True, {}), (False, {"softcap": 5.0}), (False, {"window": (3, 1)})],
)
def test_backward(backend: str, causal: bool, features: dict[str, Any]) -> None:
    dense, _ = ADAPTERS[backend]()
    q, k, v = qkv(heads_kv=2, grad=True)
    softcap, window = features.get("softcap", 0.0), features.get("window")
    grads_close(
        lambda: dense(q, k, v, None, causal, None, **features),
        lambda a, b, c: reference(a, b, c, None, causal, None, softcap=softcap, window=window),
        (q, k, v),
    )


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
def test_backward_through_varlen(backend: str) -> None:
    dense, varlen = ADAPTERS[backend]()
    kernel = padded_kernel(backend, dense, lambda: varlen)
    q, k, v = qkv(batch=2, grad=True)
    mask = key_padding(2, 9, [9, 5])
    grads_close(
        lambda: kernel(q, k, v, mask, False, None),
        lambda a, b, c: reference(a, b, c, mask, False, None),
        (q, k, v),
    )


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
def test_varlen_takes_int64_cu_seqlens_and_passes_int32(backend: str) -> None:
    """Packed sequences of unequal lengths, cu_seqlens given as int64: the adapter
    hands the wrapper contiguous int32 (the compiled layer checks it)."""
    _, varlen = ADAPTERS[backend]()
    generator = torch.Generator().manual_seed(4)  # lengths q: 5, 9, 3; k: 7, 9, 12

    def packed(total: int, heads: int) -> torch.Tensor:
        return torch.randn(total, heads, 32, generator=generator).to(torch.bfloat16)

    q, k, v = packed(17, 4), packed(28, 2), packed(28, 2)
    cu_q = torch.tensor([0, 5, 14, 17], dtype=torch.int64)
    cu_k = torch.tensor([0, 7, 16, 28], dtype=torch.int64)
    out = varlen(q, k, v, cu_q, cu_k, 9, 12, False, None)
    for i in range(3):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        want = reference(q[None, qs], k[None, ks], v[None, ks])[0]
        close(out[qs], want)


def test_fa_lse_is_the_wrappers_layout() -> None:
    from attnres.kernels.lse import make_fa_lse

    q, k, v = qkv(seq_q=7, seq_kv=7, heads_kv=2)
    out, lse = make_fa_lse()(q, k, v, True, 0.25)
    close(out, reference(q, k, v, None, True, 0.25))
    scores = (
        torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2)) * 0.25
    )
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    close(lse, torch.logsumexp(scores, dim=-1), 1e-3)


def test_fa_refuses_fp32_as_the_compiled_layer_does() -> None:
    dense, _ = _fa()
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        dense(q, k, v, None, False, None)


def test_fa3_of_this_release_returns_out_only() -> None:
    import flash_attn_interface

    q, k, v = qkv()
    result = flash_attn_interface.flash_attn_func(q, k, v)
    assert isinstance(result, torch.Tensor)  # not (out, lse): the adapter must not unpack
    dense, _ = _fa3()
    close(dense(q, k, v, None, False, None), reference(q, k, v))


# --- fa4 beside flash-attn 2.8.3: its early flash_attn.cute (0.1.0) ----------------------


def test_early_cute_dense_forward() -> None:
    from attnres.kernels import fa4

    dense = fa4.make_kernel()
    q, k, v = qkv(heads_kv=2)
    close(dense(q, k, v, None, True, 0.3), reference(q, k, v, None, True, 0.3))
    close(dense(q, k, v, None, False, None, window=(2, 1)), reference(q, k, v, window=(2, 1)))


def test_early_cute_has_no_working_backward() -> None:
    """A fact for the catalogue (issue 31), in flash-attn 2.8.3's own code: the
    early FlashAttnFunc.backward returns 8 gradients for 9 forward inputs, so
    autograd refuses it (on a GPU as here), and the varlen backward raises
    NotImplementedError. fa4 on that release is forward only."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    q, k, v = qkv(grad=True)
    out, _ = flash_attn_func(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        out.sum().backward()
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    packed = [t.reshape(18, 4, 64) for t in (q, k, v)]
    out, _ = flash_attn_varlen_func(*packed, cu, cu)
    with pytest.raises(NotImplementedError, match="variable length"):
        out.sum().backward()


def test_early_cute_adapter_refuses_a_call_that_needs_gradients() -> None:
    """Issue 31: the fa4 adapter over the early cute refuses, typed and before the
    forward, a call whose inputs need gradients (the catalogue gives that release
    no backward pass); without gradients the same call runs."""
    from attnres.errors import KernelRefusedError
    from attnres.kernels import fa4

    dense, varlen = fa4.make_kernel(), fa4.make_varlen_kernel()
    q, k, v = qkv(grad=True)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    packed = [t.reshape(18, 4, 64) for t in (q, k, v)]
    with pytest.raises(KernelRefusedError, match=r"0\.1\.0.*8 gradients") as info:
        dense(q, k, v, None, True, None)
    assert info.value.backend == "fa4" and "NotImplementedError" in info.value.because
    with pytest.raises(KernelRefusedError, match="backward pass does not work"):
        varlen(*packed, cu, cu, 9, 9, False, None)
    with torch.no_grad():
        close(dense(q, k, v, None, True, None), reference(q, k, v, None, True))
        out = varlen(*packed, cu, cu, 9, 9, False, None)
    close(out.reshape(q.shape), reference(q, k, v))


def test_early_cute_has_no_backward_in_the_catalogue() -> None:
    """The facts for flash-attn's early cute: a layer that needs the backward pass
    is refused fa4 there (another backend is chosen), flash-attn-4 keeps it."""
    from attnres.backends import Backend, get_spec
    from attnres.layer import LayerSpec, Requirements
    from attnres.machine import check_candidate
    from attnres.platform import Platform

    layer = LayerSpec(128, "bf16", requirements=Requirements(backward=True))

    def failures(platform: str) -> list[str]:
        checks = check_candidate(Backend("fa4"), layer, Platform.simulate(platform))
        return [f.message for _, fs in checks for f in fs]

    (message,) = failures("cuda:sm90+flash_attn_4==flash-attn@2.8.3")
    assert "backward" in message
    assert failures("cuda:sm90+flash_attn_4==flash-attn-4@4.0.0b36") == []
    cute = Platform.simulate("cuda:sm90+flash_attn_4==flash-attn@2.8.3")
    (entry,) = [e for e in cute.installed(get_spec(Backend("fa4")))[1] if "early" in e.kernel]
    assert "8 gradients for the forward's 9 inputs" in entry.source


def test_early_cute_key_padding_through_varlen() -> None:
    """Its flash_attn_varlen_func has no max_seqlen_q / max_seqlen_k: the first
    key-padding call raised TypeError (issue 31)."""
    from attnres.kernels import fa4

    kernel = padded_kernel("fa4", fa4.make_kernel(), fa4.make_varlen_kernel)
    q, k, v = qkv(batch=3, heads_kv=2)
    mask = key_padding(3, 9, [9, 4, 6])
    close(kernel(q, k, v, mask, False, None), reference(q, k, v, mask, False, None))


def test_early_cute_refuses_deterministic_by_name() -> None:
    """Neither early function takes ``deterministic``: a BackendOptionError that
    names the installed version, not a TypeError from inside the call."""
    from attnres.errors import BackendOptionError
    from attnres.kernels import fa4

    q, k, v = qkv()
    with pytest.raises(BackendOptionError, match=r"0\.1\.0.*'deterministic'"):
        fa4.make_kernel()(q, k, v, None, False, None, deterministic=True)
    varlen = fa4.make_varlen_kernel()
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    packed = q.reshape(18, 4, 64)
    with pytest.raises(BackendOptionError, match="deterministic"):
        varlen(packed, packed, packed, cu, cu, 9, 9, False, None, deterministic=True)
    # pack_gqa, which it does take, passes
    out = varlen(packed, packed, packed, cu, cu, 9, 9, False, None, pack_gqa=False)
    close(out.reshape(q.shape), reference(q, q, q))


# --- the suite catches a broken adapter ---------------------------------------------------


def test_int64_cu_seqlens_fail_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter that handed flash-attn int64 cu_seqlens would fail here: the
    compiled layer's check ("cu_seqlens_q must have dtype int32") runs."""
    from attnres.kernels import _common

    monkeypatch.setattr(_common, "_int32", lambda cu: cu.long())
    for backend in ("fa", "fa3"):
        with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
            test_key_padding_through_varlen(backend, False)
    with pytest.raises(AssertionError, match="must be int32"):
        test_early_cute_key_padding_through_varlen()


def test_a_transposed_lse_fails_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    """An lse adapter that returned (batch, seq, heads) instead of the wrapper's
    (batch, heads, seq) would fail the layout test."""
    from attnres.kernels import lse as lse_module

    real = lse_module.make_fa_lse

    def transposed() -> Any:
        inner = real()
        return lambda *args, **kwargs: (lambda o, s: (o, s.transpose(1, 2)))(
            *inner(*args, **kwargs)
        )

    monkeypatch.setattr(lse_module, "make_fa_lse", transposed)
    with pytest.raises(AssertionError):
        test_fa_lse_is_the_wrappers_layout()


def test_an_adapter_that_lets_the_early_cute_train_fails_the_suite(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An fa4 adapter that did not recognise the early cute would run its forward
    with gradients on, and the refusal test fails (its backward is the broken one)."""
    from attnres.kernels import fa4

    monkeypatch.setattr(fa4, "_early_cute", lambda: False)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_early_cute_adapter_refuses_a_call_that_needs_gradients()
