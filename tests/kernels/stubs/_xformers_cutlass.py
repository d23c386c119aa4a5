# ruff: noqa: E501  (signatures of the compiled functions stood in for, one per line)
"""Stand-ins for the compiled kernels under xformers' cutlass operator (ours).

xformers 0.0.35's ``xformers/ops/fmha/cutlass.py`` runs torch's own CUDA
kernels ``aten::_efficient_attention_forward`` / ``_backward`` (``FwOp.OPERATOR``,
``BwOp.OPERATOR``); a CPU build of torch has the schema but no kernel. These
two functions take that schema (the keyword names xformers passes; a wrong one
is a ``TypeError``), check what the CUDA kernel checks (BMHK 4-D inputs of one
dtype, equal head counts, a tensor bias of the query's dtype and the full
(B, H, Mq, Mk) shape, ``custom_mask_type`` 0 / 1 top-left / 2 bottom-right)
and compute float64 attention. lse: (B, H, Mq rounded up to 32) float32 when
``compute_log_sumexp``. Deviation: CPU tensors are accepted.
"""

from __future__ import annotations

from typing import Any

import torch
from _kernel_reference import attention, backward, check

#: custom_mask_type -> (causal, bottom_right) (aten/src/ATen/native/transformers/cuda/mem_eff_attention)
_MASKS = {0: (False, False), 1: (True, False), 2: (True, True)}


def _checks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Any, custom_mask_type: int
) -> None:
    check(
        query.dim() == 4 and key.dim() == 4 and value.dim() == 4,
        "query, key and value must be 4-D (BMHK)",
    )
    check(query.dtype == key.dtype == value.dtype, "query, key and value must have the same dtype")
    check(
        query.shape[2] == key.shape[2] == value.shape[2],
        "query, key and value must have the same number of heads",
    )
    check(
        query.shape[0] == key.shape[0] and key.shape[1] == value.shape[1],
        "batch and key length must match",
    )
    check(custom_mask_type in _MASKS, f"unknown custom_mask_type {custom_mask_type}")
    if bias is not None:
        check(bias.dtype == query.dtype, "invalid dtype for bias - should match query's dtype")
        b, m, h, _ = query.shape
        check(tuple(bias.shape) == (b, h, m, key.shape[1]), "bias must be (B, H, Mq, Mk)")


def efficient_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int | None,
    max_seqlen_k: int | None, dropout_p: float, custom_mask_type: int,
    compute_log_sumexp: bool = False, *, scale: float | None = None,
    seqlen_k: torch.Tensor | None = None, window_size: int | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    _checks(query, key, value, bias, custom_mask_type)
    check(cu_seqlens_q is None and seqlen_k is None and window_size is None and dropout_p == 0.0,
          "stub: block-diagonal masks, windows and dropout are not modelled")  # fmt: skip
    causal, bottom_right = _MASKS[custom_mask_type]
    s = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse = attention(
        query, key, value, scale=s, causal=causal, bottom_right=bottom_right, bias=bias
    )
    b, m, h, _ = query.shape
    padded = torch.full(
        (b, h, -(-m // 32) * 32 if compute_log_sumexp else 0), float("inf"), dtype=torch.float32
    )
    if compute_log_sumexp:
        padded[..., :m] = lse
    empty = torch.empty(0, dtype=torch.int64)
    return out.to(query.dtype), padded, empty, empty, m, key.shape[1]


def efficient_attention_backward(
    grad_out_: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    bias: torch.Tensor | None, out: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, logsumexp: torch.Tensor,
    dropout_p: float, philox_seed: torch.Tensor, philox_offset: torch.Tensor, custom_mask_type: int,
    bias_requires_grad: bool, *, scale: float | None = None, num_splits_key: int | None = None,
    window_size: int | None = None, shared_storage_dqdkdv: bool = False,
) -> tuple[Any, ...]:  # fmt: skip
    _checks(query, key, value, bias, custom_mask_type)
    b, m, h, _ = query.shape
    check(
        logsumexp.shape[:2] == (b, h) and logsumexp.shape[2] >= m, "logsumexp must be (B, H, >= Mq)"
    )
    causal, bottom_right = _MASKS[custom_mask_type]
    s = query.shape[-1] ** -0.5 if scale is None else scale
    check(not bias_requires_grad, "stub: a bias gradient is not modelled")
    dq, dk, dv = backward(
        grad_out_, query, key, value, scale=s, causal=causal, bottom_right=bottom_right, bias=bias
    )
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), torch.empty(0)
