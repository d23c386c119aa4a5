"""``dynamic_cudnn_sdpa``: torch SDPA choosing cuDNN per shape, flash as its stand-in.

What the backend promises (catalogue): cuDNN attention where the shape allows,
standing in for both ``fa`` and ``torch_sdpa`` (it satisfies a layer whose
supported set holds both). Its public API is torch's own:

Source facts (pytorch/pytorch torch/nn/attention/__init__.py: ``sdpa_kernel``
with a list of ``SDPBackend`` members and ``set_priority=True``, torch >= 2.6;
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp):
- ``with sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, EFFICIENT_ATTENTION],
  set_priority=True):`` makes SDPA try cuDNN first, then flash, then the
  memory-efficient kernel, per call (per shape, dtype and mask); the math
  kernel is left out, so a shape none of them takes raises instead of silently
  running the slow path;
- layout, masks, scale and GQA are SDPA's: the adapter is the ``torch_sdpa``
  one, called inside that selection (as ``torch_cudnn_sdpa`` does with cuDNN
  alone).

What cuDNN refuses (``torch_cudnn_sdpa``'s ``BackendSpec.refuses``: a key/value
length of 1, deterministic mode) is no refusal here: ``select_sdp_backend``
(sdp_utils.cpp, pytorch 001f694a) goes on down the list, so such a call runs on
flash or the memory-efficient kernel, with SDPA's numbers (issue 31; tested in
tests/test_kernels_more_adapters.py).

The unverified part (docs/backends.md) is which shapes the dynamic choice
serves better; the numbers are SDPA's whichever kernel serves the call.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]


def make_kernel() -> KernelFn:
    """Bind the ``torch_sdpa`` adapter and the cuDNN-first backend selection."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnres.kernels import torch_sdpa

    backends = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ]
    # older torch has no priority order: the list is then a set, and SDPA's own
    # order (flash, efficient, cuDNN) applies among them
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return torch_sdpa.selected(lambda: sdpa_kernel(backends, set_priority=True))
    return torch_sdpa.selected(lambda: sdpa_kernel(backends))
