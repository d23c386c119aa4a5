"""ascend_fa through torch_npu's operator as the registry's torch_npu publishes it.

torch_npu 2.13.0 has no Python layer above ``npu_fusion_attention``: the
function is the compiled operator ``torch.ops.npu.npu_fusion_attention``
(``torch_npu/utils/custom_ops.py``). tests/kernels/stubs/npu/torch_npu defines
that operator with the schema the wheel publishes (read from its
``_op_plugin_docs.py`` here) and a CPU kernel that enforces the documented
constraints (BOOL/UINT8 masks, layouts, head sizes, GQA, same dtypes) and
computes float64 attention (docs/layers.md, "How the adapters are tested").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _real import close, qkv, reference
from conftest import dists_root, load_dists


@pytest.fixture(scope="module", autouse=True)
def torch_npu_213() -> Iterator[None]:
    # torch_npu's own folder stays off sys.path (its __init__ needs the compiled
    # torch_npu._C): the stand-in reads the published schema from it
    if not (dists_root() / "torch-npu" / "torch_npu").is_dir():
        pytest.exit("missing kernel distribution torch-npu: rerun make test-kernels", 3)
    with load_dists(stubs=("npu",)):
        import torch_npu

        assert torch_npu.npu_fusion_attention is torch.ops.npu.npu_fusion_attention
        yield


def _kernel() -> Any:
    from attnres.kernels import ascend_fa

    return ascend_fa.make_kernel()


def test_the_operator_has_the_published_schema() -> None:
    """The dispatcher checks the adapter's call against the wheel's own prototype."""
    import torch_npu

    schema = torch.ops.npu.npu_fusion_attention.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:5] == ["query", "key", "value", "head_num", "input_layout"]
    assert {"atten_mask", "scale", "keep_prob", "sparse_mode"} <= set(names)
    assert len(schema.returns) == 7
    q, k, v = qkv()
    with pytest.raises(RuntimeError):  # a keyword the schema has not
        torch_npu.npu_fusion_attention(q, k, v, 4, "BSND", softmax_scale=0.1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_dense_forward(causal: bool, scale: float | None) -> None:
    q, k, v = qkv(heads_kv=2)
    close(_kernel()(q, k, v, None, causal, scale), reference(q, k, v, None, causal, scale))


def test_causal_cross_attention_keeps_the_top_left_alignment() -> None:
    q, k, v = qkv(seq_q=5, seq_kv=9)
    close(_kernel()(q, k, v, None, True, None), reference(q, k, v, None, True, None))


@pytest.mark.parametrize("shape", [(9, 9), (2, 1, 9, 9), (2, 4, 9, 9), (2, 1, 1, 9)])
def test_boolean_masks_are_inverted_for_the_kernel(shape: tuple[int, ...]) -> None:
    q, k, v = qkv()
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True  # no row without a key
    close(_kernel()(q, k, v, mask, False, None), reference(q, k, v, mask, False, None))
    close(_kernel()(q, k, v, mask, True, None), reference(q, k, v, mask, True, None))


def test_float_masks_are_refused_by_the_adapter_and_by_the_operator() -> None:
    """npu_fusion_attention takes BOOL/UINT8 masks only: the adapter refuses an
    additive mask with its own message before the operator would."""
    import torch_npu

    q, k, v = qkv()
    additive = torch.zeros(2, 1, 9, 9)
    with pytest.raises(ValueError, match="boolean masks only"):
        _kernel()(q, k, v, additive, False, None)
    with pytest.raises(RuntimeError, match="atten_mask must be bool or uint8"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BSND", atten_mask=additive)


def test_the_operator_checks_head_size_and_gqa() -> None:
    import torch_npu

    q, k, v = qkv(heads=4, heads_kv=3)
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BSND")
    q, k, v = qkv(size=800)
    with pytest.raises(RuntimeError, match=r"head dim must be in \[1, 768\]"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BSND")


# --- the suite catches a broken adapter ---------------------------------------------------


def test_an_adapter_that_passed_the_sdpa_mask_sense_fails_the_suite(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """atten_mask's True masks a position out (SDPA's keeps it): an adapter that
    handed the mask over uninverted would fail the mask test."""
    from attnres.kernels import ascend_fa

    real = ascend_fa._masked_out
    monkeypatch.setattr(
        ascend_fa, "_masked_out", lambda m, c, q, k: real(None if m is None else ~m, c, q, k)
    )
    with pytest.raises(AssertionError):
        test_boolean_masks_are_inverted_for_the_kernel((2, 1, 9, 9))


def test_an_adapter_without_the_scale_fails_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's scale defaults to 1.0, not 1/sqrt(head size): an adapter that
    left it out would compute other numbers."""
    import torch_npu

    real = torch_npu.npu_fusion_attention

    def without_scale(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("scale", None)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_npu, "npu_fusion_attention", without_scale)
    with pytest.raises(AssertionError):
        test_dense_forward(False, None)
