"""``torch_sdpa``: ``torch.nn.functional.scaled_dot_product_attention``.

Source facts (pytorch/pytorch, torch/nn/functional.py docstring, torch 2.5+):
- layout (batch, heads, seq, head_size): the adapter transposes dims 1 and 2 of
  q, k, v (views, no copy) and transposes the output back;
- ``attn_mask``: bool (True takes part) or float (added to the scores),
  broadcastable to (batch, heads, seq_q, seq_kv);
- ``is_causal``: top-left aligned lower-triangular mask; the docstring says an
  error is thrown when both ``attn_mask`` and ``is_causal`` are set (torch 2.13
  on CPU accepts and combines them), so the adapter folds the causal mask into
  ``attn_mask`` itself;
- ``scale`` (None: 1/sqrt(head_size)) and ``enable_gqa`` (torch >= 2.5): k/v heads
  are shared by groups of heads_q // heads_kv query heads, as repeat_interleave;
- dtypes: fp32, fp64, fp16, bf16 on CPU; output in q's dtype;
- no sliding-window argument: a ``window`` is folded into ``attn_mask`` (a
  boolean band, top-left aligned); no softcap argument: ``softcap`` is refused.

Kept lean: the layer benchmark holds it to 1.03x a hand-written SDPA call with
the same transposes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from attnres.kernels._common import sdpa_style_mask

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel", "selected"]


def make_kernel() -> KernelFn:
    """Bind SDPA once; the returned function does one SDPA call per forward."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attention(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
        scale: float | None, *, softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> Tensor:  # fmt: skip
        # SDPA has no window argument: the window is a mask (the causal one folded in)
        attn_mask, causal = sdpa_style_mask("torch_sdpa", q, k, attn_mask, causal, softcap, window)
        # attn_mask, dropout_p and is_causal positionally: measurably cheaper at
        # small shapes, where Python overhead is the cost (scale and enable_gqa
        # are keyword-only in SDPA's schema)
        return sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, 0.0, causal,
            scale=scale, enable_gqa=q.shape[2] != k.shape[2],
        ).transpose(1, 2)  # fmt: skip

    def specialize(
        causal: bool, scale: float | None, gqa: bool
    ) -> Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]:
        """``attention`` with the layer's fixed settings bound (see attnres.kernels)."""
        if scale is None and not gqa:

            def attention_plain(
                q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None
            ) -> Tensor:
                if attn_mask is not None and causal:
                    return attention(q, k, v, attn_mask, causal, None)
                return sdpa(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, 0.0, causal
                ).transpose(1, 2)

            return attention_plain

        def attention_bound(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
            if attn_mask is not None and causal:
                return attention(q, k, v, attn_mask, causal, scale)
            return sdpa(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, 0.0, causal,
                scale=scale, enable_gqa=gqa,
            ).transpose(1, 2)  # fmt: skip

        return attention_bound

    attention.specialize = specialize  # type: ignore[attr-defined]
    # zero-length keys: SDPA's own answer is the one every adapter gives
    # (kernels._common.keeps_empty_keys), so its calls need no guard in front
    attention.keeps_empty_keys = True  # type: ignore[attr-defined]
    return attention


def _refuses_nothing(k: Tensor) -> None:
    return None


def selected(
    selection: Callable[[], AbstractContextManager[object]],
    refuse: Callable[[Tensor], None] = _refuses_nothing,
) -> KernelFn:
    """The SDPA adapter called inside ``selection()`` (a ``sdpa_kernel`` context:
    the SDPA kernels it may run), after ``refuse(k)`` (raises for a call that
    selection cannot run): ``torch_cudnn_sdpa`` and ``dynamic_cudnn_sdpa``."""
    sdpa_attention = make_kernel()

    def attention(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
        scale: float | None, **features: Any,
    ) -> Tensor:  # fmt: skip
        refuse(k)
        with selection():
            return sdpa_attention(q, k, v, attn_mask, causal, scale, **features)

    return attention
