"""``aiter``: AMD aiter flash attention (``aiter.flash_attn_func``, ROCm).

Source facts (ROCm/aiter aiter/ops/mha.py, re-exported as ``aiter.flash_attn_func``):
- ``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
  window_size=(-1, -1), bias=None, alibi_slopes=None, deterministic=True,
  return_lse=False, return_attn_probs=False)`` (``bias`` appeared in 2025;
  older releases lack it); layout (batch, seqlen, nheads, headdim), GQA with
  nheads % nheads_k == 0;
- return value: current releases return ``out`` alone unless ``return_lse`` /
  ``return_attn_probs`` (``result[0] if len(result) == 1 else tuple(result)``);
  older ones returned ``tuple(result)`` -- a 1-tuple ``(out,)``. The adapter
  accepts both;
- fp16/bf16 only (kernels are generated per dtype); head dim <= 256, padded to a
  multiple of 8 by the wrapper;
- ``causal=True`` is bottom-right aligned when seqlen_q != seqlen_k (docstring):
  causal with seq_q != seq_kv is refused;
- ``bias`` is a single (seqlen_q, seqlen_k) tensor, not SDPA's broadcastable
  mask, and is missing in older releases: ``attn_mask`` is refused (the
  catalogue does not list attention masks for aiter);
- ``window_size=(left, right)`` (-1 unbounded) is sliding-window attention,
  bottom-right aligned like causal; there is no softcap argument.
- Install: ``pip install amd-aiter`` or build ROCm/aiter from source. The
  unrelated PyPI package ``aiter`` (async iterators) imports under the same
  name and has no ``flash_attn_func``: that case is reported as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnres.kernels._common import (
    flash_feature_kwargs,
    flash_style_kernel,
    import_kernel_package,
    require_attribute,
)

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]

BACKEND = "aiter"
PACKAGE = "aiter"
INSTALL = "pip install amd-aiter  (or build https://github.com/ROCm/aiter; needs ROCm)"


def make_kernel() -> KernelFn:
    """Import aiter and bind ``flash_attn_func``."""
    module = import_kernel_package(PACKAGE, backend=BACKEND, install=INSTALL)
    flash_attn_func = require_attribute(
        module,
        "flash_attn_func",
        backend=BACKEND,
        hint=(
            "This is probably the unrelated PyPI package 'aiter' (async iterators), not AMD "
            "aiter; install AMD's with: " + INSTALL
        ),
    )

    def call(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        scale: float | None,
        softcap: float,
        window: tuple[int, int] | None,
    ) -> Any:
        extra = flash_feature_kwargs(softcap, window)  # softcap is refused above (takes)
        return flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, **extra)

    return flash_style_kernel(
        BACKEND,
        "aiter.flash_attn_func takes no SDPA-style mask",
        call,
        takes=frozenset({"window"}),
    )
