"""``torch_cudnn_sdpa``: torch SDPA restricted to the cuDNN backend.

Source facts (pytorch/pytorch torch/nn/attention/__init__.py: ``sdpa_kernel``
and ``SDPBackend.CUDNN_ATTENTION``; aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp ``check_cudnn_*``):
- ``with torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION):`` makes
  SDPA use cuDNN or raise (no silent fallback to another kernel);
- cuDNN attention is CUDA-only (sm80+), fp16/bf16, head size a multiple of 8 and
  at most 128 on most setups (256 on sm90/sm10x with recent cuDNN);
- layout, masks, scale and GQA are SDPA's: the adapter is the ``torch_sdpa``
  one, called inside the cuDNN-only selection;
- what cuDNN refuses that no layer fact decides (``BackendSpec.refuses``, read in
  ``sdp_utils.cpp`` at pytorch 001f694a): ``check_cudnn_tensor_shapes`` returns
  false for a key/value length of 1 ("cudnn SDPA does not support key/value
  sequence length 1"), ``check_cudnn_deterministic`` for
  ``torch.use_deterministic_algorithms(True)`` unless ``warn_only`` ("cuDNN SDPA
  is not deterministic"). With cuDNN alone enabled either one makes SDPA raise
  "No available kernel"; the adapter raises
  :class:`~attnres.errors.KernelRefusedError` first, naming the check (issue 31).

The backend list is built once in ``make_kernel``; each call enters the
``sdpa_kernel`` context (a cheap flag save/restore) around one SDPA call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnres.errors import KernelRefusedError

if TYPE_CHECKING:
    from torch import Tensor

    from attnres.kernels import KernelFn

__all__ = ["make_kernel"]

BACKEND = "torch_cudnn_sdpa"
#: the checks of pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
#: (001f694a) the adapter applies before the call (BackendSpec.refuses)
SEQ_KV_1 = (
    "sdp_utils.cpp check_cudnn_tensor_shapes: 'cudnn SDPA does not support key/value "
    "sequence length 1'"
)
DETERMINISTIC = (
    "sdp_utils.cpp check_cudnn_deterministic: 'cuDNN SDPA is not deterministic' "
    "(torch.use_deterministic_algorithms(True) without warn_only)"
)


def refusal(seq_kv: int) -> str | None:
    """Why cuDNN SDPA refuses a call with ``seq_kv`` keys in this process's torch
    mode (``None``: it does not, for these two checks)."""
    if seq_kv == 1:
        return SEQ_KV_1
    if (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        return DETERMINISTIC
    return None


def refused_error(why: str, seq_kv: int) -> KernelRefusedError:
    what = "a key/value length of 1" if why == SEQ_KV_1 else "deterministic mode"
    return KernelRefusedError(
        f"attention backend {BACKEND!r} cannot run this call ({what}, key length {seq_kv}): "
        f"cuDNN refuses it ({why}), and with cuDNN alone enabled torch would raise 'No "
        "available kernel'. Use torch_sdpa or dynamic_cudnn_sdpa for this layer (SDPA then "
        "runs another kernel for such calls)",
        BACKEND,
        why,
    )


def _refuse(k: Tensor) -> None:
    why = refusal(k.shape[1])
    if why is not None:
        raise refused_error(why, k.shape[1])


def make_kernel() -> KernelFn:
    """Bind the ``torch_sdpa`` adapter and the cuDNN-only backend selection."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnres.kernels import torch_sdpa

    backends = [SDPBackend.CUDNN_ATTENTION]
    return torch_sdpa.selected(lambda: sdpa_kernel(backends), _refuse)
