# ruff: noqa: E501  (signatures of the compiled functions stood in for, one per line)
"""Stand-in for FlashAttention-3's compiled ``flash_attn_3._C`` (ours, not theirs).

flash-attn 2.8.3's ``hopper/flash_attn_interface.py`` imports it ("Registers
operators with PyTorch") and calls ``torch.ops.flash_attn_3.fwd`` / ``bwd``
positionally. Importing this module puts these two functions there instead
(attributes of the ``torch.ops.flash_attn_3`` namespace). They take exactly
``mha_fwd``'s 34 / ``mha_bwd``'s 22 arguments (hopper/flash_api.cpp), check
fp16/bf16, head size (multiple of 8, at most 256), GQA divisibility, int32 and
contiguous ``cu_seqlens`` / ``seqused`` of the batch's shape, and compute
float64 attention, bottom-right aligned. With ``seqused``, sequence ``b`` is
the ``seqused[b]`` tokens from ``cu_seqlens[b]`` on (hopper/seqlen.h); the
output starts as NaN (``torch::empty``), so the rows no sequence covers stay
unwritten, as in the kernel. lse: (batch, heads, seq_q), or (heads, total_q)
for varlen, float32. Deviation: CPU tensors are accepted.
"""

from __future__ import annotations

import torch
from _kernel_reference import attention, backward, check, nan_like

__all__: list[str] = []


def _arity(name: str, args: tuple[object, ...], count: int) -> None:
    if len(args) != count:
        raise TypeError(f"flash_attn_3::{name}() expected {count} arguments, got {len(args)}")


def _inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check(
        q.dtype in (torch.float16, torch.bfloat16),
        "FlashAttention-3 only supports fp16, bf16 and fp8_e4m3 data types",
    )
    check(
        k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype"
    )
    for t in (q, k, v):
        check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    check(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
    check(q.shape[-1] % 8 == 0, "head_size should be a multiple of 8")
    check(
        q.shape[-2] % k.shape[-2] == 0,
        "Number of heads in key/value must divide number of heads in query",
    )


def _int32(t: torch.Tensor | None, name: str, length: int) -> None:
    if t is None:
        return
    check(t.dtype == torch.int32, f"{name} must have dtype int32")
    check(t.is_contiguous(), f"{name} must be contiguous")
    check(tuple(t.shape) == (length,), f"{name} must have shape ({length})")


def _runs(cu: torch.Tensor, used: torch.Tensor | None) -> list[tuple[int, int]]:
    starts = cu.tolist()
    lengths = (
        used.tolist()
        if used is not None
        else [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
    )
    return [(starts[i], starts[i] + lengths[i]) for i in range(len(starts) - 1)]


def _windows(causal: bool, left: int, right: int) -> dict[str, int | bool]:
    return {"causal": causal, "left": left, "right": 0 if causal else right}


def fwd(*args: object) -> list[torch.Tensor | None]:
    _arity("fwd", args, 34)
    (q, k, v, k_new, v_new, qv, out_, cu_q, cu_k, _cu_k_new, seqused_q, seqused_k, max_q, max_k,
     page_table, kv_batch_idx, leftpad_k, rotary_cos, _rotary_sin, _seqlens_rotary, q_descale,
     _k_descale, _v_descale, scale, causal, left, right, _attention_chunk, softcap,
     _rotary_interleaved, _scheduler_metadata, _num_splits, _pack_gqa, _sm_margin) = args  # fmt: skip
    assert (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    )
    _inputs(q, k, v)
    unmodelled = (k_new, v_new, qv, page_table, kv_batch_idx, leftpad_k, rotary_cos, q_descale)
    check(
        all(x is None for x in unmodelled),
        "stub: kv cache, qv, paging, rotary and fp8 are not modelled",
    )
    window = _windows(bool(causal), int(left), int(right))  # type: ignore[call-overload]
    kw = {"scale": float(scale), "softcap": float(softcap), **window}  # type: ignore[arg-type]
    out = nan_like(q) if out_ is None else out_
    assert isinstance(out, torch.Tensor)
    if cu_q is None:
        check(q.dim() == 4, "q must be (batch, seqlen, heads, head_size)")
        ref, lse = attention(q, k, v, **kw)  # type: ignore[arg-type]
        out.copy_(ref.to(q.dtype))
        return [out, lse.to(torch.float32), None, None]
    assert isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)
    batch = cu_q.numel() - 1
    _int32(cu_q, "cu_seqlens_q", batch + 1)
    _int32(cu_k, "cu_seqlens_k", batch + 1)
    _int32(seqused_q, "seqused_q", batch)  # type: ignore[arg-type]
    _int32(seqused_k, "seqused_k", batch)  # type: ignore[arg-type]
    check(max_q is not None and max_k is not None, "max_seqlen_q/k must be given with cu_seqlens")
    lse_all = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
    for (qs, qe), (ks, ke) in zip(_runs(cu_q, seqused_q), _runs(cu_k, seqused_k), strict=True):  # type: ignore[arg-type]
        check(
            qe - qs <= int(max_q) and ke - ks <= int(max_k), "a sequence is longer than max_seqlen"
        )  # type: ignore[call-overload]
        if qe == qs:
            continue
        ref, lse = attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], **kw)  # type: ignore[arg-type]
        out[qs:qe] = ref[0].to(q.dtype)
        lse_all[:, qs:qe] = lse[0].to(torch.float32)
    return [out, lse_all, None, None]


def bwd(*args: object) -> list[torch.Tensor | None]:
    _arity("bwd", args, 22)
    (dout, q, k, v, _out, lse, dq, dk, dv, cu_q, cu_k, seqused_q, seqused_k, _max_q, _max_k, scale,
     causal, left, right, softcap, _deterministic, _sm_margin) = args  # fmt: skip
    assert (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    )
    assert isinstance(dout, torch.Tensor) and isinstance(lse, torch.Tensor)
    _inputs(q, k, v)
    window = _windows(bool(causal), int(left), int(right))  # type: ignore[call-overload]
    kw = {"scale": float(scale), "softcap": float(softcap), **window}  # type: ignore[arg-type]
    if cu_q is None:
        check(
            tuple(lse.shape) == (q.shape[0], q.shape[2], q.shape[1]),
            "softmax_lse must be (batch, heads, seqlen_q)",
        )
        grads = backward(dout, q, k, v, **kw)  # type: ignore[arg-type]
    else:
        assert isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)
        batch = cu_q.numel() - 1
        _int32(cu_q, "cu_seqlens_q", batch + 1)
        _int32(cu_k, "cu_seqlens_k", batch + 1)
        check(tuple(lse.shape) == (q.shape[1], q.shape[0]), "softmax_lse must be (heads, total_q)")
        # rows outside every sequence: left unwritten (torch::empty), NaN here
        grads = tuple(torch.full(t.shape, float("nan"), dtype=torch.float64) for t in (q, k, v))
        for (qs, qe), (ks, ke) in zip(_runs(cu_q, seqused_q), _runs(cu_k, seqused_k), strict=True):  # type: ignore[arg-type]
            if qe == qs:
                continue
            g = backward(dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], **kw)  # type: ignore[arg-type]
            grads[0][qs:qe] = g[0][0]
            grads[1][ks:ke] = g[1][0]
            grads[2][ks:ke] = g[2][0]
    for buffer, grad in zip((dq, dk, dv), grads, strict=True):
        assert isinstance(buffer, torch.Tensor)
        buffer.copy_(grad.to(buffer.dtype))
    return [dq, dk, dv, None]  # type: ignore[list-item]


setattr(torch.ops.flash_attn_3, "fwd", fwd)  # noqa: B010
setattr(torch.ops.flash_attn_3, "bwd", bwd)  # noqa: B010
