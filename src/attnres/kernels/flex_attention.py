"""``flex_attention``: ``torch.nn.attention.flex_attention.flex_attention``.

Source facts (pytorch/pytorch torch/nn/attention/flex_attention.py, torch 2.13):
- ``flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
  enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None)``,
  layout (batch, heads, seq, head_size); returns the output tensor only unless
  ``return_lse``/``return_aux`` is set;
- masking is a ``BlockMask`` built by ``create_block_mask(mask_mod, B, H, Q_LEN,
  KV_LEN, device=...)`` from ``mask_mod(b, h, q_idx, kv_idx) -> bool``; ``B``/``H``
  ``None`` broadcast the mask over batch/heads; rows with no allowed key give 0;
- a float bias goes through ``score_mod(score, b, h, q_idx, kv_idx)``, which
  returns the modified score (here ``score + bias[b, h, q_idx, kv_idx]``);
- ``enable_gqa=True`` shares each k/v head among heads_q // heads_kv query heads;
  ``h`` given to score_mod/mask_mod is the query head;
- CPU support since torch 2.6; called outside ``torch.compile`` it runs an
  unfused implementation that materialises the full score matrix and emits a
  one-time ``UserWarning`` ("flex_attention called without torch.compile()")
  from torch itself. Verified here on CPU, torch 2.13, eager: fp32 results match
  SDPA within 2e-6 for head sizes 16-256 (powers of two or not), odd sequence
  lengths, bool masks, float masks, causal and GQA. The warning is torch's
  honest performance notice and is left alone; compile the model for speed.

Causal is top-left (``q_idx >= kv_idx``), like SDPA's ``is_causal``; a sliding
``window`` is a band of the same diagonal in the block mask, and ``softcap``
is a ``score_mod`` (``softcap * tanh(score / softcap)``, before a float bias). The block
mask is built per call (it depends on the sequence lengths and the mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from attnres.errors import InvalidArgumentError
from attnres.kernels._common import window_keep

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]

_MaskMod = Callable[["Tensor", "Tensor", "Tensor", "Tensor"], "Tensor"]


def _as_4d(attn_mask: Tensor) -> Tensor:
    """View ``attn_mask`` with leading size-1 dims so that it has exactly 4 dims."""
    missing = 4 - attn_mask.dim()
    if missing < 0:
        raise InvalidArgumentError(
            f"attn_mask must have at most 4 dims, got shape {tuple(attn_mask.shape)}"
        )
    return attn_mask.reshape((1,) * missing + tuple(attn_mask.shape)) if missing else attn_mask


def _mask_mod(keep: Tensor | None, causal: bool) -> _MaskMod:
    """The mask_mod for a boolean ``keep`` mask (indexed by b, h), causal, or both."""
    if keep is None:

        def causal_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return q_idx >= kv_idx

        return causal_mod
    if not causal:

        def keep_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return keep[b, h, q_idx, kv_idx]

        return keep_mod

    def keep_causal_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return keep[b, h, q_idx, kv_idx] & (q_idx >= kv_idx)

    return keep_causal_mod


def _score_mod(softcap: float, bias: Tensor | None) -> Callable[..., Tensor]:
    """The score_mod for a softcap (applied first, as flash-attn does), a float bias, or both."""
    if not softcap:
        assert bias is not None

        def bias_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + bias[b, h, q_idx, kv_idx]

        return bias_mod

    def softcap_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        capped = torch.tanh(score / softcap) * softcap
        return capped if bias is None else capped + bias[b, h, q_idx, kv_idx]

    return softcap_mod


def make_kernel() -> KernelFn:
    """Import flex_attention and bind it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def attention(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
        scale: float | None, *, softcap: float = 0.0, window: tuple[int, int] | None = None,
    ) -> Tensor:  # fmt: skip
        batch, seq_q, heads_q, _ = q.shape
        seq_kv = k.shape[1]
        score_mod: Callable[..., Tensor] | None = None
        bias: Tensor | None = None
        block_mask = None
        keep: Tensor | None = None
        mask_batch: int | None = None  # None: the block mask broadcasts over batch
        mask_heads: int | None = None  # None: ... over heads
        if attn_mask is not None:
            mask = _as_4d(attn_mask)
            if mask.dtype == torch.bool:
                # The block mask only needs per-batch/per-head blocks where the mask
                # has those dims; mask_mod itself is evaluated for every (b, h) by
                # the unfused path, so it indexes the fully expanded (view) mask.
                mask_batch = None if mask.shape[0] == 1 else batch
                mask_heads = None if mask.shape[1] == 1 else heads_q
                keep = mask.expand(batch, heads_q, seq_q, seq_kv)
            else:
                bias = mask.expand(batch, heads_q, seq_q, seq_kv)
        if window is not None:  # the window is a band in the block mask
            band = window_keep(q, seq_q, seq_kv, window).view(1, 1, seq_q, seq_kv)
            keep = band.expand(batch, heads_q, seq_q, seq_kv) if keep is None else keep & band
        if softcap or bias is not None:
            score_mod = _score_mod(softcap, bias)
        if keep is not None or causal:
            block_mask = create_block_mask(
                _mask_mod(keep, causal), mask_batch, mask_heads, seq_q, seq_kv, device=q.device
            )
        out = flex_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=heads_q != k.shape[2],
        )
        return out.transpose(1, 2)

    return attention
