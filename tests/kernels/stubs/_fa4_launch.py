"""Stand-in for FlashAttention-4's compiled layer (ours, not theirs).

FA4 (``flash_attn.cute``, flash-attn-4 4.0.0b36, and the early 0.1.0 that
flash-attn 2.8.3 ships) has no compiled extension module: ``_flash_attn_fwd``
and ``_flash_attn_bwd`` in ``flash_attn/cute/interface.py`` check their
arguments, then compile the kernels with NVIDIA's CuTe DSL and launch them.
Those two functions are the boundary here: :func:`install` replaces them on the
imported ``interface`` module with functions that bind their arguments to the
real function's own signature (a keyword it lacks is a ``TypeError``, as it
would be), run the argument asserts of its head (shapes, fp16/bf16, int32 and
contiguous ``cu_seqlens`` / ``seqused``, GQA divisibility, head size at most
256 and a multiple of 16 // element size) and compute float64 attention,
bottom-right aligned. lse: (batch, heads, seq_q) or (heads, total_q) float32;
4.0.0b36 allocates it only when an input requires grad or ``return_lse``
(otherwise ``None``), 0.1.0 always. Output starts as NaN (``torch.empty``): rows
no sequence covers stay unwritten. Everything above the two functions
(``flash_attn_func``, ``flash_attn_varlen_func``, ``FlashAttnFunc``,
``FlashAttnVarlenFunc``: argument handling, return values, autograd) runs as
published. The CuTe DSL itself (``cutlass``, ``quack``, ``cuda.bindings``,
``tvm_ffi``) is answered by :mod:`_stub_modules` so that the package imports.
Deviations: CPU tensors are accepted; no GPU-architecture checks.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from _kernel_reference import attention, backward, nan_like


def _runs(cu: torch.Tensor, used: torch.Tensor | None) -> list[tuple[int, int]]:
    starts = cu.tolist()
    n = len(starts) - 1
    lengths = used.tolist() if used is not None else [starts[i + 1] - starts[i] for i in range(n)]
    return [(starts[i], starts[i] + lengths[i]) for i in range(n)]


def _side(value: int | None) -> int:
    return -1 if value is None else int(value)


def _check_inputs(p: dict[str, Any]) -> None:
    q, k, v = p["q"], p["k"], p["v"]
    batch = q.shape[0] if p.get("cu_seqlens_q") is None else p["cu_seqlens_q"].shape[0] - 1
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        t = p.get(name)
        if t is not None:
            assert t.shape == (batch + 1,), f"{name} must have shape (batch_size + 1,)"
    for name in ("seqused_q", "seqused_k"):
        t = p.get(name)
        assert t is None or t.shape == (batch,), f"{name} must have shape (batch_size,)"
    assert q.dtype in [torch.float16, torch.bfloat16], "inputs must be float16 or bfloat16"
    assert q.dtype == k.dtype == v.dtype, "inputs must have the same dtype"
    for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"):
        t = p.get(name)
        if t is not None:
            assert t.dtype == torch.int32, (
                "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
            )
            assert t.stride(0) == 1, (
                "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be contiguous"
            )
    assert q.shape[-2] % k.shape[-2] == 0, "num_head must be divisible by num_head_kv"
    assert q.shape[-1] <= 256, "head_dim must be less than or equal to 256"
    alignment = 16 // q.element_size()
    assert q.shape[-1] % alignment == 0, f"head_dim must be divisible by {alignment}"
    for name in ("page_table", "learnable_sink", "qv", "mask_mod", "score_mod"):
        assert p.get(name) is None, f"stub: {name} is not modelled"


def _kw(p: dict[str, Any], q: torch.Tensor) -> dict[str, Any]:
    scale = p.get("softmax_scale")
    return {
        "scale": q.shape[-1] ** -0.5 if scale is None else float(scale),
        "causal": bool(p.get("causal")),
        "left": _side(p.get("window_size_left")),
        "right": _side(p.get("window_size_right")),
        "softcap": float(p.get("softcap") or 0.0),
    }


def install(interface: types.ModuleType) -> None:
    """Replace ``interface._flash_attn_fwd`` / ``_flash_attn_bwd`` (see the module docstring)."""
    fwd_signature = inspect.signature(interface._flash_attn_fwd)
    bwd_signature = inspect.signature(interface._flash_attn_bwd)
    early = "return_lse" not in fwd_signature.parameters  # flash-attn 2.8.3's cute 0.1.0

    def fwd(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        bound = fwd_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        p = bound.arguments
        _check_inputs(p)
        q, k, v = p["q"].contiguous(), p["k"].contiguous(), p["v"].contiguous()
        kw = _kw(p, q)
        out = nan_like(q, (*q.shape[:-1], v.shape[-1]))
        cu_q, cu_k = p.get("cu_seqlens_q"), p.get("cu_seqlens_k")
        if cu_q is None:
            ref, lse = attention(q, k, v, **kw)
            out.copy_(ref.to(q.dtype))
        else:
            lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float64)
            runs_q = _runs(cu_q, p.get("seqused_q"))
            runs_k = _runs(cu_k, p.get("seqused_k"))
            for (qs, qe), (ks, ke) in zip(runs_q, runs_k, strict=True):
                if qe == qs:
                    continue
                ref, seq_lse = attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], **kw)
                out[qs:qe] = ref[0].to(q.dtype)
                lse[:, qs:qe] = seq_lse[0]
        lse32 = lse.to(torch.float32)
        if early:
            return out, lse32
        wanted = p["return_lse"] or any(t.requires_grad for t in (p["q"], p["k"], p["v"]))
        return out, (lse32 if wanted else None), None, None, None

    def bwd(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        bound = bwd_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        p = bound.arguments
        q, k, v, dout, lse = p["q"], p["k"], p["v"], p["dout"], p["lse"]
        cu_q, cu_k = p.get("cu_seqlens_q"), p.get("cu_seqlens_k")
        if cu_q is None:
            assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]), (
                "lse must have shape (batch_size, num_head, seqlen_q)"
            )
        else:
            assert lse.shape == (q.shape[1], q.shape[0]), "lse must have shape (num_head, total_q)"
        assert q.dtype in [torch.float16, torch.bfloat16], "inputs must be float16 or bfloat16"
        assert lse.dtype == torch.float32, "lse must be float32"
        for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"):
            t = p.get(name)
            if t is not None:
                assert t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k must be int32"
        assert q.shape[-2] % k.shape[-2] == 0, "num_head must be divisible by num_head_kv"
        kw = _kw(p, q)
        if cu_q is None:
            grads = backward(dout, q, k, v, **kw)
        else:  # rows outside every sequence: unwritten (torch.empty), NaN here
            grads = tuple(torch.full(t.shape, float("nan"), dtype=torch.float64) for t in (q, k, v))
            runs_q, runs_k = _runs(cu_q, p.get("seqused_q")), _runs(cu_k, p.get("seqused_k"))
            for (qs, qe), (ks, ke) in zip(runs_q, runs_k, strict=True):
                if qe == qs:
                    continue
                g = backward(
                    dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], **kw
                )
                grads[0][qs:qe], grads[1][ks:ke], grads[2][ks:ke] = g[0][0], g[1][0], g[2][0]
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))

    interface._flash_attn_fwd = fwd
    interface._flash_attn_bwd = bwd
