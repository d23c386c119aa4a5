"""``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``, PyPI flash-attn-4).

Source facts (Dao-AILab/flash-attention flash_attn/cute/interface.py and
flash_attn/cute/pyproject.toml; PyPI page of flash-attn-4):
- ``pip install flash-attn-4``; ``from flash_attn.cute import flash_attn_func``;
- ``flash_attn_func(q, k, v, softmax_scale=None, causal=False,
  window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
  pack_gqa=None, deterministic=False, mask_mod=None, full_block_cnt=None,
  full_block_idx=None, mask_block_cnt=None, mask_block_idx=None, block_size=None,
  return_lse=False)`` -- no ``dropout_p``; older betas lack ``return_lse``;
- return value: ``FlashAttnFunc.forward`` returns ``(out, lse)`` always (lse is
  None when not needed); flash-attention PR #2700 proposes returning ``out``
  alone unless ``return_lse``. The adapter accepts both;
- asserts: "inputs must be float16 or bfloat16", "head_dim must be less than or
  equal to 256", head_dim divisible by 16 // element_size (8 for fp16/bf16),
  "num_head must be divisible by num_head_kv" (GQA), CUDA arch 9.x-11.x;
- causal is bottom-right aligned (mask.py: ``causal_row_offset = 1 + seqlen_k -
  n_block * tile_n - seqlen_q``): causal with seq_q != seq_kv is refused; masks
  exist only as CuTe ``mask_mod`` callables, not tensors: ``attn_mask`` is refused;
- ``window_size=(left, right)`` with ``None`` for an unbounded side (the adapter
  turns attnres's -1 into None) and ``softcap``; passed only when set.
- ``flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None,
  max_seqlen_q=None, max_seqlen_k=None, ..., softmax_scale=None, causal=False,
  ...)`` (flash-attention 0251105a): packed (total, nheads, headdim) tensors;
  ``_flash_attn_fwd`` asserts "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k
  must be int32" and "... must be contiguous"; ``qv`` became the fourth
  positional parameter in f219c89c (flash-attention PR #2441; before it,
  ``cu_seqlens_q`` was), so the adapter passes everything after ``v`` by
  keyword; ``FlashAttnVarlenFunc`` returns ``(out, lse)``; its causal mask is
  bottom-right per sequence (attnres._varlen unpads queries and keys alike for
  self-attention, where that is the same mask).
- ``seqused_q``/``seqused_k`` keywords (same asserts: int32, contiguous, shape
  (batch,); flash_attn/cute/seqlen_info.py: sequence ``b`` is the
  ``seqused[b]`` tokens from ``cu_seqlens[b]`` on; ``out`` is ``torch.empty``):
  the span route of attnres._varlen hands it the padded layout as is, where the
  imported function's signature names them. Not with head_dim 256 on sm100
  ("SM100 forward with head_dim=256 does not support seqused_q/seqused_k"):
  the catalogue caps fa4 at head size 128, so no plan reaches that case.
- flash-attn 2.8.3 installs its own early ``flash_attn.cute`` (``__version__``
  0.1.0) under the same import name: its ``flash_attn_varlen_func(q, k, v,
  cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, softmax_scale,
  causal, window_size, learnable_sink, softcap, pack_gqa)`` has no
  ``max_seqlen_q`` / ``max_seqlen_k`` (it reads the lengths from
  ``cu_seqlens``) and neither function takes ``deterministic``; both return
  ``(out, lse)``. Its backward is broken: ``FlashAttnFunc.backward`` returns 8
  gradients for the forward's 9 inputs (autograd raises "returned an incorrect
  number of gradients") and ``FlashAttnVarlenFunc.backward`` raises
  ``NotImplementedError``. The catalogue gives that release no backward pass,
  and the adapter refuses a call whose inputs need gradients with
  :class:`~attnres.errors.KernelRefusedError` before the forward runs (it is
  recognised by the ``__version__ = "0.1.0"`` its ``__init__`` hard-codes;
  flash-attn-4 reads its own from the installed metadata). The
  adapter passes the lengths only where the function names them, and an option
  the imported function does not take is a
  :class:`~attnres.errors.BackendOptionError` naming the installed version
  (issue 31; tested through both releases' own ``interface.py`` in
  tests/kernels/test_real_flash_attn.py and test_real_fa4.py).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from attnres.errors import BackendOptionError, KernelRefusedError
from attnres.kernels._common import (
    flash_call,
    flash_style_kernel,
    kernel_function,
    takes_keywords,
    varlen_style_kernel,
)

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn, VarlenKernelFn

__all__ = ["make_kernel", "make_varlen_kernel"]

BACKEND = "fa4"
PACKAGE = "flash_attn.cute"
INSTALL = "pip install flash-attn-4  (FlashAttention-4, Hopper/Blackwell GPUs)"


def _function(name: str) -> Any:
    hint = "The flash-attn-4 install looks incomplete; reinstall it with: " + INSTALL
    return kernel_function(PACKAGE, name, backend=BACKEND, install=INSTALL, hint=hint)


#: issue 31: the ``__version__`` flash-attn 2.x's own early flash_attn.cute hard-codes
#: (flash-attn 2.8.3 flash_attn/cute/__init__.py)
EARLY_CUTE_VERSION = "0.1.0"
EARLY_CUTE_BACKWARD = (
    "flash-attn 2.8.3 (registry sdist) flash_attn/cute/interface.py (cute 0.1.0): "
    "FlashAttnFunc.backward returns 8 gradients for the forward's 9 inputs and "
    "FlashAttnVarlenFunc.backward raises NotImplementedError"
)


def _early_cute() -> bool:
    """Whether the imported flash_attn.cute is flash-attn 2.x's early one."""
    return getattr(sys.modules.get(PACKAGE), "__version__", None) == EARLY_CUTE_VERSION


def _needs_grad(q: Tensor, k: Tensor, v: Tensor) -> bool:
    import torch

    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _no_backward_error() -> KernelRefusedError:
    return KernelRefusedError(
        f"attention backend {BACKEND!r}: the installed {PACKAGE} is flash-attn 2.x's early "
        f"one (version {EARLY_CUTE_VERSION}), whose backward pass does not work "
        f"({EARLY_CUTE_BACKWARD}); this call's inputs need gradients. Run the layer "
        f"under torch.no_grad(), resolve it with the backward requirement (another "
        f"backend is chosen), or install FlashAttention-4 with: {INSTALL}",
        BACKEND,
        EARLY_CUTE_BACKWARD,
    )


def _option_check(fn: Callable[..., Any]) -> Callable[[Mapping[str, Any]], None]:
    """``check(options)``: a :class:`BackendOptionError` for an option ``fn`` has no
    parameter for (flash-attn 2.8.3's early ``flash_attn.cute`` takes no
    ``deterministic``), instead of the ``TypeError`` of the first call."""
    try:
        taken = frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # unreadable: let the call say
        return lambda options: None
    version = getattr(sys.modules.get(PACKAGE), "__version__", "unknown")

    def check(options: Mapping[str, Any]) -> None:
        for name in options:
            if name not in taken:
                raise BackendOptionError(
                    f"attention backend {BACKEND!r}: the installed {PACKAGE} (version "
                    f"{version}) has no {name!r} argument in {fn.__name__}; flash-attn "
                    f"2.8.3 ships an early flash_attn.cute (0.1.0) without it. Drop the "
                    f"option or install FlashAttention-4 with: {INSTALL}",
                    BACKEND,
                    name,
                )

    return check


def make_kernel() -> KernelFn:
    """Import flash_attn.cute and bind ``flash_attn_func``."""
    flash_attn_func = _function("flash_attn_func")
    check = _option_check(flash_attn_func)
    early = _early_cute()
    plain = flash_call(flash_attn_func, unbounded=None)  # FA4: None, not -1

    def call(q: Tensor, k: Tensor, v: Tensor, *args: Any, **options: Any) -> Any:
        if early and _needs_grad(q, k, v):
            raise _no_backward_error()
        if options:  # issue 23: the spec's declared options (deterministic, ...)
            check(options)
        return plain(q, k, v, *args, **options)

    return flash_style_kernel(
        BACKEND,
        "flash_attn.cute takes masks only as CuTe mask_mod",
        call,
        takes=frozenset({"softcap", "window"}),
    )


def make_varlen_kernel() -> VarlenKernelFn:
    """Import flash_attn.cute and bind ``flash_attn_varlen_func`` (packed sequences).

    The varlen calling convention of :func:`attnres.kernels._common.varlen_style_kernel`;
    every argument after ``v`` is passed by keyword (``qv`` took the fourth
    position in later releases). Its causal mask is bottom-right per sequence.
    """
    varlen_func = _function("flash_attn_varlen_func")
    check = _option_check(varlen_func)
    early = _early_cute()
    # issue 31: flash-attn 2.8.3's early flash_attn.cute reads the lengths from cu_seqlens
    takes_lengths = takes_keywords(varlen_func, "max_seqlen_q", "max_seqlen_k")

    def call(
        q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
        causal: bool, scale: float | None, **options: Any,
    ) -> Any:  # fmt: skip
        if early and _needs_grad(q, k, v):
            raise _no_backward_error()
        # issue 23: the spec's options (deterministic, pack_gqa) where the route passes
        # them, and seqused_q/seqused_k where the span route does
        if options:
            check(
                {name: value for name, value in options.items() if not name.startswith("seqused_")}
            )
        if takes_lengths:
            options["max_seqlen_q"], options["max_seqlen_k"] = max_q, max_k
        return varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal,
            **options,
        )  # fmt: skip

    return varlen_style_kernel(
        call, takes_seqused=takes_keywords(varlen_func, "seqused_q", "seqused_k")
    )
