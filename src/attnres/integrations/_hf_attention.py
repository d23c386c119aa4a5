"""attnres's own attention function and mask function in transformers (issue 22).

transformers looks a module's attention function up by
``config._attn_implementation`` in ``ALL_ATTENTION_FUNCTIONS`` and builds the
model's masks with the function of the same name in
``ALL_MASK_ATTENTION_FUNCTIONS``. attnres registers both under its own name,
:data:`NAME` (``"attnres"``), and selects it per model by setting that model's
config (never transformers' process-wide default), so a text encoder runs the
attnres kernel each of its sites was decided -- SageAttention, xformers, FA4,
anything with an adapter -- and not only the handful transformers ships.

- The mask function is transformers' ``sdpa_mask`` under attnres's name: a
  boolean (batch, 1, seq_q, seq_kv) mask that keeps the padding, or ``None``
  when the call is plain causal or unmasked. Padding is never dropped (a name
  with an attention function but no mask function would get no mask at all).
- The attention function runs the site's route (:func:`bind_module`, a
  :class:`~attnres.integrations._route.GenericRoute`): the kernel decided for
  the call's signature -- for a key-padding site on a varlen kernel, the unpad
  route of :mod:`attnres._varlen`. Issue 19: the first call of each signature
  is checked against the plan (mask and its kind, causal, scale, head size, kv
  heads, dtype, dropout), through the same first-call check as every other
  routed site: a difference resolves the site again with the observed facts
  (traced, "observed at first call: ..."), or raises ``ResolutionError``
  naming the site and the fact in a strict component. T5's ``position_bias``
  (an additive mask) reaches a kernel only as a float mask -- a site planned
  for it was given a kernel that takes additive masks.

Padded positions (docs/masks.md): on the unpad route a padded query position
comes back as zeros where the mask marks it (causal masks, transformers'
combined 4-D ones) and is computed where every query shares the mask;
transformers' SDPA gives attention over the valid keys there. A text
encoder's consumers mask those positions.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnres.backends import Backend, registered_backends
from attnres.integrations._route import GenericRoute
from attnres.kernels import KernelSource, kernel_source

__all__ = [
    "NAME",
    "attention_forward",
    "backends_for",
    "bind_module",
    "bound_route",
    "mask_function",
    "register",
    "unbind_module",
]

#: The name attnres's functions are registered under in both interfaces.
NAME = "attnres"
#: The attribute holding a module's route (set by apply, removed by remove).
_ROUTE_ATTR = "_attnres_kernel"
_SDPA = torch.nn.functional.scaled_dot_product_attention


def mask_function(*args: Any, **kwargs: Any) -> Any:
    """transformers' boolean SDPA mask, under attnres's name (padding kept)."""
    return sdpa_mask(*args, **kwargs)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention interface's calling convention, running the site's attnres kernel.

    q, k, v arrive as (batch, heads, seq, head_size) and the output leaves as
    (batch, seq, heads, head_size), as transformers' SDPA function does.
    """
    route: GenericRoute | None = module.__dict__.get(_ROUTE_ATTR)
    if route is None:
        raise RuntimeError(
            f"{type(module).__name__}: its config selects the attention implementation "
            f"{NAME!r}, but attnres installed no kernel on this module; run "
            f"attnres.integrations.transformers.apply on the model (or set another "
            f"attn_implementation)"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"attnres attention at {route.name!r} of component {route.component!r}: the call "
            f"passes a logit softcap, which attnres's transformers function does not hand to "
            f"kernels; decide this component a backend transformers runs itself (eager, fa, "
            f"flex_attention)"
        )
    if kwargs.get("s_aux") is not None:  # attention sinks (GPT-OSS): never offered them
        raise ValueError(
            f"attnres attention at {route.name!r} of component {route.component!r}: the call "
            f"passes attention sinks (s_aux), which attnres's transformers function does not "
            f"implement; decide this component a backend transformers runs itself (eager, fa)"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    q_length = query.shape[2]
    mask = attention_mask
    if position_bias is not None:  # T5: the additive bias, with the padding folded in
        bias = position_bias.to(query.dtype)
        if mask is not None:
            bias = (
                bias.masked_fill(~mask, float("-inf"))
                if mask.dtype == torch.bool
                else (bias + mask)
            )
        mask = bias
    # transformers' SDPA rule: the causal flag only when no mask carries it
    causal = bool(q_length > 1 and mask is None and causal)
    # the call's facts, checked once per signature against the plan (issue 19)
    kernel = route.kernel_for(query, key, mask, dropout, causal, scaling, -3)
    if kernel is None:  # resolved again to torch SDPA (dropout, a fallback): run it here
        out = _SDPA(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=causal,
            scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None
    out = kernel(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        mask,
        causal,
        scaling,
    )
    return out.contiguous(), None


def backends_for(model_class: type) -> frozenset[Backend]:
    """The backends attnres's function runs for a model class: every dense backend
    with a kernel, when the class dispatches through the attention interface
    (``_supports_attention_backend``) -- none otherwise."""
    if not getattr(model_class, "_supports_attention_backend", False):
        return frozenset()
    return frozenset(
        Backend(spec.name)
        for spec in registered_backends()
        if not spec.sparse and kernel_source(spec.name) is not KernelSource.NONE
    )


def register() -> None:
    """Register :data:`NAME` in both interfaces (idempotent; nothing else changes)."""
    if ALL_ATTENTION_FUNCTIONS.get(NAME) is not attention_forward:
        ALL_ATTENTION_FUNCTIONS.register(NAME, attention_forward)
    if ALL_MASK_ATTENTION_FUNCTIONS.get(NAME) is not mask_function:
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, mask_function)


def bind_module(module: torch.nn.Module, route: GenericRoute) -> None:
    """Give ``module`` its site's route (the planned signature's kernel bound)."""
    module.__dict__[_ROUTE_ATTR] = route


def bound_route(module: torch.nn.Module) -> GenericRoute | None:
    """The route :func:`bind_module` gave ``module`` (``None``: none)."""
    route = module.__dict__.get(_ROUTE_ATTR)
    return route if isinstance(route, GenericRoute) else None


def unbind_module(module: torch.nn.Module) -> None:
    module.__dict__.pop(_ROUTE_ATTR, None)
