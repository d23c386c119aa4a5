"""Stand-in for ``torch_npu`` (ours, not theirs): ``npu_fusion_attention`` only.

torch_npu has no Python wrapper to run: in the registry's torch_npu 2.13.0
wheel, ``torch_npu/utils/custom_ops.py`` binds ``torch_npu.npu_fusion_attention
= torch.ops.npu.npu_fusion_attention``, an operator of its compiled op-plugin
(its ``op_plugin/meta/_meta_registrations.py`` computes output shapes only, no
argument check), and ``import torch_npu`` needs its compiled ``torch_npu._C``
and Ascend's CANN libraries. So the closest stand-in is the operator itself:
this module defines ``npu::npu_fusion_attention`` with torch.library from the
schema the wheel publishes (the ``接口原型`` line of its
``torch_npu/_op_plugin_docs.py``, read from ``$ATTNRES_KERNEL_DISTS/torch-npu``
at import: torch's dispatcher then checks every argument's name, type and
default as for the real binding) and binds ``torch_npu.npu_fusion_attention``
to it as custom_ops.py does. Its CPU kernel enforces the constraints the same
docs state (``约束说明`` and the parameter notes):

- query, key and value of one dtype, fp16, bf16 or fp32; ``input_layout`` one
  of BSH, SBH, BSND, BNSD, TND; key and value of one shape; one batch size;
- head size ``Dq == Dk``, ``Dk >= Dv``, 1-768; query heads ``head_num``, 1-256,
  a multiple of the key/value heads (GQA); sequence lengths from 1;
- ``atten_mask`` bool or uint8 only, ``True``/1 masks a position out, shaped
  BNSS, B1SS, 11SS or SS; ``padding_mask`` is not supported;
- ``scale`` is a plain multiplier (default 1.0), ``keep_prob`` in (0, 1];
- seven outputs: attention_out, softmax max and sum (float32), a reserved
  tensor, and the dropout seed, offset and length (ints).

It computes float64 attention (``_kernel_reference``) and casts back. What it
does not compute raises ``NotImplementedError`` (a stand-in's limit, not the
kernel's): layouts other than BSND/BNSD, ``pse``, dropout (``keep_prob < 1``)
and sparse modes other than 0. Deviation: CPU tensors are accepted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from _kernel_reference import attention, check

__all__ = ["SCHEMA", "npu_fusion_attention"]

#: the published schema's source, in the registry wheel's Python files
DOCS = "torch-npu/torch_npu/_op_plugin_docs.py"
_KEEP = "_attnres_torch_npu_stand_in"  # the Library must outlive this module's reloads


def _schema() -> str:
    root = os.environ.get("ATTNRES_KERNEL_DISTS", "")
    text = (Path(root) / DOCS).read_text(encoding="utf-8")
    found = re.search(r"^torch_npu\.(npu_fusion_attention\(.*\) -> \(.*\))$", text, re.M)
    if found is None:
        raise RuntimeError(f"{DOCS}: no npu_fusion_attention prototype")
    return found.group(1)


SCHEMA = _schema()
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _to_bsnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BSND":
        return t
    if layout == "BNSD":
        return t.transpose(1, 2)
    raise NotImplementedError(f"stand-in: input_layout {layout!r} is not computed here")


def _kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
    input_layout: str, pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None, atten_mask: torch.Tensor | None = None,
    scale: float = 1.0, keep_prob: float = 1.0, pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647, inner_precise: int = 0, prefix: Any = None,
    actual_seq_qlen: Any = None, actual_seq_kvlen: Any = None, sparse_mode: int = 0,
    gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:  # fmt: skip
    check(input_layout in _LAYOUTS, f"input_layout must be one of {_LAYOUTS}, got {input_layout}")
    check(
        query.dtype == key.dtype == value.dtype and query.dtype in _DTYPES,
        "query, key and value must have one dtype, float16, bfloat16 or float32",
    )
    check(key.shape == value.shape, "the shapes of key and value must be the same")
    check(padding_mask is None, "padding_mask is not supported")
    check(0.0 < keep_prob <= 1.0, f"keep_prob must be in (0, 1], got {keep_prob}")
    q, k, v = (_to_bsnd(t, input_layout) for t in (query, key, value))
    batch, seq_q, heads, size = q.shape
    seq_kv, heads_kv, size_k = k.shape[1], k.shape[2], k.shape[3]
    check(k.shape[0] == batch, "query and key must have the same batch size")
    check(size == size_k and size_k >= v.shape[3], "head dims must satisfy Dq == Dk >= Dv")
    check(1 <= size <= 768, f"head dim must be in [1, 768], got {size}")
    check(head_num == heads, f"head_num {head_num} is not the query's head count {heads}")
    check(1 <= heads <= 256, f"query heads must be in [1, 256], got {heads}")
    check(heads % heads_kv == 0, "query heads must be a multiple of key/value heads")
    check(seq_q >= 1 and seq_kv >= 1, "sequence lengths must be at least 1")
    bias = None
    if atten_mask is not None:
        check(
            atten_mask.dtype in (torch.bool, torch.uint8),
            f"atten_mask must be bool or uint8, got {atten_mask.dtype}",
        )
        shape = tuple(atten_mask.shape)
        allowed = {
            (seq_q, seq_kv), (1, 1, seq_q, seq_kv), (batch, 1, seq_q, seq_kv),
            (batch, heads, seq_q, seq_kv),
        }  # fmt: skip
        check(shape in allowed, f"atten_mask shape {shape} is not BNSS, B1SS, 11SS or SS")
        if sparse_mode != 0:
            raise NotImplementedError("stand-in: only sparse_mode 0 (defaultMask) is computed")
        masked = atten_mask.bool().expand(batch, heads, seq_q, seq_kv)
        bias = torch.zeros(masked.shape, dtype=torch.float64).masked_fill(masked, float("-inf"))
    if pse is not None or keep_prob < 1.0:
        raise NotImplementedError("stand-in: pse and dropout are not computed here")
    out64, _ = attention(q, k, v, scale=scale, bottom_right=False, bias=bias)
    out = out64.to(query.dtype)
    if input_layout == "BNSD":
        out = out.transpose(1, 2)
    stats = torch.zeros(batch, heads, seq_q, 8, dtype=torch.float32)
    return out.contiguous(), stats, stats.clone(), torch.empty(0, dtype=query.dtype), 0, 0, 0


def _library() -> Any:
    lib = getattr(torch.library, _KEEP, None)
    if lib is None:
        lib = torch.library.Library("npu", "DEF")
        lib.define(SCHEMA)
        lib.impl("npu_fusion_attention", _kernel, "CPU")
        setattr(torch.library, _KEEP, lib)
    return lib


_library()
#: as torch_npu/utils/custom_ops.py binds it
npu_fusion_attention = torch.ops.npu.npu_fusion_attention
