"""xformers adapter through xformers 0.0.35's own ``memory_efficient_attention``.

Its Python layer (``xformers/ops/fmha``: input checks, attention-bias classes,
operator dispatch, the cutlass operator's argument handling, autograd) runs as
published; ``xformers/_C.so`` is not unpacked (xformers warns and goes on).
Stubbed: the kernels under the cutlass operator, torch's CUDA-only
``aten::_efficient_attention_forward`` / ``_backward`` (stubs/_xformers_cutlass.py).
Monkeypatches, for this module only: ``torch.version.cuda`` reads ``"12.8"``
so the dispatcher takes its CUDA priority list (flash3, flash, cutlass: the
first two find no operator built and step aside, as on a machine without
them); the cutlass operators list ``"cpu"`` among their devices; and
``torch.cuda.get_device_capability`` answers (9, 0) for the backward's sm75
check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _real import close, grads_close, qkv, reference
from conftest import load_dists


@pytest.fixture(scope="module", autouse=True)
def xformers_0035() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    with load_dists("xformers"):
        import _xformers_cutlass
        import xformers
        from xformers.ops.fmha import cutlass

        assert xformers.__version__ == "0.0.35"
        patch.setattr(torch.version, "cuda", "12.8")
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        for op in (cutlass.FwOp, cutlass.BwOp):
            patch.setattr(op, "SUPPORTED_DEVICES", {*op.SUPPORTED_DEVICES, "cpu"})
        patch.setattr(cutlass.FwOp, "OPERATOR", _xformers_cutlass.efficient_attention_forward)
        patch.setattr(cutlass.BwOp, "OPERATOR", _xformers_cutlass.efficient_attention_backward)
        try:
            yield
        finally:
            patch.undo()


def _dense() -> Any:
    from attnres.kernels import xformers

    return xformers.make_kernel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: CUDA devices only
@pytest.mark.parametrize(
    ("shape", "causal", "mask", "window"),
    [
        ({}, False, None, None),
        ({}, True, None, None),
        ({"heads_kv": 2}, True, None, None),
        ({"seq_q": 5, "seq_kv": 11}, True, None, None),  # top-left, as SDPA
        ({"seq_kv": 11}, False, ("bool", (2, 1)), None),
        ({"seq_kv": 11}, True, ("float", (2, 1)), None),
        ({"seq_q": 7, "seq_kv": 13}, False, ("bool", (2, 4)), None),  # per head
        ({"seq_q": 7, "seq_kv": 13}, True, ("bool", ()), None),  # 2-D, broadcast
        ({}, True, ("float", (1, 4)), None),
        ({}, False, None, (2, 1)),
        ({}, False, ("bool", (2, 1)), (2, 1)),
    ],
)
def test_forward(dtype: torch.dtype, shape: dict[str, int], causal: bool, mask: Any,
                 window: tuple[int, int] | None) -> None:  # fmt: skip
    q, k, v = qkv(dtype=dtype, **shape)
    attn_mask = None
    if mask is not None:
        kind, lead = mask
        generator = torch.Generator().manual_seed(3)
        keep = torch.rand(*lead, q.shape[1], k.shape[1], generator=generator) > 0.3
        keep[..., 0] = True
        if kind == "bool":
            attn_mask = keep
        else:
            bias = torch.randn(keep.shape, generator=generator)
            attn_mask = bias.masked_fill(~keep, float("-inf")).to(dtype)
    extra = {} if window is None else {"window": window}
    out = _dense()(q, k, v, attn_mask, causal, 0.3, **extra)
    close(out, reference(q, k, v, attn_mask, causal, 0.3, window=window))


@pytest.mark.parametrize("masked", [False, True])
def test_backward(masked: bool) -> None:
    dense = _dense()
    q, k, v = qkv(heads_kv=2, dtype=torch.float32, grad=True)
    mask = None
    if masked:
        mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
        mask[1, ..., 6:] = False
    grads_close(
        lambda: dense(q, k, v, mask, True, None),
        lambda a, b, c: reference(a, b, c, mask, True, None),
        (q, k, v),
        tolerance=1e-4,
    )


def test_the_dispatcher_chose_cutlass() -> None:
    import xformers.ops as xops
    from xformers.ops.fmha import cutlass
    from xformers.ops.fmha.common import Inputs
    from xformers.ops.fmha.dispatch import _dispatch_fw

    q, k, v = qkv(dtype=torch.float32)
    inputs = Inputs(q, k, v, attn_bias=xops.LowerTriangularMask())
    assert _dispatch_fw(inputs, False) is cutlass.FwOp
