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
  Issue 19: a class that does not declare ``_supports_sdpa`` runs the same
  attention function under :data:`EAGER_MASKS`, whose mask function is
  transformers' additive ``eager_mask`` (:func:`name_for`).
- The attention function runs the site's route (:func:`bind_module`, a
  :class:`~attnres.integrations._route.GenericRoute`): the kernel decided for
  the call's signature -- for a key-padding site on a varlen kernel, the unpad
  route of :mod:`attnres._varlen`. Issue 19: the first call of each signature
  is checked against the plan, as at every routed site, and so is a call
  argument no attnres kernel takes (``softcap``, attention sinks, sparse
  indices), which only the model's own eager function serves. T5's
  ``position_bias`` (an additive mask) reaches a kernel only as a float mask.

Padded positions (docs/masks.md): on the unpad route a padded query position
comes back as zeros where the mask marks it (causal masks, transformers'
combined 4-D ones) and is computed where every query shares the mask;
transformers' SDPA gives attention over the valid keys there. A text
encoder's consumers mask those positions.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from attnres.backends import Backend, registered_backends
from attnres.errors import InvalidStateError
from attnres.integrations._route import GenericRoute
from attnres.kernels import KernelSource, kernel_source

__all__ = [
    "EAGER_MASKS",
    "NAME",
    "NAMES",
    "attention_forward",
    "backends_for",
    "bind_module",
    "bound_route",
    "eager_mask_function",
    "eager_masks_forward",
    "mask_function",
    "name_for",
    "opt_out_flag",
    "register",
    "unbind_module",
]

#: The name attnres's functions are registered under in both interfaces.
NAME = "attnres"
#: Issue 19: the same attention function under a second name whose mask function
#: is transformers' eager one (additive float masks), for a model class whose code
#: was written for eager's masks (:func:`name_for`); a call without a mask is
#: unmasked there, as in eager (:func:`eager_masks_forward`)
EAGER_MASKS = "attnres_eager_masks"
#: the names attnres's attention functions run under
NAMES = frozenset({NAME, EAGER_MASKS})
#: The attribute holding a module's route (set by apply, removed by remove).
_ROUTE_ATTR = "_attnres_kernel"
_SDPA = torch.nn.functional.scaled_dot_product_attention
#: Call arguments the attention interface passes that no attnres kernel takes
#: (checked against transformers 5.25.0 by reading every ``attention_interface``
#: call): a logit softcap (Gemma 2, VideoPrism), attention sinks (``s_aux``:
#: GPT-OSS, GraniteMoE-SWA; ``sinks``: Inkling 2), sparse indices the eager and
#: SDPA paths fold into the mask but other functions are handed (``indices``:
#: dots3; ``block_indices``: MiniMax-M3). ``sliding_window`` is not one: the
#: mask function (``sdpa_mask``) already applies the window, as for SDPA.
_OWN_ONLY = ("softcap", "s_aux", "sinks", "indices", "block_indices")


def mask_function(*args: Any, **kwargs: Any) -> Any:
    """transformers' boolean SDPA mask, under attnres's name (padding kept)."""
    return sdpa_mask(*args, **kwargs)


def eager_mask_function(*args: Any, **kwargs: Any) -> Any:
    """transformers' eager (additive) mask, under :data:`EAGER_MASKS`."""
    return eager_mask(*args, **kwargs)


def name_for(model_class: type) -> str:
    """The name attnres's function runs ``model_class``'s sites under: :data:`NAME`
    (sdpa's boolean masks) where the class declares ``_supports_sdpa = True``,
    else :data:`EAGER_MASKS` (the masks its code was written for: every class
    runs eager). Measured on tiny builds: LongT5, BigBirdPegasus and Informer
    leave the flag unset; under sdpa's masks their outputs moved by 42%, 6% and
    0.4% (a by-hand attention adding the boolean mask to its scores, a position
    bias summed with it), under eager's they match to 1e-7."""
    return NAME if _declared(model_class, "_supports_sdpa") else EAGER_MASKS


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention interface's calling convention, running the site's attnres kernel.

    q, k, v arrive as (batch, heads, seq, head_size) and the output leaves as
    (batch, seq, heads, head_size), as transformers' SDPA function does.
    """
    route: GenericRoute | None = module.__dict__.get(_ROUTE_ATTR)
    if route is None:
        raise InvalidStateError(
            f"{type(module).__name__}: its config selects the attention implementation "
            f"{NAME!r}, but attnres installed no kernel on this module; run "
            f"attnres.integrations.transformers.apply on the model (or set another "
            f"attn_implementation)"
        )
    # issue 19: an argument no attnres kernel takes is never dropped silently; the
    # call's facts say so, and only the model's own eager function serves it
    arguments = tuple(name for name in _OWN_ONLY if kwargs.get(name) is not None)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    q_length, kv_length = query.shape[2], key.shape[2]
    mask = attention_mask
    # transformers' SDPA rule: the causal flag only when no mask carries it
    causal = bool(q_length > 1 and mask is None and causal)
    plain_causal = causal  # what the model's own eager is told (it adds the bias itself)
    if position_bias is not None:  # T5: the additive bias, with the padding folded in
        bias = position_bias.to(query.dtype)
        if mask is not None:
            bias = (
                bias.masked_fill(~mask, float("-inf"))
                if mask.dtype == torch.bool
                else (bias + mask)
            )
        elif causal:
            # issue 30: a decoder's plain causal call (transformers left it no mask):
            # the triangle folded into the bias, as transformers' create_position_bias_mask
            # does (top-left, the keys beyond the queries of an empty static cache cut)
            tri = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device)
            bias = bias.masked_fill(~tri.tril()[None, None], torch.finfo(query.dtype).min)
            causal = False  # the mask carries it now
        mask = bias
    # the call's facts, checked once per signature against the plan (issue 19)
    kernel = route.kernel_for(query, key, mask, dropout, causal, scaling, -3, arguments=arguments)
    if arguments:  # resolved to eager (a fallback component): the model's own
        # eager adds its mask: the boolean one sdpa_mask built, as eager's additive one
        # (or the causal flag it left for a plain causal call)
        keep = attention_mask
        if keep is None and plain_causal:
            keep = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device)
            keep = keep.tril(kv_length - q_length)[None, None]
        additive = keep
        if keep is not None and keep.dtype == torch.bool:
            additive = torch.zeros_like(keep, dtype=query.dtype).masked_fill(
                ~keep, torch.finfo(query.dtype).min
            )
        out, weights = _own_eager(module)(
            module, query, key, value, additive, dropout=dropout, scaling=scaling, **kwargs
        )
        return out, weights
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


def eager_masks_forward(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`attention_forward` under :data:`EAGER_MASKS`, with the convention of
    the eager function such a class was written for: a call without a mask is
    unmasked. transformers' ``eager_attention_forward`` applies no causal flag
    (``eager_mask`` builds causality into the mask, never skipping it), while SDPA's
    rule reads a missing mask and a module without ``is_causal`` as causal:
    ChineseCLIP's vision attention on transformers 5.0.0 (no ``_supports_sdpa``, no
    ``is_causal``, no mask) ran causal under an explicit ``torch_sdpa`` and its
    output moved (``make test-oldest``)."""
    del is_causal  # eager reads no causal flag
    return attention_forward(
        module, query, key, value, attention_mask, dropout, scaling, False, position_bias, **kwargs
    )


def _own_eager(module: torch.nn.Module) -> Any:
    """The eager attention function of ``module``'s own modeling file (the one
    that implements the model's sinks, softcap, sparse indices)."""
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if not callable(found):
        raise InvalidStateError(
            f"{type(module).__name__}: its call passes arguments no attnres kernel takes, and "
            f"its modeling file defines no eager_attention_forward to run them; decide this "
            f"component a backend transformers runs itself (eager, fa)"
        )
    return found


def backends_for(model_class: type) -> frozenset[Backend]:
    """The backends attnres's function runs for a model class: every dense backend
    with a kernel -- none where the class opts out.

    Issue 19: the function is offered by what the class's code does, not by
    ``_supports_attention_backend`` alone. transformers 5.24.0 documents that flag
    as "usable as a backend in TGI and vLLM" (kwargs passed through, logits
    sliceable, a TP plan) and checks it nowhere when an attention function is
    selected (``get_correct_attn_implementation`` accepts any registered name),
    so BART, Whisper, wav2vec2, T5 -- whose attention modules call the interface
    -- never declare it. A site is an interface site by its code (the
    integration reads it); each call's facts and arguments are checked at the
    call (:data:`_OWN_ONLY`). What keeps a class to transformers' own functions
    is an opt-out the class sets itself: ``_supports_attention_backend = False``
    (Gemma 4, BLT, Florence-2, Evolla, Inkling...) or, where it does not declare
    that flag either way, ``_supports_sdpa = False`` (Speech2Text, PegasusX,
    NLLB-MoE...: attnres's function follows the calling convention of the
    ``sdpa`` function, and its mask function is ``sdpa_mask``)."""
    if opt_out_flag(model_class) is not None:
        return frozenset()
    return frozenset(
        Backend(spec.name)
        for spec in registered_backends()
        if not spec.sparse and kernel_source(spec.name) is not KernelSource.NONE
    )


def opt_out_flag(model_class: type) -> str | None:
    """The flag by which the class keeps its sites to transformers' own functions,
    as its code sets it (``None``: it does not)."""
    declared = _declared(model_class, "_supports_attention_backend")
    if declared is False:
        return "_supports_attention_backend = False"
    if declared is None and _declared(model_class, "_supports_sdpa") is False:
        return "_supports_sdpa = False"
    return None


def _declared(model_class: type, flag: str) -> bool | None:
    """``flag`` as the class (or a model base of it) sets it; ``None`` where only
    ``PreTrainedModel``'s default is inherited (a declaration, not a default)."""
    for klass in model_class.__mro__:
        if klass is PreTrainedModel:
            return None
        if flag in vars(klass):
            return bool(vars(klass)[flag])
    return None


def register() -> None:
    """Register :data:`NAME` and :data:`EAGER_MASKS` in both interfaces (idempotent;
    nothing else changes)."""
    for name, function, masks in (
        (NAME, attention_forward, mask_function),
        (EAGER_MASKS, eager_masks_forward, eager_mask_function),
    ):
        if ALL_ATTENTION_FUNCTIONS.get(name) is not function:
            ALL_ATTENTION_FUNCTIONS.register(name, function)
        if ALL_MASK_ATTENTION_FUNCTIONS.get(name) is not masks:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, masks)


def bind_module(module: torch.nn.Module, route: GenericRoute) -> None:
    """Give ``module`` its site's route (the planned signature's kernel bound)."""
    module.__dict__[_ROUTE_ATTR] = route


def bound_route(module: torch.nn.Module) -> GenericRoute | None:
    """The route :func:`bind_module` gave ``module`` (``None``: none)."""
    route = module.__dict__.get(_ROUTE_ATTR)
    return route if isinstance(route, GenericRoute) else None


def unbind_module(module: torch.nn.Module) -> None:
    module.__dict__.pop(_ROUTE_ATTR, None)
