"""Helpers of the real-wrapper tests: inputs, the SDPA-semantics reference, the
one monkeypatch flash-attn 2's wrapper needs on CPU."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from reference import reference, relative_error

#: bf16/fp16 against a float64 reference (the stubs compute in float64 and cast back)
TOLERANCE = 1e-2


def qkv(
    batch: int = 2,
    seq_q: int = 9,
    seq_kv: int = 9,
    heads: int = 4,
    heads_kv: int = 4,
    size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    *,
    grad: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def make(seq: int, h: int) -> torch.Tensor:
        t = torch.randn(batch, seq, h, size, generator=generator).to(dtype)
        return t.requires_grad_(grad)

    return make(seq_q, heads), make(seq_kv, heads_kv), make(seq_kv, heads_kv)


def key_padding(batch: int, seq_kv: int, valid: list[int]) -> torch.Tensor:
    """A [B, 1, 1, S] boolean key-padding mask (True: takes part), right padding."""
    mask = torch.zeros(batch, 1, 1, seq_kv, dtype=torch.bool)
    for row, n in enumerate(valid):
        mask[row, ..., :n] = True
    return mask


def close(out: torch.Tensor, ref: torch.Tensor, tolerance: float = TOLERANCE) -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), "the kernel left rows unwritten (NaN)"
    error = relative_error(out, ref)
    assert error < tolerance, error


def grads_close(
    run: Callable[[], torch.Tensor],
    expected: Callable[..., torch.Tensor],
    leaves: tuple[torch.Tensor, ...],
    tolerance: float = 2e-2,
) -> None:
    """The backward of ``run`` against the float64 reference's, for the same upstream grad."""
    out = run()
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    got = torch.autograd.grad(out, leaves, upstream)
    doubles = [t.detach().double().requires_grad_(True) for t in leaves]
    ref_out = expected(*doubles)
    want = torch.autograd.grad(ref_out, doubles, upstream.double())
    for g, w in zip(got, want, strict=True):
        close(g, w, tolerance)


def allow_cpu_custom_ops(module: types.ModuleType) -> list[str]:
    """flash-attn 2.8.3 registers its wrapper functions as ``torch.library.custom_op``
    with ``device_types="cuda"``, so CPU tensors find no kernel. Register the same
    Python bodies (the wrapper's own, ``CustomOpDef._init_fn``) for ``cpu`` too: the
    one monkeypatch its wrapper needs here. Returns the ops patched."""
    patched = []
    for name, value in vars(module).items():
        init = getattr(value, "_init_fn", None)
        if init is not None and hasattr(value, "register_kernel"):
            value.register_kernel("cpu", init)
            patched.append(name)
    return patched


__all__ = ["allow_cpu_custom_ops", "close", "grads_close", "key_padding", "qkv", "reference"]
