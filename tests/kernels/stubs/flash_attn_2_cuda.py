# ruff: noqa: E501  (signatures of the compiled functions stood in for, one per line)
"""Stand-in for flash-attn 2's compiled module ``flash_attn_2_cuda`` (ours, not theirs).

flash-attn 2.8.3's own ``flash_attn/flash_attn_interface.py`` imports it and
calls ``fwd``, ``varlen_fwd``, ``bwd`` and ``varlen_bwd`` positionally. Each
function here takes exactly the arguments of the pybind11 function it replaces
(csrc/flash_attn/flash_api.cpp, ``mha_fwd`` / ``mha_varlen_fwd`` / ``mha_bwd`` /
``mha_varlen_bwd``: a wrong count is the ``TypeError`` pybind raises), runs
their ``TORCH_CHECK``s (dtype fp16/bf16, equal dtypes, contiguous last dim,
head size a multiple of 8 and at most 256, GQA divisibility, int32 and
contiguous ``cu_seqlens``, shapes) and computes float64 attention with
flash-attn's bottom-right causal/window alignment. The output buffer starts as
NaN, so a row the kernel would not write shows. Deviation: CPU tensors are
accepted (``CHECK_DEVICE`` wants CUDA).
"""

from __future__ import annotations

import torch
from _kernel_reference import attention, backward, check, nan_like, segments


def _arity(name: str, args: tuple[object, ...], count: int) -> None:
    if len(args) != count:
        raise TypeError(
            f"{name}(): incompatible function arguments: takes {count}, got {len(args)}"
        )


def _inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check(
        q.dtype in (torch.float16, torch.bfloat16),
        "FlashAttention only support fp16 and bf16 data type",
    )
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    for t in (q, k, v):
        check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    head_size = q.shape[-1]
    check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    check(
        head_size % 8 == 0,
        "query, key, value, and out_ must have a head_size that is a multiple of 8",
    )
    check(
        q.shape[-2] % k.shape[-2] == 0,
        "Number of heads in key/value must divide number of heads in query",
    )


def _cu(cu: torch.Tensor, name: str, batch: int | None = None) -> None:
    check(cu.dtype == torch.int32, f"{name} must have dtype int32")
    check(cu.is_contiguous(), f"{name} must be contiguous")
    if batch is not None:
        check(tuple(cu.shape) == (batch + 1,), f"{name} must have shape (batch_size + 1)")


def _window(
    causal: bool, left: int, right: int, seqlen_k: int, seqlen_q: int
) -> tuple[bool, int, int]:
    """mha_fwd's normalisation of the window (and causal)."""
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if seqlen_q == 1:
        causal = False
    if causal:
        right = 0
    return causal, left, right


def fwd(*args: object) -> list[torch.Tensor]:
    _arity("fwd", args, 13)
    q, k, v, out_, alibi, p_dropout, scale, causal, left, right, softcap, return_softmax, _gen = (
        args
    )
    assert (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    )
    _inputs(q, k, v)
    check(alibi is None, "stub: ALiBi slopes are not modelled")
    check(float(p_dropout) == 0.0, "stub: dropout is not modelled")  # type: ignore[arg-type]
    if return_softmax:
        check(float(p_dropout) > 0.0, "return_softmax is only supported when p_dropout > 0.0")  # type: ignore[arg-type]
    batch, seqlen_q, _heads, head_size = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    check(batch > 0, "batch size must be positive")
    check(
        tuple(k.shape) == (batch, seqlen_k, heads_k, head_size),
        "k must have shape (batch_size, seqlen_k, num_heads_k, head_size)",
    )
    check(
        tuple(v.shape) == (batch, seqlen_k, heads_k, head_size),
        "v must have shape (batch_size, seqlen_k, num_heads_k, head_size)",
    )
    if float(softcap) > 0:  # type: ignore[arg-type]
        check(float(p_dropout) == 0.0, "Softcapping does not support dropout for now")  # type: ignore[arg-type]
    causal, left, right = _window(bool(causal), int(left), int(right), seqlen_k, seqlen_q)  # type: ignore[call-overload]
    ref, lse = attention(
        q, k, v, scale=float(scale), causal=causal, left=left, right=right, softcap=float(softcap)
    )  # type: ignore[arg-type]
    out = nan_like(q) if out_ is None else out_
    assert isinstance(out, torch.Tensor)
    out.copy_(ref.to(q.dtype))
    return [
        out,
        lse.to(torch.float32),
        torch.empty(0, dtype=q.dtype),
        torch.zeros(2, dtype=torch.int64),
    ]


def varlen_fwd(*args: object) -> list[torch.Tensor]:
    _arity("varlen_fwd", args, 21)
    (q, k, v, out_, cu_q, cu_k, seqused_k, leftpad_k, block_table, alibi, max_q, max_k,
     p_dropout, scale, _zero_tensors, causal, left, right, softcap, _return_softmax, _gen) = args  # fmt: skip
    for t in (q, k, v, cu_q, cu_k):
        assert isinstance(t, torch.Tensor)
    _inputs(q, k, v)  # type: ignore[arg-type]
    _cu(cu_q, "cu_seqlens_q")  # type: ignore[arg-type]
    _cu(cu_k, "cu_seqlens_k")  # type: ignore[arg-type]
    check(
        seqused_k is None and leftpad_k is None and block_table is None,
        "stub: seqused_k, leftpad_k and paged KV are not modelled",
    )
    check(alibi is None and float(p_dropout) == 0.0, "stub: ALiBi and dropout are not modelled")  # type: ignore[arg-type]
    batch = cu_q.numel() - 1  # type: ignore[union-attr]
    check(batch > 0, "batch size must be positive")
    check(tuple(cu_k.shape) == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1)")  # type: ignore[union-attr]
    check(
        q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be (total, heads, head_size)"
    )  # type: ignore[union-attr]
    out = nan_like(q) if out_ is None else out_  # type: ignore[arg-type]
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)  # type: ignore[union-attr]
    for (qs, qe), (ks, ke) in zip(segments(cu_q), segments(cu_k), strict=True):  # type: ignore[arg-type]
        check(
            qe - qs <= int(max_q) and ke - ks <= int(max_k), "a sequence is longer than max_seqlen"
        )  # type: ignore[call-overload]
        if qe == qs:
            continue
        c, lw, rw = _window(bool(causal), int(left), int(right), int(max_k), int(max_q))  # type: ignore[call-overload]
        ref, seq_lse = attention(
            q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],  # type: ignore[index]
            scale=float(scale), causal=c, left=lw, right=rw, softcap=float(softcap),  # type: ignore[arg-type]
        )  # fmt: skip
        out[qs:qe] = ref[0].to(q.dtype)  # type: ignore[index, union-attr]
        lse[:, qs:qe] = seq_lse[0].to(torch.float32)
    return [out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)]  # type: ignore[list-item, union-attr]


def _grads_into(dq: object, dk: object, dv: object, grads: tuple[torch.Tensor, ...]) -> None:
    for buffer, grad in zip((dq, dk, dv), grads, strict=True):
        assert isinstance(buffer, torch.Tensor)
        check(buffer.stride(-1) == 1, "dq/dk/dv must have contiguous last dimension")
        buffer.copy_(grad.to(buffer.dtype))


def bwd(*args: object) -> list[torch.Tensor]:
    _arity("bwd", args, 19)
    (dout, q, k, v, out, lse, dq, dk, dv, _alibi, _p_dropout, scale, causal, left, right,
     softcap, _deterministic, _gen, _rng) = args  # fmt: skip
    _inputs(q, k, v)  # type: ignore[arg-type]
    check(out.dtype == q.dtype, "query and out must have the same dtype")  # type: ignore[union-attr]
    check(dout.dtype == q.dtype, "query and dout must have the same dtype")  # type: ignore[union-attr]
    batch, seqlen_q, heads, _ = q.shape  # type: ignore[union-attr]
    check(
        tuple(lse.shape) == (batch, heads, seqlen_q) and lse.dtype == torch.float32,
        "softmax_lse must be (batch, heads, seqlen_q) float32",
    )  # type: ignore[union-attr]
    causal, left, right = _window(bool(causal), int(left), int(right), k.shape[1], seqlen_q)  # type: ignore[call-overload, union-attr]
    grads = backward(
        dout,
        q,
        k,
        v,
        scale=float(scale),
        causal=causal,
        left=left,
        right=right,
        softcap=float(softcap),
    )  # type: ignore[arg-type]
    _grads_into(dq, dk, dv, grads)
    return [dq, dk, dv, torch.zeros(batch, heads, seqlen_q, dtype=torch.float32)]  # type: ignore[list-item]


def varlen_bwd(*args: object) -> list[torch.Tensor]:
    _arity("varlen_bwd", args, 24)
    (dout, q, k, v, _out, lse, dq, dk, dv, cu_q, cu_k, _alibi, max_q, max_k, _p_dropout, scale,
     _zero_tensors, causal, left, right, softcap, _deterministic, _gen, _rng) = args  # fmt: skip
    _inputs(q, k, v)  # type: ignore[arg-type]
    _cu(cu_q, "cu_seqlens_q")  # type: ignore[arg-type]
    _cu(cu_k, "cu_seqlens_k")  # type: ignore[arg-type]
    check(tuple(lse.shape) == (q.shape[1], q.shape[0]), "softmax_lse must be (num_heads, total_q)")  # type: ignore[union-attr]
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]  # type: ignore[union-attr]
    for (qs, qe), (ks, ke) in zip(segments(cu_q), segments(cu_k), strict=True):  # type: ignore[arg-type]
        if qe == qs:
            continue
        c, lw, rw = _window(bool(causal), int(left), int(right), int(max_k), int(max_q))  # type: ignore[call-overload]
        g = backward(
            dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],  # type: ignore[index]
            scale=float(scale), causal=c, left=lw, right=rw, softcap=float(softcap),  # type: ignore[arg-type]
        )  # fmt: skip
        grads[0][qs:qe] += g[0][0]
        grads[1][ks:ke] += g[1][0]
        grads[2][ks:ke] += g[2][0]
    _grads_into(dq, dk, dv, tuple(grads))
    return [dq, dk, dv, torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)]  # type: ignore[list-item, union-attr]
