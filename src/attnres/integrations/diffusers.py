"""Govern a diffusers pipeline: every attention site of every component.

How diffusers (0.42) runs attention, and what follows for attnres:

- A site is found by what its code calls (:func:`attnres.integrations._route.calls_of`
  over the processor's methods, or the module's own): ``dispatch_attention_fn``
  (dispatcher processors such as ``FluxAttnProcessor``),
  ``F.scaled_dot_product_attention`` (``AttnProcessor2_0``,
  ``JointAttnProcessor2_0``, CogVideoX's, plain blocks such as the Wan VAE's,
  processors attnres has never seen), a kernel called by hand
  (``memory_efficient_attention``: xformers), softmax attention by hand
  (``AttnProcessor``: eager only); ``torch.nn.MultiheadAttention``. A diffusers
  attention module whose code calls none of these (Sana's linear attention) is
  recorded as not softmax attention, with the reason. No class-name table.
- Head facts are read from the module (``heads``, ``head_dim``, ``inner_dim``,
  ``num_heads``...); a module that holds none is *decided at first call*.
- A site whose code reaches SDPA runs any backend attnres has a kernel for:
  the *generic route* installed on that module only (a ``TorchFunctionMode``
  around its forward that sends its SDPA calls to the decided kernel; a
  dispatcher processor is copied and pinned to ``native`` so its call is SDPA).
  Each call signature is checked before the kernel runs; one the plan did not
  describe is resolved again with the observed facts. Where the decision is
  what the site runs already, nothing is wrapped (bit-identical).
- A context-parallel processor (``_parallel_config``) keeps diffusers'
  dispatcher: a copy of it is pinned to a backend diffusers can run in parallel.
- No processor object is ever changed in place: a copy is pinned, so another
  module or model that shares the original is never touched.
- The dtype that matters is the compute dtype: with layerwise casting the
  weights are stored in fp8 and the hook's ``compute_dtype`` is what runs.

Components that are transformers models (text encoders) are described by
:mod:`attnres.integrations.transformers`. Importing this module imports torch,
diffusers and transformers.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import logging
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, NamedTuple

import attrs
import diffusers
import torch
import transformers
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import (
    AttentionBackendName,
    _AttentionBackendRegistry,
    _check_attention_backend_requirements,
)
from diffusers.models.attention_processor import Attention as _LegacyAttention
from transformers.utils import logging as hf_logging

from attnres._vocab import MaskKind, MaskRoute, normalize_dtype
from attnres.backends import Backend, lookup_spec
from attnres.errors import ArgumentTypeError
from attnres.integrations import _route
from attnres.integrations import transformers as _tf
from attnres.integrations._plan import (
    RUNS_OWN_CODE,
    DtypeChoice,
    Problem,
    RouteKind,
    Site,
    SiteDescription,
    check_version,
    install,
    plan_sites,
    refuse_to_apply,
    role,
    trains,
)
from attnres.kernels import get_kernel
from attnres.layer import Requirements, SelectionConfig
from attnres.layout import context_parallel_layout
from attnres.ledger import forget_decisions
from attnres.plan import PlanResult
from attnres.platform import Platform

__all__ = [
    "ROUTE_DISPATCHER",
    "ROUTE_GENERIC",
    "apply",
    "describe_sites",
    "find_sdpa_calls",
    "plan",
    "remove",
    "route_backends",
    "verify",
]

ROUTE_DISPATCHER = "diffusers dispatcher"
ROUTE_GENERIC = "generic route"

#: attnres backend -> the diffusers ``AttentionBackendName`` value that runs it
#: (diffusers 0.42.1; a context-parallel site runs only these). Hub kernels
#: (``*_hub``) are left out: they download code at run time.
_DISPATCHER_BACKENDS: Mapping[str, str] = MappingProxyType(
    {
        "torch_sdpa": "native",
        "torch_cudnn_sdpa": "_native_cudnn",
        "eager": "_native_math",
        "flex_attention": "flex",
        "fa": "flash",
        "fa3": "_flash_3",
        "sage_attn": "sage",
        "xformers": "xformers",
        "ascend_fa": "_native_npu",
    }
)
_BY_DIFFUSERS = MappingProxyType({v: k for k, v in _DISPATCHER_BACKENDS.items()})
#: issue 23: who calls the kernel at a site pinned on the dispatcher: its
#: ``dispatch_attention_fn(..., attention_kwargs=None, backend=...)`` takes the
#: processor's own keyword arguments, never attnres's (diffusers 0.42.1
#: models/attention_dispatch.py)
_HOST_KERNEL = "diffusers' dispatcher (dispatch_attention_fn, pinned on the processor)"
_TORCH_SDPA = _tf._TORCH_SDPA

#: the kernel entry point a processor may call by hand, xformers' (read from what
#: the code names, never from the processor's class name)
_XFORMERS_CALL = "memory_efficient_attention"


@attrs.frozen
class _ArgumentMask:
    """One mask argument of a model's forward, where code cannot tell (issue 22)."""

    #: the sites it reaches, by the last part of their name (``None``: every site)
    reaches: str | None
    #: the kind the sites get
    kind: MaskKind
    #: planned when the caller's code is not known (a mapping of components): a mask
    #: every pipeline of the model passes; an optional one (passed by one pipeline
    #: only, of a kind that rules kernels out) is planned only for a caller whose code
    #: passes it, else observed at the first call
    unless_known: bool


#: issue 22: masks a model's forward hands on to only some of its sites, or in a kind
#: its code cannot tell (the values its pipelines put in), per forward argument;
#: checked against diffusers 0.42.1. Which arguments a pipeline passes is read from
#: its code (:func:`passed_arguments`); every planned kind is verified at each planned
#: signature's first call (a wrong entry re-resolves the site, traced). Models absent
#: here are read from their code (:func:`_mask_kind`).
#:
#: - ``ChromaTransformer2DModel``: every joint site gets the prompt mask as
#:   ``mask[:, None, None, :] * mask[:, None, :, None]`` in the mask's own dtype;
#:   ``ChromaPipeline`` builds it in the prompt's float dtype, so SDPA adds it as a
#:   0/1 bias (diffusers#12116): an additive mask, which no key-padding route can
#:   reproduce;
#: - ``LTX2VideoTransformer3DModel``: the prompt cross-attentions ``attn2`` and
#:   ``audio_attn2`` get the prompt padding as a -10000 bias (every site takes an
#:   ``attention_mask``, the others get ``None``); the video self-attention ``attn1``
#:   gets ``video_self_attention_mask`` as ``(1 - m) * -10000``, where
#:   ``LTX2InContextPipeline`` (IC-LoRA) puts reference strengths in ``[0, 1]``: an
#:   additive mask, passed only by that pipeline.
_MASK_BY_ARGUMENT: Mapping[str, Mapping[str, _ArgumentMask]] = MappingProxyType(
    {
        "ChromaTransformer2DModel": {
            "attention_mask": _ArgumentMask(None, MaskKind.ADDITIVE, True),
        },
        "LTX2VideoTransformer3DModel": {
            "encoder_attention_mask": _ArgumentMask("attn2", MaskKind.KEY_PADDING, True),
            "audio_encoder_attention_mask": _ArgumentMask(
                "audio_attn2", MaskKind.KEY_PADDING, True
            ),
            "video_self_attention_mask": _ArgumentMask("attn1", MaskKind.ADDITIVE, False),
        },
    }
)


def pipeline_class(name: str | None) -> type | None:
    """The installed diffusers pipeline class ``name`` (a ``model_index.json``'s
    ``_class_name``), or ``None`` where diffusers exports no pipeline by that name."""
    if not (name and name.isidentifier()):
        return None
    # importing a pipeline's module imports what it imports (image processors that
    # log a note where torchvision is absent): attnres only reads its code
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        found = getattr(diffusers, name, None)
    finally:
        hf_logging.set_verbosity(before)
    ok = isinstance(found, type) and issubclass(found, diffusers.DiffusionPipeline)
    return found if ok else None


def passed_arguments(caller: Any, component: str) -> frozenset[str] | None:
    """The keyword arguments ``caller``'s code (a pipeline object or class) passes
    its ``component`` (issue 22): every ``self.<component>(...)`` call in the
    methods of its classes, keywords whose value is not the constant ``None``.
    ``**kwargs`` of a dict literal the method builds count by its keys. ``None``
    where no such call is found, or one passes ``**kwargs`` the code does not
    spell out (the caller is then not known)."""
    return _passed_arguments(caller if isinstance(caller, type) else type(caller), component)


@functools.lru_cache(maxsize=256)
def _passed_arguments(cls: type, component: str) -> frozenset[str] | None:
    found: set[str] = set()
    calls = 0
    for klass in cls.__mro__[:-1]:  # not object
        for value in vars(klass).values():
            # parsed only where its code names the component (a cheap test first)
            function = isinstance(value, types.FunctionType)
            names = _route.calls_of([value], depth=0) if function else frozenset()
            tree = _route.source_tree(value) if component in names else None
            if tree is None:
                continue
            dicts = _dict_literals(tree)
            for node in _route.self_calls(tree, component):
                calls += 1
                for keyword in node.keywords:
                    if keyword.arg is not None:
                        pairs = [(keyword.arg, keyword.value)]
                    elif isinstance(keyword.value, ast.Name) and keyword.value.id in dicts:
                        pairs = dicts[keyword.value.id]  # ``**kwargs`` of a dict literal
                    else:
                        return None  # what it passes is not in the code
                    found.update(
                        k for k, v in pairs if not (isinstance(v, ast.Constant) and v.value is None)
                    )
    return frozenset(found) if calls else None


def _dict_literals(tree: ast.AST) -> dict[str, list[tuple[str, ast.expr]]]:
    """The names a function assigns a dict literal with string keys (each name's
    items, over every such assignment)."""
    out: dict[str, list[tuple[str, ast.expr]]] = {}
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Dict)
        ):
            continue
        keys = node.value.keys
        if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys):
            items = [(k.value, v) for k, v in zip(keys, node.value.values, strict=True)]  # type: ignore[union-attr]
            out.setdefault(node.targets[0].id, []).extend(items)
    return out


#: issue 22: a processor whose call takes this parameter builds a joint
#: [text, image] mask from the text's padding (Qwen-Image's
#: ``QwenDoubleStreamAttnProcessor2_0``): key padding, read from its signature.
_TEXT_PADDING_PARAMETER = "encoder_hidden_states_mask"


#: the parameters an attention module's call (its processor's ``__call__`` or its
#: own ``forward``) takes a mask under (diffusers 0.42.1)
_MASK_PARAMETERS = frozenset(
    {"attention_mask", "attn_mask", "encoder_attention_mask", _TEXT_PADDING_PARAMETER}
)


def _parameters(function: Any) -> frozenset[str]:
    code = getattr(inspect.unwrap(getattr(function, "__func__", function)), "__code__", None)
    if not isinstance(code, types.CodeType):
        return frozenset()
    return frozenset(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])


def passes_masks(model: Any) -> bool:
    """Whether ``model``'s own code (the methods of its classes defined where it is,
    and its ``forward`` wherever that is defined: DreamLite's UNet inherits
    UNet2DConditionModel's) takes, builds or hands on an attention mask: a
    parameter, local or keyword name ending in ``mask`` (issue 22: a DiT that
    turns the prompt's padding, or text lengths, into a mask for its attention)."""
    words: set[str] = set()
    home = type(model).__module__
    own = [v for c in type(model).__mro__ if c.__module__ == home for v in vars(c).values()]
    for value in [type(model).forward, *own]:
        code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
        for inner in _route._codes(code) if isinstance(code, types.CodeType) else ():
            words.update(inner.co_varnames, inner.co_names)
            for const in inner.co_consts:
                if isinstance(const, tuple):  # the keyword names of a call
                    words.update(c for c in const if isinstance(c, str))
    return any(w.endswith("mask") for w in words)


@attrs.frozen
class _Model:
    """What every site of one diffusers model is described with."""

    component: str
    #: the model's class name (:data:`_MASK_BY_ARGUMENT`)
    cls: str
    backward: bool
    #: its code passes masks (:func:`passes_masks`)
    masks: bool
    #: the keywords its caller's code passes it (:func:`passed_arguments`; ``None``:
    #: not known)
    passed: frozenset[str] | None


def _mask_kind(model: _Model, name: str, module: Any) -> MaskKind:
    """The mask kind a site passes, where its code tells before the first call
    (issue 22); the first call observes every other mask and its kind.

    Key padding where its call takes a mask (:data:`_MASK_PARAMETERS`) and the
    model's code passes masks (:func:`passes_masks`): the prompt-padding mask of
    a DiT's joint or cross attention, a text refiner's, an audio model's. A call
    that brings no mask is what the plan allowed (the same kernel runs); one
    whose mask is of another kind is resolved again at its first call. A fact a
    model's code cannot tell before the call (:data:`_MASK_BY_ARGUMENT`) comes first:
    the kind of the argument that reaches the site, where the caller passes it.
    """
    by_argument = _MASK_BY_ARGUMENT.get(model.cls)
    if by_argument is not None:
        for argument, mask in by_argument.items():
            sent = mask.unless_known if model.passed is None else argument in model.passed
            if sent and mask.reaches in (None, name.rsplit(".", 1)[-1]):
                return mask.kind
        return MaskKind.NONE
    processor = getattr(module, "processor", None)
    call = type(processor).__call__ if callable(processor) else type(module).forward
    params = _parameters(call)
    if _TEXT_PADDING_PARAMETER in params or (model.masks and params & _MASK_PARAMETERS):
        return MaskKind.KEY_PADDING
    return MaskKind.NONE


def route_backends(processor: Any) -> frozenset[Backend]:
    """What the dispatcher can execute for a context-parallel ``processor`` here."""
    registered = {b.value for b in _AttentionBackendRegistry._backends}
    parallel = getattr(processor, "_parallel_config", None) is not None
    out: set[Backend] = set()
    for backend, name in _DISPATCHER_BACKENDS.items():
        if name not in registered:
            continue
        if parallel and not _AttentionBackendRegistry._is_context_parallel_available(
            AttentionBackendName(name)
        ):
            continue
        out.add(Backend(backend))
    return frozenset(out)


def _mask_route(backend: Backend, kind: MaskKind) -> MaskRoute | None:
    """How ``backend`` takes a mask of ``kind`` (``None``: it takes none)."""
    spec = lookup_spec(backend)
    support = None if spec is None else spec.mask_support(kind)
    return None if support is None else support.route


def _pinned_backends(
    backends: frozenset[Backend], requirements: Requirements
) -> frozenset[Backend]:
    """Issue 22: a pinned dispatcher backend receives the site's mask as is: a
    kernel that takes the site's mask kind only by unpadding (attnres's route,
    not the dispatcher's) cannot serve it there."""
    kind = requirements.mask
    if kind in (MaskKind.NONE, MaskKind.ANY):
        return backends
    # a kind it does not take at all fails the requirements check
    return frozenset(b for b in backends if _mask_route(b, kind) in (None, MaskRoute.NATIVE))


def _unpads(backend: Backend, requirements: Requirements) -> bool:
    """Issue 22: ``backend`` takes the site's mask kind only through attnres's unpad
    route. A dispatcher already pinned to that backend runs its dense kernel with
    the mask as is (diffusers' ``flash`` raises "attn_mask is not supported"), so
    the site is routed even though the decision is what it runs."""
    kind = requirements.mask  # key padding: the only kind taken by unpadding
    return kind is MaskKind.KEY_PADDING and _mask_route(backend, kind) is MaskRoute.UNPAD


def _is_dispatcher(processor: Any) -> bool:
    return processor is not None and hasattr(type(processor), "_attention_backend")


def _dtype_of(module: Any, fallback: str) -> str:
    """The compute dtype: a layerwise-casting hook's, else as a transformers
    site's (its first wide weight's, else ``fallback``, the model's)."""
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        hook = None if registry is None else registry.get_hook("layerwise_casting")
        if hook is not None:
            return normalize_dtype(hook.compute_dtype)
    return _tf.compute_dtype(module, fallback)


def describe_sites(
    model: Any, component: str, dtype: str | None = None, *, passed: frozenset[str] | None = None
) -> list[SiteDescription]:
    """Every attention site of one component (a diffusers or transformers model).

    ``passed``: the keyword arguments the pipeline's code passes the component
    (:func:`passed_arguments`; ``None``: not known), for the mask arguments that
    reach only some sites (issue 22).

    A site is a module whose attention code reaches SDPA, diffusers' dispatcher
    or a kernel it calls by hand (found by what the code calls, see
    :func:`attnres.integrations._route.calls_of`), diffusers' attention modules
    (whatever their processor), and ``torch.nn.MultiheadAttention``; modules
    inside a site are part of it.
    """
    if _tf.is_transformers_model(model):
        return _tf.describe_sites(model, component, dtype)
    facts = _Model(component, type(model).__name__, trains(model), passes_masks(model), passed)
    out: list[SiteDescription] = []
    inside: list[str] = []
    fallback = _tf.model_dtype(model)
    for name, module in model.named_modules():
        if not name or _under(name, inside):
            continue
        if _tf.is_transformers_model(module):
            # issue 19: a transformers model held by a diffusers one (UniDiffuser's
            # GPT-2 text decoder): its sites are found as the transformers
            # integration finds them, named by their path in this component
            out += [
                attrs.evolve(d, name=f"{name}.{d.name}")
                for d in _tf.describe_sites(module, component, dtype)
            ]
            inside.append(name)
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        desc = _describe(facts, name, module, dtype or _dtype_of(module, fallback), parent)
        if desc is not None:
            out.append(desc)
            inside.append(name)
    if context_parallel_layout(model) is not None:
        # issue 24: the model runs under diffusers' context parallelism: its sites are
        # decided for that layout (a ring needs a kernel that returns the lse)
        out = [
            attrs.evolve(d, layout=context_parallel_layout(model, d.heads, d.kv_heads)) for d in out
        ]
    return out


def _under(name: str, prefixes: Iterable[str]) -> bool:
    """Whether the module ``name`` is inside one of the modules ``prefixes`` names."""
    return any(name.startswith(prefix + ".") for prefix in prefixes)


def _transformers_models(model: Any) -> list[tuple[str, Any]]:
    """The transformers models of a component, by their name in it: the component
    itself, or the outermost ones a diffusers model holds (issue 19)."""
    if _tf.is_transformers_model(model):
        return [("", model)]
    out: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if name and not _under(name, (n for n, _ in out)) and _tf.is_transformers_model(module):
            out.append((name, module))
    return out


def _requirements(
    model: _Model, name: str, module: Any, facts: tuple[int, int, int] | None
) -> Requirements:
    if facts is None:
        return Requirements(backward=model.backward)
    heads, kv_heads, head_size = facts
    return Requirements(
        mask=_mask_kind(model, name, module),
        # a module that holds ``is_causal`` (Mochi's VAE attention) passes it per call
        causal=getattr(module, "is_causal", False) is True,
        gqa=kv_heads < heads,
        backward=model.backward,
        # Attention(scale_qk=False) or scale= passes its own softmax scale
        custom_scale=_tf.custom_scale(getattr(module, "scale", None), head_size),
    )


def _describe(
    model: _Model, name: str, module: Any, dtype: str, parent: Any
) -> SiteDescription | None:
    cls = type(module).__name__
    if isinstance(module, torch.nn.MultiheadAttention):
        return _route.describe_mha(model.component, name, module, dtype, model.backward, parent)
    processor = getattr(module, "processor", None)
    # a diffusers attention module, or any module that hands its call to a processor
    if isinstance(module, (AttentionModuleMixin, _LegacyAttention)) or (
        callable(processor) and not isinstance(module, torch.nn.ModuleList)
    ):
        # what executes its attention (its processor, else itself), and what that calls
        runs = processor if callable(processor) else module
        owner, names = type(runs).__name__, _route.names_of(runs)
    else:
        runs, owner, names = module, cls, _route.names_of(module, depth=1)
        if _route.MHA_FUNCTION in names and _route.SDPA not in names:
            # issue 30: softmax attention through torch's functional MHA (HunyuanDiT's
            # attention pool): a site of its own code path, never silently skipped
            return _route.describe_mha_function(
                model.component, name, module, dtype, model.backward
            )
        if _route.SDPA not in names:
            if not _by_hand_module(module):
                return None
            names |= {"softmax"}  # written out, maybe (exp(x - logsumexp(x)))
    parallel = (
        _is_dispatcher(processor) and getattr(processor, "_parallel_config", None) is not None
    )
    declared = None if parallel else _declared_backends(processor)
    # issue 19: a processor that declares the dispatcher backends it runs builds
    # its call for them (AnyFlow FAR's and the LTX-2 diffusion decoder's build a
    # flex BlockMask, and AnyFlow pads a head size under 16 to 16): the module's
    # head facts do not describe the call, so the site is decided at its first
    # call from what it passes; the route runs its own code (the declared
    # backend) or another kernel, the BlockMask as the boolean mask it stands for
    facts = None if declared is not None else _route.head_facts(module)
    heads, kv_heads, head_size = facts or (None, None, None)
    requirements = _requirements(model, name, module, facts)
    site = functools.partial(
        SiteDescription,
        component=model.component,
        name=name,
        module_class=cls,
        dtype=dtype,
        role=role(name, module),
        heads=heads,
        kv_heads=kv_heads,
        head_size=head_size,
        requirements=requirements,
        supported=None,  # any backend attnres has a kernel for
        pending=facts is None,  # decided at its first call
    )
    if parallel:
        # context parallel: diffusers' dispatcher splits the sequence; only the
        # backends it can run in parallel serve the site, pinned on the processor
        return site(
            route=f"{ROUTE_DISPATCHER} (context parallel) via {owner}",
            kind=RouteKind.PIN,
            supported=_pinned_backends(route_backends(processor), requirements),
            current=_dispatcher_current(processor),
            host_kernel=_HOST_KERNEL,  # issue 23: pinned, diffusers calls the kernel
        )
    runs_now = _dispatcher_current(processor) if _is_dispatcher(processor) else _TORCH_SDPA
    # as the transformers integration describes a module of its own code
    own = functools.partial(_tf.own_call_site, site, cls, owner, now=runs_now)
    if declared is not None or _route.SDPA in names or _route.DISPATCHER in names:
        cannot = _route.reroutes(runs)
        if isinstance(cannot, str):  # issue 30: a call no copy can take
            return own(pinned=cannot)
    if declared is not None:
        return site(
            route=f"{ROUTE_GENERIC} (dispatcher in {owner}, which declares "
            f"{', '.join(sorted(b.name for b in declared))})",
            current=_dispatcher_current(processor),
            kind=RouteKind.INTERCEPT,
            why=f"{owner} declares the backends its call runs and builds that call "
            f"itself: its head facts and mask are read from its first call",
        )
    if _route.SDPA in names or _route.DISPATCHER in names:
        return own(via="dispatcher" if _route.DISPATCHER in names else "SDPA")
    if _XFORMERS_CALL in names:
        only = Backend("xformers")
        return site(
            route=f"{only.name} in {owner}",
            kind=RouteKind.PIN,
            supported=frozenset({only}),
            current=only,
            pending=False,
            why=None if facts is not None else f"{cls} holds no head facts",
        )
    if names & _route.BY_HAND:
        # softmax attention written by hand (get_attention_scores then torch.bmm,
        # or a softmax of a product)
        return own(by_hand=True)
    return site(
        route=f"own code in {owner}",
        kind=RouteKind.OWN_CODE,
        pending=False,
        softmax=False,
        why=f"{owner} calls no SDPA, dispatcher or softmax (linear attention, say)",
    )


def _by_hand_module(module: Any) -> bool:
    """Whether a module that is no attention module computes softmax attention by
    hand in its own code (a softmax of a product, multiplied with values; issue 32
    item 8): a site of its own code (issue 30), found as the transformers
    integration finds one. A module holding an attention module is not (that one
    is the site, found inside it)."""
    inner = (AttentionModuleMixin, _LegacyAttention, torch.nn.MultiheadAttention)
    if any(isinstance(m, inner) for m in module.modules()):
        return False
    cls = type(module)
    found = _BY_HAND_CLASSES.get(cls)
    if found is None:  # read from its classes' code once (the source is parsed)
        found = _BY_HAND_CLASSES[cls] = _tf.computes_by_hand(module)
    return found


#: class -> whether its code computes softmax attention by hand (:func:`_by_hand_module`)
_BY_HAND_CLASSES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _declared_backends(processor: Any) -> frozenset[Backend] | None:
    """The backends a dispatcher processor declares it runs (``_SUPPORTED_BACKENDS``,
    which it checks before its call), as attnres backends; ``None``: it declares none."""
    if not _is_dispatcher(processor):
        return None
    names = getattr(processor, "_SUPPORTED_BACKENDS", None)
    if not isinstance(names, (tuple, list, frozenset, set)):
        return None
    return frozenset(Backend(_BY_DIFFUSERS[n]) for n in names if n in _BY_DIFFUSERS)


def _dispatcher_current(processor: Any) -> Backend | None:
    # the processor's own backend, or its class's (AnyFlow's causal processor
    # declares ``flex``), else diffusers' active one
    name = getattr(processor, "_attention_backend", None)
    if name is None:
        name = _AttentionBackendRegistry._active_backend
    current = _BY_DIFFUSERS.get(str(getattr(name, "value", name)))
    return None if current is None else Backend(current)


def _components(pipe: Any) -> list[tuple[str, Any]]:
    items = pipe.components if hasattr(pipe, "components") else pipe
    if not isinstance(items, Mapping):
        raise ArgumentTypeError(
            f"plan() takes a DiffusionPipeline or a mapping {{component name: module}}, "
            f"got {type(pipe).__name__}"
        )
    return [(str(n), m) for n, m in items.items() if isinstance(m, torch.nn.Module)]


def plan(
    pipe: Any,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
    *,
    dtypes: Mapping[str, DtypeChoice] | None = None,
    title: str | None = None,
    source: str | None = None,
    caller: type | None = None,
    sp: Any = None,
) -> PlanResult:
    """Describe and resolve every attention site of every component; changes nothing.

    ``sp`` (issue 35): a :class:`attnres.machine.AutoLayout` (``attnres plan DIR
    --sp-degree N``): each denoiser site with head facts is planned under the
    layout ``attnres.machine.LAYOUT_RULES`` choose for it.

    ``dtypes`` (component -> :class:`DtypeChoice`) overrides the compute dtype
    read from the modules (``attnres plan DIR`` passes what it chose).
    ``caller``: the pipeline class whose code calls the components, read for the
    mask arguments it passes each (issue 22); ``pipe``'s own class when it is a
    pipeline (has ``components``), else not known.
    """
    if caller is None and hasattr(pipe, "components"):
        caller = type(pipe)
    parts = []
    for name, module in _components(pipe):
        choice = None if dtypes is None else dtypes.get(name)
        passed = None if caller is None else passed_arguments(caller, name)
        sites = describe_sites(
            module, name, None if choice is None else choice.dtype, passed=passed
        )
        if sp is not None:  # issue 35: the layout each denoiser site would run
            sites = [sp.choose_for_site(name, d) for d in sites]
        parts.append((name, choice, sites))
    return plan_sites(
        title=title or type(pipe).__name__,
        source=source,
        components=parts,
        config=config,
        platform=platform,
    )


# =============================================================================
# apply / verify / remove
# =============================================================================


@attrs.frozen(eq=False)
class _Pin:
    """What apply changed on one attention module, to verify and undo it.

    ``processor`` is the one the module runs after apply (a copy whenever
    apply changed it: a processor object is never changed in place, so
    another module or model sharing it is never touched); ``value`` is the
    dispatcher backend pinned on that copy (``None``: nothing pinned);
    ``dtype`` the compute dtype planned; ``route`` the generic route installed
    (``None``: none).
    """

    component: str
    name: str
    original: Any
    processor: Any
    value: str | None
    dtype: str | None
    route: _route.GenericRoute | None


_PIN_ATTR = "_attnres_pin"


class _Planned(NamedTuple):
    module: Any
    site: Site
    #: the dispatcher backend to pin on a copy of the processor ("" for none)
    value: str
    #: install the generic route
    route: bool


def _prepare(
    pipe: Any, result: PlanResult, config: SelectionConfig
) -> tuple[list[_Planned], list[Callable[[], object]], list[str]]:
    """What installing ``result`` needs per site, and the problems; no change."""
    planned: list[_Planned] = []
    actions: list[Callable[[], object]] = []
    problems: list[str] = []
    by_component = result.by_component()
    for comp, model in _components(pipe):
        nested = _transformers_models(model)
        for prefix, inner in nested:  # issue 19: nested ones too, as the transformers ones
            acts, probs = _tf.prepare(inner, result, comp, prefix)
            actions += acts
            problems += probs
        if _tf.is_transformers_model(model):
            continue
        modules = dict(model.named_modules())
        for site in by_component.get(comp, []):
            if _under(site.name, (prefix for prefix, _ in nested)):
                continue
            module = modules[site.name]
            if site.pending:
                # decided at first call: the route resolves it then; softmax by hand
                # with no flag for its component would decide its own code: nothing
                # is wrapped (untouched, bit-identical)
                own = site.kind in RUNS_OWN_CODE and _route.unflagged(config, comp)
                planned.append(_Planned(module, site, "", not own))
                continue
            if site.resolution is None or site.spec is None:
                continue
            backend = site.resolution.backend
            if site.routed:  # nothing to wrap where it runs the decision already
                runs = backend == site.current and not _unpads(backend, site.spec.requirements)
                planned.append(_Planned(module, site, "", not runs))
            elif _is_dispatcher(getattr(module, "processor", None)):
                value = _DISPATCHER_BACKENDS.get(backend.name)  # context parallel: pin it
                if value is None:
                    problems.append(
                        f"{comp}/{site.name}: the dispatcher has no route for {backend.name}"
                    )
                else:
                    planned.append(_Planned(module, site, value, False))
            else:
                only = ",".join(sorted(b.name for b in site.spec.supported or ()))
                if backend.name != only:
                    problems.append(
                        f"{comp}/{site.name}: its route ({site.route}) runs only "
                        f"{only}, not {backend.name}"
                    )
                else:
                    planned.append(_Planned(module, site, "", False))
    return planned, actions, problems


def _cannot_install(planned: list[_Planned]) -> list[str]:
    """What keeps ``planned`` from being installed here: a dispatcher backend
    diffusers cannot run, a kernel attnres cannot run."""
    problems = []
    for value in sorted({p.value for p in planned if p.value}):
        try:
            _check_attention_backend_requirements(AttentionBackendName(value))
        except Exception as exc:
            problems.append(f"diffusers cannot run backend {value!r} here: {exc}")
    for item in planned:
        res = item.site.resolution
        if not item.route or res is None or res.backend.name == "torch_sdpa":
            continue
        try:
            if get_kernel(res.backend.name) is None:
                raise LookupError("no kernel is registered for it")
        except Exception as exc:
            problems.append(
                f"{item.site.component}/{item.site.name}: attnres cannot run "
                f"{res.backend.name} here: {exc}"
            )
    return problems


def apply(
    pipe: Any,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
    *,
    caller: type | None = None,
) -> PlanResult:
    """Plan, then install every decision, all or nothing (``caller``: as :func:`plan`).

    Raises :class:`~attnres.integrations.IntegrationError` (``.plan`` attached)
    and changes nothing when any site is rejected or any decision cannot be
    installed. Applied again, it replaces the earlier install (:func:`remove`
    still restores the untouched pipeline); one that fails leaves the earlier
    install as it was. With no flag on a machine, outputs are bit-identical to the
    untouched pipeline (every site keeps the backend it ran). A site that calls
    SDPA itself and was decided another backend gets the generic route
    (:mod:`attnres.integrations._route`), which checks each call's facts first.
    """
    for library in (diffusers, transformers):  # issue 30: the declared ranges only
        check_version(library)
    result = plan(pipe, config, platform, caller=caller)
    refuse_to_apply(result)
    planned, others, problems = _prepare(pipe, result, result.config)
    pins = [functools.partial(_install, item, result.config, result.platform) for item in planned]
    return install(result, [*pins, *others], problems + _cannot_install(planned))


def _install(item: _Planned, config: SelectionConfig, platform: Platform) -> Callable[[], None]:
    """Install one planned site; returns how to undo it, which puts back what the
    site ran before: the earlier install where it was applied already (so an apply
    that fails changes nothing), and it is run here too when this step raises."""
    module, site = item.module, item.site
    earlier = module.__dict__.get(_PIN_ATTR)
    # applied again: the earlier install is set aside (remove() still restores the
    # first state), and put back whole where this apply fails
    aside = None if earlier is None else (earlier, _unpin(module, earlier))
    original = getattr(module, "processor", None)
    try:
        pin = _pin(item, config, platform)
    except BaseException:
        now = getattr(module, "processor", None)
        _undo(module, _Pin(site.component, site.name, original, now, None, None, None), aside)
        raise
    return functools.partial(_undo, module, pin, aside)


def _pin(item: _Planned, config: SelectionConfig, platform: Platform) -> _Pin:
    """Install one planned site (nothing installed on it): its pin."""
    module, site = item.module, item.site
    original = processor = getattr(module, "processor", None)
    route = None
    try:
        if item.route and site.kind in RUNS_OWN_CODE:
            # issue 30: softmax by hand, or a call no copy can take, decided at its
            # first call under a flag: its first call is watched (its head facts
            # read, nothing run but its code)
            route = _route.site_route(site, config, platform, site.current, site.route)
            _route.install_route(module, route, _route.watch_forward)
        elif item.route:
            # under the route, a dispatcher's own path is diffusers' native SDPA
            # (dispatch_sdpa), whatever backend its processor was pinned to (a pinned
            # dense kernel cannot take a key-padding mask)
            own = _TORCH_SDPA
            declared = _declared_backends(original) is not None
            if declared and site.current is not None:  # its own path is what it declares
                own = site.current
            route = _route.site_route(site, config, platform, own=own)
            # a site decided at its first call keeps, with no flag, what its own code
            # runs: the kernel its processor declares
            route.keeps_own = declared
            if not declared:
                route.dispatch_sdpa = AttentionBackendName(_DISPATCHER_BACKENDS["torch_sdpa"])
            routed = None if original is None else _route.routed_processor(original, route)
            if isinstance(module, torch.nn.MultiheadAttention):  # its own math, per site
                _route.install_route(module, route, _route.mha_forward)
            elif routed is not None:
                # a copy: the original object may be shared with other modules or models
                processor = routed
                _set_processor(module, processor)
            else:
                _route.install_route(module, route)
        elif item.value:
            processor = copy.copy(original)
            assert processor is not None  # a dispatcher site has one
            processor._attention_backend = AttentionBackendName(item.value)
            _set_processor(module, processor)
        if route is not None:
            route.tie(module)  # a model dropped without remove() leaves nothing behind
    except BaseException:
        if route is not None:  # made, not installed: its rebound globals go now
            route.close()
        raise
    dtype = None if site.spec is None else site.spec.dtype
    pin = _Pin(site.component, site.name, original, processor, item.value or None, dtype, route)
    module.__dict__[_PIN_ATTR] = pin
    return pin


def _unpin(module: Any, pin: _Pin) -> _route.Held | None:
    """Undo ``pin``; the generic route it removed from ``module`` (for :func:`_undo`)."""
    held = _route.remove_route(module)
    if pin.route is not None:
        pin.route.close()
    if pin.processor is not pin.original and getattr(module, "processor", None) is not pin.original:
        _set_processor(module, pin.original)
    module.__dict__.pop(_PIN_ATTR, None)
    return held


def _undo(module: Any, pin: _Pin, aside: tuple[_Pin, _route.Held | None] | None) -> None:
    """Undo an install that failed, or whose apply failed later: ``pin`` goes, and
    the earlier install it set aside (``aside``: its pin and generic route) comes
    back as it was, its route and processor copy the very objects it had."""
    _unpin(module, pin)
    if aside is None:
        return
    earlier, held = aside
    if earlier.route is not None:
        earlier.route.reopen(module)
    if held is not None:
        _route.restore_route(module, held)
    if earlier.processor is not getattr(module, "processor", None):
        _set_processor(module, earlier.processor)
    module.__dict__[_PIN_ATTR] = earlier


def _set_processor(module: Any, processor: Any) -> None:
    """Give ``module`` ``processor``: through its ``set_processor`` where it has one,
    else as the attribute its forward reads (Mochi's and Cosmos' VAE attention
    modules hold a processor without being diffusers attention modules)."""
    setter = getattr(module, "set_processor", None)
    if callable(setter):
        setter(processor)
    else:
        module.processor = processor


def _pins(model: Any) -> list[tuple[Any, _Pin]]:
    """The modules of ``model`` that apply pinned, with their pins."""
    found = [(module, module.__dict__.get(_PIN_ATTR)) for module in model.modules()]
    return [(module, pin) for module, pin in found if pin is not None]


def routes(pipe: Any) -> dict[str, _route.GenericRoute]:
    """The generic routes apply installed: ``component/site`` -> route."""
    out = {}
    for _, model in _components(pipe):
        for _, module in model.named_modules():
            pin = module.__dict__.get(_PIN_ATTR)
            if pin is not None and pin.route is not None:
                out[f"{pin.component}/{pin.name}"] = pin.route
            if _tf.is_transformers_model(module):  # a component, or nested (issue 19)
                out.update(_tf.routes(module))
    return out


def verify(pipe: Any) -> list[Problem]:
    """Installed decisions that no longer hold (empty: every one holds).

    Reports a processor replaced since ``apply`` (IP-Adapter loading,
    ``set_attn_processor``), a pin or route changed, and a site cast to
    another compute dtype than it was planned for.
    """
    problems: list[Problem] = []
    for _, model in _components(pipe):
        for _, inner in _transformers_models(model):
            problems += _tf.verify(inner)
        if _tf.is_transformers_model(model):
            continue
        fallback = _tf.model_dtype(model)
        for module, pin in _pins(model):
            now = getattr(module, "processor", None)
            found: list[str] = []
            if now is not pin.processor:
                found.append(
                    f"processor replaced since apply (now {type(now).__name__}); its backend "
                    f"is no longer governed: plan and apply again"
                )
            elif pin.value is not None and (
                pin.processor.__dict__.get("_attention_backend") != pin.value
            ):
                found.append(f"pinned backend changed since apply (was {pin.value})")
            route = pin.route
            if (
                route is not None
                and pin.processor is pin.original
                and _route.installed_route(module) is not route
            ):
                found.append(
                    "its generic route was removed or replaced since apply: plan and apply again"
                )
            dtype = _dtype_of(module, fallback)
            if pin.dtype is not None and dtype != pin.dtype:
                found.append(
                    f"cast since apply: planned for {pin.dtype}, now {dtype}; plan and apply again"
                )
            problems += [Problem(pin.component, pin.name, problem) for problem in found]
    return problems


def remove(pipe: Any) -> int:
    """Restore the original processors and implementations; returns the number of
    attention sites restored (every site apply governed, in every component); their
    ledger entries go with them."""
    count = 0
    restored: list[tuple[str, str]] = []
    for _, model in _components(pipe):
        for _, inner in _transformers_models(model):
            count += _tf.remove(inner)
        for module, pin in _pins(model):
            _unpin(module, pin)
            restored.append((pin.component, pin.name))
    forget_decisions(restored)
    return count + len(restored)


# =============================================================================
# The opt-in dry run
# =============================================================================


#: where an SDPA call ran: (component, name of the innermost module), ``None``
#: outside every module of the models watched
SdpaSite = tuple[str, str] | None


@contextmanager
def sdpa_calls(
    models: Sequence[tuple[str, torch.nn.Module]],
    on_call: Callable[[SdpaSite, tuple[Any, ...], dict[str, Any]], None],
) -> Iterator[None]:
    """While active, every ``F.scaled_dot_product_attention`` call is handed to
    ``on_call`` (before it runs) with its positional and keyword arguments and the
    innermost module of ``models`` running it: what :func:`find_sdpa_calls` counts
    and :func:`attnres.precision.calibrate_pipeline` captures."""
    from torch.overrides import TorchFunctionMode

    stack: list[tuple[str, str]] = []
    handles = []
    for component, model in models:
        for name, sub in model.named_modules():
            where = (component, name)
            handles.append(sub.register_forward_pre_hook(lambda m, *_, w=where: stack.append(w)))
            handles.append(sub.register_forward_hook(lambda m, *_: (stack.pop(), None)[1]))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    class _Mode(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if func is sdpa:
                on_call(stack[-1] if stack else None, args, kwargs)
            return func(*args, **kwargs)

    try:
        with _Mode():
            yield
    finally:
        for h in handles:
            h.remove()


def find_sdpa_calls(model: torch.nn.Module, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Run ``model(*args, **kwargs)`` once and count SDPA calls per innermost module.

    An opt-in dry run: it finds attention that no enumeration classifies (a
    plain module calling ``F.scaled_dot_product_attention``).
    """
    calls: dict[str, int] = {}

    def count(where: SdpaSite, *_: Any) -> None:
        name = "" if where is None else where[1]
        calls[name] = calls.get(name, 0) + 1

    with torch.no_grad(), sdpa_calls([("", model)], count):
        model(*args, **kwargs)
    return calls
