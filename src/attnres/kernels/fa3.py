"""``fa3``: FlashAttention-3 (``flash_attn_interface.flash_attn_func``, built from hopper/).

Source facts (Dao-AILab/flash-attention hopper/flash_attn_interface.py):
- ``flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None,
  q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
  attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
  deterministic=False, sm_margin=0, return_attn_probs=False)`` -- there is no
  ``dropout_p`` (FA3 has no dropout);
- return value: older builds always return ``(out, softmax_lse)``; since
  flash-attention PR #1851 (2025-08, "Allow returning LSE via kwarg") it returns
  ``out`` unless ``return_attn_probs=True`` (diffusers PR #13173 / #12851 fixed
  the resulting "not enough values to unpack"). The adapter accepts both;
- layout (batch, seqlen, nheads, headdim), GQA with nheads % nheads_k == 0;
- fp16, bf16 (and fp8 e4m3 forward); head dim <= 256;
- ``causal=True`` is bottom-right aligned when seqlen_q != seqlen_k (docstring),
  so causal with seq_q != seq_kv is refused; no mask argument: ``attn_mask`` is
  refused;
- ``window_size=(left, right)`` (-1 unbounded) and ``softcap`` work as in
  flash-attn 2 (bottom-right aligned window); passed only when set.
- Module name: ``flash_attn_interface`` (distribution ``flash_attn_3``, built
  with ``cd hopper && python setup.py install``); newer builds also ship it as
  ``flash_attn_3.flash_attn_interface``, tried second.
- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, seqused_q=None, seqused_k=None, softmax_scale=None,
  causal=False, ...)`` over packed (total, nheads, headdim) tensors (the key
  padding route of attnres._varlen); causal bottom-right per sequence.
  ``seqused_q``/``seqused_k`` (``mha_fwd`` in hopper/flash_api.cpp: int32,
  contiguous, shape (batch,); hopper/seqlen.h: sequence ``b`` is the
  ``seqused[b]`` tokens from ``cu_seqlens[b]`` on; the output is
  ``torch::empty``, so rows outside every sequence are left unwritten, and so
  are dq/dk/dv there in the backward pass): the span route hands it the padded
  layout as is (flash-attention 0251105a). The adapter passes them only where
  the imported function's signature names them.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from attnres.kernels._common import (
    KernelUnavailableError,
    flash_call,
    flash_style_kernel,
    flash_varlen_call,
    import_kernel_package,
    require_attribute,
    takes_keywords,
    varlen_style_kernel,
)

if TYPE_CHECKING:
    from attnres.kernels import KernelFn, VarlenKernelFn

__all__ = ["make_kernel", "make_varlen_kernel"]

BACKEND = "fa3"
PACKAGE = "flash_attn_interface"
INSTALL = (
    "git clone https://github.com/Dao-AILab/flash-attention && "
    "cd flash-attention/hopper && python setup.py install  (FlashAttention-3, Hopper GPUs)"
)


def _import() -> ModuleType:
    try:
        return import_kernel_package(PACKAGE, backend=BACKEND, install=INSTALL)
    except KernelUnavailableError as first:
        try:
            return import_kernel_package(
                "flash_attn_3.flash_attn_interface", backend=BACKEND, install=INSTALL
            )
        except KernelUnavailableError:
            raise first from first.__cause__


def _function(name: str) -> Any:
    hint = "The FlashAttention-3 build looks incomplete; reinstall it with: " + INSTALL
    return require_attribute(_import(), name, backend=BACKEND, hint=hint)


def make_kernel() -> KernelFn:
    """Import flash_attn_interface and bind ``flash_attn_func``; it takes the spec's
    options (issue 23: ``deterministic``, ``pack_gqa``)."""
    return flash_style_kernel(
        BACKEND,
        "flash_attn_interface.flash_attn_func has no mask argument",
        flash_call(_function("flash_attn_func")),
        takes=frozenset({"softcap", "window"}),
    )


def make_varlen_kernel() -> VarlenKernelFn:
    """Import flash_attn_interface and bind ``flash_attn_varlen_func`` (packed tokens).

    Same calling convention as :func:`attnres.kernels.fa.make_varlen_kernel`;
    ``cu_seqlens`` arrive as contiguous int32 (attnres._varlen builds them so).
    issue 23: hopper ``flash_attn_varlen_func(..., pack_gqa=None,
    deterministic=False)`` takes the spec's options; ``seqused_q``/``seqused_k``
    (when the route passes them) are keywords too.
    """
    varlen_func = _function("flash_attn_varlen_func")
    return varlen_style_kernel(
        flash_varlen_call(varlen_func),
        takes_seqused=takes_keywords(varlen_func, "seqused_q", "seqused_k"),
    )
