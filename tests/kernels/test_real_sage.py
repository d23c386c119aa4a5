"""sage_attn adapter through sageattention 1.0.6's own ``sageattention/core.py``.

The registry's ``sageattention`` is 1.0.6: SageAttention 1 (Triton; head sizes
64, 96, 128; ``sageattn_varlen`` for 64 and 128; no ``return_lse``; smooths
``k`` in place). SageAttention 2/2++ and 3 are not on the registry (built from
thu-ml/SageAttention), so the adapter's SageAttention 2 paths (per-GPU entry
points, ``return_lse``) stay on the fakes in tests/test_kernels_fakes.py and
tests/test_sage_options.py. Stubbed: the Triton kernels' launchers
(stubs/_sage_triton.py) and the Triton compiler (stubs/_stub_modules.py);
``core.py``'s own checks and argument handling run as published, but for its
first line, ``assert q.is_cuda``: each test runs with ``torch.Tensor.is_cuda``
answering True (the one monkeypatch here, undone after each test).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _real import close, key_padding, qkv, reference
from conftest import load_dists

from attnres._varlen import padded_kernel
from attnres.kernels import KernelUnavailableError


@pytest.fixture(scope="module", autouse=True)
def sageattention_106() -> Iterator[None]:
    with load_dists("sageattention"):
        import _sage_triton
        import _stub_modules

        _stub_modules.install(["triton"], {"triton": "3.0.0"})
        try:
            from sageattention import core

            _sage_triton.install(core)
            yield
        finally:
            _stub_modules.uninstall()


@pytest.fixture(autouse=True)
def _cuda_says_yes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


@pytest.mark.parametrize(
    ("shape", "causal"),
    [({}, False), ({}, True), ({"heads_kv": 2}, True), ({"size": 96}, False), ({"size": 128}, True),
     ({"seq_q": 5, "seq_kv": 11}, False)],
)  # fmt: skip
def test_dense_forward(shape: dict[str, int], causal: bool) -> None:
    from attnres.kernels import sage_attn

    q, k, v = qkv(**shape)
    close(
        sage_attn.make_kernel()(q, k, v, None, causal, 0.3), reference(q, k, v, None, causal, 0.3)
    )


def test_the_callers_keys_are_left_alone() -> None:
    """SageAttention 1's sageattn smooths k in place (``k -= k.mean(...)``): the
    adapter hands it a copy, so the caller's keys (a KV cache, the same tensor
    another layer reads) are not changed (issue 31)."""
    from attnres.kernels import sage_attn

    q, k, v = qkv()
    before = k.clone()
    sage_attn.make_kernel()(q, k, v, None, False, None)
    assert torch.equal(k, before)


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_through_varlen(causal: bool) -> None:
    from attnres.kernels import sage_attn

    kernel = padded_kernel("sage_attn", sage_attn.make_kernel(), sage_attn.make_varlen_kernel)
    q, k, v = qkv(batch=3, heads_kv=2)
    mask = key_padding(3, 9, [9, 4, 6])
    before = k.clone()
    want = reference(q, k, v, mask, causal, None)
    if causal:
        want = want * mask[:, 0, 0, :, None, None]
    close(kernel(q, k, v, mask, causal, None), want)
    assert torch.equal(k, before)


def test_lse_adapter_refuses_sageattention_1() -> None:
    """sageattn 1.0.6 has no return_lse: its **kwargs swallow it and it returns
    ``out`` alone, which ``out, lse = ...`` split along the batch (issue 31)."""
    from attnres.kernels.lse import make_sage_lse

    with pytest.raises(KernelUnavailableError, match="return_lse"):
        make_sage_lse()


def test_the_wrapper_itself_refuses_other_head_sizes() -> None:
    from attnres.kernels import sage_attn

    q, k, v = qkv(size=32)
    with pytest.raises(AssertionError, match="headdim should be in"):
        sage_attn.make_kernel()(q, k, v, None, False, None)
