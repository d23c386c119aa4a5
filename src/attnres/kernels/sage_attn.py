"""``sage_attn``: SageAttention 2/2++ (``sageattention.sageattn``).

Source facts (thu-ml/SageAttention sageattention/core.py, README):
- ``sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None,
  return_lse=False, **kwargs)``; ``tensor_layout="NHD"`` is (batch, seq, heads,
  head_dim) -- attnres's layout, no transpose; returns ``out`` (plus lse only with
  ``return_lse=True``);
- ``**kwargs`` swallows anything else: ``sageattn(..., attn_mask=m)`` runs and
  silently ignores the mask. The adapter therefore refuses ``attn_mask``;
- "``is_causal``: Only applicable when qo_len == kv_len": causal with
  seq_q != seq_kv is refused;
- dtypes fp16/bf16 ("Input tensors must be in dtype of torch.float16 or
  torch.bfloat16"); head_dim <= 128 (pads < 64 to 64 and 65..127 to 128; larger
  raises "Unsupported head_dim"); num_qo_heads divisible by num_kv_heads (GQA);
- dispatches by GPU arch: sm80, sm86, sm89, sm90, sm120 (others raise
  "Unsupported CUDA architecture").
- ``sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, is_causal=False, sm_scale=None, smooth_k=True, **kwargs)``
  (Triton): packed (total, heads, head_dim) tensors, num_qo_heads divisible by
  num_kv_heads, cu_seqlens int32 or int64 and contiguous; causal "only
  applicable when qo_len == kv_len for each sequence" (the key padding route of
  attnres._varlen unpads queries and keys alike for self-attention).
- issue 23: ``sageattn`` runs one function per GPU (``get_cuda_arch_versions()
  [q.device.index]``, from ``torch.cuda.get_device_capability``) with fixed
  settings and never passes its ``**kwargs`` on, so a layer given options
  (``qk_quant_gran``, ``pv_accum_dtype``, ``smooth_k``, ...) calls that function
  itself: :func:`sage_function` picks it from the capability of the device the
  tensors are on, as ``sageattn`` does, from the table
  ``BackendSpec.entry_points`` (attnres.backends, SageAttention d1a57a54), and
  passes ``sageattn``'s own settings under the user's options. Without options
  the adapter calls ``sageattn`` as before.
- SageAttention 1 (the registry's ``sageattention`` 1.0.6: Triton; head sizes
  64/96/128, varlen 64/128; ``sageattn(q, k, v, tensor_layout, is_causal,
  sm_scale, smooth_k=True, **kwargs)``, no ``return_lse``) smooths the keys in
  place (``k -= km`` in ``core.py``), so where ``sageattn`` has no
  ``return_lse`` parameter (that release's mark) the adapter hands it a copy of
  ``k``: the caller's keys (a KV cache, a tensor other layers read) stay as
  they were (issue 31; tested through 1.0.6's own ``core.py`` in
  tests/kernels/test_real_sage.py). The varlen route packs its own copy.
- Install: ``pip install sageattention``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attnres.backends import entry_point_options
from attnres.kernels._common import (
    flash_style_kernel,
    import_kernel_package,
    kernel_function,
    require_attribute,
    takes_keywords,
    varlen_style_kernel,
)

if TYPE_CHECKING:
    from types import ModuleType

    from torch import Tensor

    from attnres.kernels import KernelFn, VarlenKernelFn

__all__ = ["make_kernel", "make_varlen_kernel", "sage_function"]

BACKEND = "sage_attn"
PACKAGE = "sageattention"
INSTALL = "pip install sageattention  (needs a CUDA GPU and a matching torch)"
_HINT = "Reinstall it with: " + INSTALL


#: What :func:`sage_function` returns: the function and the keyword arguments it gets.
SageCall = tuple[Callable[..., Any], dict[str, Any]]


def sage_function(module: ModuleType) -> Callable[[Tensor, dict[str, Any]], SageCall]:
    """``pick(q, options)``: ``sageattn`` itself when ``options`` is empty; else
    the function ``sageattn`` runs on ``q``'s device, with ``sageattn``'s own
    settings for it under ``options`` (issue 23).

    The device's capability is read as ``sageattn`` reads it
    (``torch.cuda.get_device_capability``), once per device and options; an
    option that function does not take is a :class:`~attnres.errors.BackendOptionError`
    (:func:`attnres.backends.entry_point_options`).
    """
    sageattn = require_attribute(module, "sageattn", backend=BACKEND, hint=_HINT)
    plain: SageCall = (sageattn, {})
    picked: dict[tuple[Any, ...], SageCall] = {}
    lock = threading.Lock()

    def pick(q: Tensor, options: dict[str, Any]) -> SageCall:
        if not options:
            return plain
        # per call with options: the device index and the options as given (one
        # call site gives them in one order), about 0.4 us on this CPU
        key = (q.get_device(), *options.items())
        found = picked.get(key)
        if found is not None:
            return found
        import torch  # only with options, on their first call per device

        capability = tuple(torch.cuda.get_device_capability(q.device))
        entry = entry_point_options(
            BACKEND, tuple(options.items()), capability,  # type: ignore[arg-type]
            where=f" (on the tensors' device {q.device})",
        )  # fmt: skip
        assert entry is not None  # sage_attn's spec names a function for each GPU it runs on
        function = require_attribute(module, entry.name, backend=BACKEND, hint=_HINT)
        found = (function, {**dict(entry.passes), **options})
        with lock:
            picked[key] = found
        return found

    return pick


def make_kernel() -> KernelFn:
    """Import sageattention and bind ``sageattn`` (NHD layout); with options, the
    device's own function (:func:`sage_function`)."""
    module = import_kernel_package(PACKAGE, backend=BACKEND, install=INSTALL)
    pick = sage_function(module)
    sageattn = require_attribute(module, "sageattn", backend=BACKEND, hint=_HINT)
    # issue 31: SageAttention 1 (no return_lse) subtracts the keys' mean from k in place
    smooths_in_place = not takes_keywords(sageattn, "return_lse")

    def call(
        q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, softcap: float,
        window: tuple[int, int] | None, **options: Any,
    ) -> Any:  # fmt: skip
        if smooths_in_place:
            k = k.clone()
        # issue 31: SageAttention 2's functions assert "Last dim of qkv must be
        # contiguous." (core.py); flash-attn's wrappers copy such tensors themselves
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        if not options:  # as before issue 23: the dispatcher itself
            return sageattn(q, k, v, tensor_layout="NHD", is_causal=causal, sm_scale=scale)
        function, settings = pick(q, options)
        return function(q, k, v, tensor_layout="NHD", is_causal=causal, sm_scale=scale, **settings)

    return flash_style_kernel(BACKEND, "sageattn accepts attn_mask and silently ignores it", call)


def make_varlen_kernel() -> VarlenKernelFn:
    """Import sageattention and bind ``sageattn_varlen`` (packed tokens).

    Same calling convention as :func:`attnres.kernels.fa.make_varlen_kernel`.
    """
    sageattn_varlen = kernel_function(
        PACKAGE, "sageattn_varlen", backend=BACKEND, install=INSTALL, hint=_HINT
    )

    checked: set[tuple[tuple[str, Any], ...]] = set()

    def call(
        q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
        causal: bool, scale: float | None, **options: Any,
    ) -> Any:  # fmt: skip
        # issue 23: sageattn_varlen takes smooth_k; anything else it would swallow
        key = tuple(sorted(options.items()))
        if key not in checked:
            entry_point_options(BACKEND, key, None, varlen=True, where=" (the unpad route)")
            checked.add(key)
        return sageattn_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal, sm_scale=scale, **options
        )

    return varlen_style_kernel(call)
