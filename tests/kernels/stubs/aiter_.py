# ruff: noqa: E501  (signatures of the compiled functions stood in for, one per line)
"""Stand-in for aiter's prebuilt compiled module ``aiter_`` (ours, not AMD's).

A prebuilt amd-aiter install has ``aiter/jit/aiter_.so``; ``aiter.jit.core``
then sets ``PREBUILD_KERNELS = True`` and every ``@compile_ops`` function of
``aiter/ops/mha.py`` (amd-aiter 0.1.7.post2.dev18) calls the function of the
same name in that module, after ``compile_ops``' own ``check_args`` has read the
pybind11 signature line of its ``__doc__`` and type-checked every argument
against it. The functions here carry the signatures ``mha.py`` declares for
``mha_fwd``, ``fmha_v3_fwd``, ``mha_varlen_fwd``, ``fmha_v3_varlen_fwd``,
``mha_bwd``, ``fmha_v3_bwd``, ``mha_varlen_bwd`` and ``fmha_v3_varlen_bwd``, run
the CK checks (csrc/py_itfs_ck/mha_*_kernels.cu: fp16/bf16, head size at most
256, GQA divisibility, int32 and contiguous ``cu_seqlens``) and compute float64
attention (causal and window bottom-right, like flash-attn). lse: (batch,
heads, seq_q), or (heads, total_q) for varlen, float32; an empty tensor unless
``return_softmax_lse`` (so a backward handed it fails). Deviation: CPU tensors
are accepted. No ``from __future__ import annotations``: the docstrings are
made from the real annotations.
"""

import inspect

import torch
from _kernel_reference import attention, backward, check, nan_like, segments
from torch import Generator, Tensor

__all__: list[str] = []  # aiter/__init__.py does `from aiter_ import *` when it is importable


class _EnumMeta(type):
    def __getattr__(cls, member: str) -> int:  # ActivationType.Silu, QuantType.per_Token, ...
        if member.startswith("__"):
            raise AttributeError(member)
        value = sum(map(ord, member))
        found = cls(value)
        found.value, found.name = value, member  # type: ignore[attr-defined]
        return found


class ActivationType(int, metaclass=_EnumMeta):
    """Members: (pybind11 enum; compile_ops skips the signature check for enums)"""


class QuantType(int, metaclass=_EnumMeta):
    """Members: (pybind11 enum; compile_ops skips the signature check for enums)"""


def _inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    check(
        q.dtype in (torch.float16, torch.bfloat16),
        "FlashAttention only support fp16, bf16 and fp8_e4m3 data type",
    )
    check(
        k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype"
    )
    for t in (q, k, v):
        check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    check(q.shape[-1] <= 256, "CK only supports head dimension at most 256")
    check(q.shape[-1] % 8 == 0, "query, key, value must have a head_size that is a multiple of 8")
    check(
        q.shape[-2] % k.shape[-2] == 0,
        "Number of heads in key/value must divide number of heads in query",
    )


def _cu(t: Tensor | None, name: str) -> None:
    check(t is not None, f"{name} must be given")
    assert t is not None
    check(t.dtype == torch.int32, f"{name} must have dtype int32")
    check(t.is_contiguous(), f"{name} must be contiguous")


def _lse(lse: Tensor, wanted: bool) -> Tensor:
    return lse.to(torch.float32) if wanted else torch.empty(0, dtype=torch.float32)


def _dense(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    is_causal,
    window_size_left,
    window_size_right,
    return_softmax_lse,
    out,
    bias,
    alibi_slopes,
):
    _inputs(q, k, v)
    check(
        dropout_p == 0.0 and bias is None and alibi_slopes is None,
        "stub: dropout, bias and ALiBi are not modelled",
    )
    ref, lse = attention(
        q,
        k,
        v,
        scale=softmax_scale,
        causal=is_causal,
        left=window_size_left,
        right=window_size_right,
    )
    out = nan_like(q) if out is None else out
    out.copy_(ref.to(q.dtype))
    return [
        out,
        _lse(lse, return_softmax_lse),
        torch.empty(0, dtype=q.dtype),
        torch.zeros(2, dtype=torch.int64),
    ]


def _varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    logits_soft_cap,
    is_causal,
    window_size_left,
    window_size_right,
    return_softmax_lse,
    out,
    block_table,
    bias,
    alibi_slopes,
):
    _inputs(q, k, v)
    _cu(cu_seqlens_q, "cu_seqlens_q")
    _cu(cu_seqlens_k, "cu_seqlens_k")
    check(
        dropout_p == 0.0 and bias is None and alibi_slopes is None and block_table is None,
        "stub: dropout, bias, ALiBi and paging are not modelled",
    )
    out = nan_like(q) if out is None else out
    lse_all = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
    for (qs, qe), (ks, ke) in zip(segments(cu_seqlens_q), segments(cu_seqlens_k), strict=True):
        check(
            qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k,
            "a sequence is longer than max_seqlen",
        )
        if qe == qs:
            continue
        ref, lse = attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale=softmax_scale, causal=is_causal,
                             left=window_size_left, right=window_size_right, softcap=logits_soft_cap)  # fmt: skip
        out[qs:qe] = ref[0].to(q.dtype)
        lse_all[:, qs:qe] = lse[0].to(torch.float32)
    return [
        out,
        _lse(lse_all, return_softmax_lse),
        torch.empty(0, dtype=q.dtype),
        torch.zeros(2, dtype=torch.int64),
    ]


def _dense_bwd(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    softmax_scale,
    is_causal,
    window_size_left,
    window_size_right,
    dq,
    dk,
    dv,
):
    _inputs(q, k, v)
    check(
        tuple(softmax_lse.shape) == (q.shape[0], q.shape[2], q.shape[1]),
        "softmax_lse must be (batch, heads, seqlen_q): was it returned (return_lse)?",
    )
    grads = backward(
        dout,
        q,
        k,
        v,
        scale=softmax_scale,
        causal=is_causal,
        left=window_size_left,
        right=window_size_right,
    )
    return _into(dq, dk, dv, grads, q, k, v)


def _varlen_bwd(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    softmax_scale,
    is_causal,
    window_size_left,
    window_size_right,
    dq,
    dk,
    dv,
):
    _inputs(q, k, v)
    _cu(cu_seqlens_q, "cu_seqlens_q")
    _cu(cu_seqlens_k, "cu_seqlens_k")
    check(
        tuple(softmax_lse.shape) == (q.shape[1], q.shape[0]),
        "softmax_lse must be (heads, total_q): was it returned (return_lse)?",
    )
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for (qs, qe), (ks, ke) in zip(segments(cu_seqlens_q), segments(cu_seqlens_k), strict=True):
        if qe == qs:
            continue
        g = backward(dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale=softmax_scale,
                     causal=is_causal, left=window_size_left, right=window_size_right)  # fmt: skip
        grads[0][qs:qe] = g[0][0]
        grads[1][ks:ke] = g[1][0]
        grads[2][ks:ke] = g[2][0]
    return _into(dq, dk, dv, tuple(grads), q, k, v)


def _into(dq, dk, dv, grads, q, k, v):
    buffers = [
        torch.empty_like(t) if b is None else b
        for b, t in zip((dq, dk, dv), (q, k, v), strict=True)
    ]
    for buffer, grad in zip(buffers, grads, strict=True):
        buffer.copy_(grad.to(buffer.dtype))
    return [*buffers, torch.zeros(0, dtype=torch.float32)]


def mha_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_kv: Tensor | None = None,
    out: Tensor | None = None,
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    gen: Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check(
        cu_seqlens_q is None and cu_seqlens_kv is None,
        "stub: batch-mode cu_seqlens are not modelled",
    )
    return _dense(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        return_softmax_lse,
        out,
        bias,
        alibi_slopes,
    )


def fmha_v3_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    how_v3_bf16_cvt: int,
    out: Tensor | None = None,
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    gen: Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _dense(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        return_softmax_lse,
        out,
        bias,
        alibi_slopes,
    )


def mha_varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int,
    dropout_p: float,
    softmax_scale: float,
    logits_soft_cap: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    out: Tensor | None = None,
    block_table: Tensor | None = None,
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    gen: Generator | None = None,
    cu_seqlens_q_padded: Tensor | None = None,
    cu_seqlens_k_padded: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        logits_soft_cap,
        is_causal,
        window_size_left,
        window_size_right,
        return_softmax_lse,
        out,
        block_table,
        bias,
        alibi_slopes,
    )


def fmha_v3_varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int,
    dropout_p: float,
    softmax_scale: float,
    logits_soft_cap: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    how_v3_bf16_cvt: int,
    out: Tensor | None = None,
    block_table: Tensor | None = None,
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    gen: Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        logits_soft_cap,
        is_causal,
        window_size_left,
        window_size_right,
        return_softmax_lse,
        out,
        block_table,
        bias,
        alibi_slopes,
    )


def mha_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dropout_p: float,
    softmax_scale: float,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    deterministic: bool,
    dq: Tensor | None = None,
    dk: Tensor | None = None,
    dv: Tensor | None = None,
    dbias: Tensor | None = None,
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    rng_state: Tensor | None = None,
    gen: Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _dense_bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        dq,
        dk,
        dv,
    )


def fmha_v3_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dropout_p: float,
    softmax_scale: float,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    deterministic: bool,
    is_v3_atomic_fp32: bool,
    how_v3_bf16_cvt: int,
    dq: Tensor | None = None,
    dk: Tensor | None = None,
    dv: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    rng_state: Tensor | None = None,
    gen: Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _dense_bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        dq,
        dk,
        dv,
    )


def mha_varlen_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    deterministic: bool,
    dq: Tensor | None = None,
    dk: Tensor | None = None,
    dv: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    rng_state: Tensor | None = None,
    gen: Generator | None = None,
    cu_seqlens_q_padded: Tensor | None = None,
    cu_seqlens_k_padded: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        dq,
        dk,
        dv,
    )


def fmha_v3_varlen_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    deterministic: bool,
    is_v3_atomic_fp32: bool,
    how_v3_bf16_cvt: int,
    dq: Tensor | None = None,
    dk: Tensor | None = None,
    dv: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    rng_state: Tensor | None = None,
    gen: Generator | None = None,
    cu_seqlens_q_padded: Tensor | None = None,
    cu_seqlens_k_padded: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        dq,
        dk,
        dv,
    )


# pybind11's first docstring line, which compile_ops' check_args parses and type-checks against
for _fn in (
    mha_fwd,
    fmha_v3_fwd,
    mha_varlen_fwd,
    fmha_v3_varlen_fwd,
    mha_bwd,
    fmha_v3_bwd,
    mha_varlen_bwd,
    fmha_v3_varlen_bwd,
):
    _fn.__doc__ = f"{_fn.__name__}{inspect.signature(_fn)}".replace("typing.", "") + "\n"
