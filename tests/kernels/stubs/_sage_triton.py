# ruff: noqa: E501  (signatures of the compiled functions stood in for, one per line)
"""Stand-ins for SageAttention 1's Triton kernels (ours, not theirs).

sageattention 1.0.6 (the registry's ``sageattention``: SageAttention 1) is
pure Python over Triton: ``sageattention/core.py`` checks its inputs, smooths
``k`` (``k -= k.mean(...)``, in place), converts ``v`` to fp16, and calls the
launchers of its Triton kernels, which it imports by name (``per_block_int8``,
``per_block_int8_varlen``, ``per_block_int8_hd96``, ``attn_false``,
``attn_true``, ``attn_h96_false``, ``attn_h96_true``, ``attn_false_varlen``,
``attn_true_varlen``). :func:`install` replaces those names in ``core`` (the
Triton compiler itself is answered by :mod:`_stub_modules`). The quantizers
here return ``q * sm_scale * log2(e)`` and ``k`` unquantized (scales of 1),
and the attention launchers compute float64 ``softmax2(q k^T) v`` with the
kernels' layouts (``tensor_layout`` HND/NHD; packed for varlen), causal masks
per sequence (``qo_len == kv_len`` in SageAttention's own words), GQA by
``num_qo_heads // num_kv_heads``, and return ``output_dtype``. Deviations: no
int8 rounding (so no quantization error), CPU tensors accepted.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from _kernel_reference import attention, check, segments

LOG2E = 1.44269504


def _to_nhd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "NHD" else t.transpose(1, 2)


def per_block_int8(q: torch.Tensor, k: torch.Tensor, BLKQ: int = 128, BLKK: int = 64,
                   sm_scale: float | None = None, tensor_layout: str = "HND") -> tuple[Any, ...]:  # fmt: skip
    check(q.dim() == 4 and k.dim() == 4, "q and k must be 4-D")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    one = torch.ones(1)
    return q.double() * scale * LOG2E, one, k.double(), one


def per_block_int8_varlen(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          BLKQ: int = 128, BLKK: int = 64, sm_scale: float | None = None) -> tuple[Any, ...]:  # fmt: skip
    check(q.dim() == 3 and k.dim() == 3, "packed q and k must be 3-D")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    one = torch.ones(1)
    return q.double() * scale * LOG2E, one, k.double(), one, cu_seqlens_q, cu_seqlens_k


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    check(v.dtype == torch.float16, "v must be float16 (core.py converts it)")
    check(q.shape[-2] % k.shape[-2] == 0, "num_qo_heads must be divisible by num_kv_heads")
    check(
        not causal or q.shape[1] == k.shape[1], "is_causal: only applicable when qo_len == kv_len"
    )
    out, _ = attention(q, k, v, scale=math.log(2), causal=causal)  # q carries sm_scale * log2(e)
    return out


def _dense(causal: bool) -> Any:
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: Any, k_scale: Any,
                tensor_layout: str = "HND", output_dtype: torch.dtype = torch.float16) -> torch.Tensor:  # fmt: skip
        out = _attend(
            _to_nhd(q, tensor_layout), _to_nhd(k, tensor_layout), _to_nhd(v, tensor_layout), causal
        )
        return _to_nhd(out, tensor_layout).to(output_dtype)

    return forward


def _varlen(causal: bool) -> Any:
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, q_scale: Any, k_scale: Any,
                cu_seqlens_q_scale: Any, cu_seqlens_k_scale: Any,
                output_dtype: torch.dtype = torch.float16) -> torch.Tensor:  # fmt: skip
        out = torch.full(q.shape, float("nan"), dtype=output_dtype)
        for (qs, qe), (ks, ke) in zip(segments(cu_seqlens_q), segments(cu_seqlens_k), strict=True):
            check(qe - qs <= max_seqlen_q, "a sequence is longer than max_seqlen_q")
            if qe > qs:
                out[qs:qe] = _attend(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal)[0].to(
                    output_dtype
                )
        return out

    return forward


def install(core: types.ModuleType) -> None:
    """Put the stand-ins where ``sageattention.core`` looks its launchers up."""
    core.per_block_int8 = per_block_int8
    core.per_block_int8_hd96 = per_block_int8
    core.per_block_int8_varlen = per_block_int8_varlen
    core.attn_false, core.attn_true = _dense(False), _dense(True)
    core.attn_h96_false, core.attn_h96_true = _dense(False), _dense(True)
    core.attn_false_varlen, core.attn_true_varlen = _varlen(False), _varlen(True)
