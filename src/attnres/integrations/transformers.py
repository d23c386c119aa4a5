"""Govern a transformers model: every attention module's backend, decided by attnres.

transformers (5.x) modules look their attention function up on each call, by
``module.config._attn_implementation``, in ``ALL_ATTENTION_FUNCTIONS``
(``AttentionInterface``); the model builds its masks with the function of the
same name in ``ALL_MASK_ATTENTION_FUNCTIONS`` (``AttentionMaskInterface``). A
name with no mask function gets no mask at all -- padding silently dropped --
so a route counts only names registered in both.

The route that executes a site is its model's attention implementation; what
it can execute is :data:`_FUNCTIONS` restricted to what the model class
declares (``_supports_sdpa``, ``_supports_flash_attn``, ``_supports_flex_attn``)
and to what is registered. Installing a decision sets the implementation on the
config the site's module reads; every site that reads one config must agree.

Importing this module imports torch and transformers.
"""

from __future__ import annotations

import ast
import dis
import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeGuard

import attrs
import torch
import transformers
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnres._vocab import MaskKind, normalize_dtype
from attnres.backends import Backend
from attnres.integrations import _hf_attention, _route
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
from attnres.ledger import forget_decisions
from attnres.plan import PlanResult
from attnres.platform import Platform

__all__ = [
    "ROUTE",
    "apply",
    "describe_sites",
    "plan",
    "remove",
    "route_backends",
    "verify",
]

ROUTE = "transformers attention interface"
_TORCH_SDPA, _EAGER = Backend("torch_sdpa"), Backend("eager")

#: attnres backend -> the transformers attention function that executes it
#: (transformers 5.24).
_FUNCTIONS: Mapping[str, str] = MappingProxyType(
    {
        "torch_sdpa": "sdpa",
        "eager": "eager",
        "fa": "flash_attention_2",
        "fa3": "flash_attention_3",
        "flex_attention": "flex_attention",
    }
)
_BY_FUNCTION = MappingProxyType({v: k for k, v in _FUNCTIONS.items()})

#: which class flag a model needs for a function (eager needs none)
_CLASS_FLAG: Mapping[str, str] = MappingProxyType(
    {
        "sdpa": "_supports_sdpa",
        "flash_attention_2": "_supports_flash_attn",
        "flash_attention_3": "_supports_flash_attn",
        "flex_attention": "_supports_flex_attn",
    }
)


def route_backends(model: Any) -> frozenset[Backend]:
    """What the attention interface can execute for ``model``'s class.

    Issue 22: a class that dispatches through the attention interface also runs
    every dense backend with an attnres kernel, through attnres's own function
    (:mod:`._hf_attention`); issue 19: unless the class opts out itself
    (:func:`._hf_attention.backends_for`), not only where it declares
    ``_supports_attention_backend``.
    """
    return _native_backends(model) | _hf_attention.backends_for(type(model))


def _native_backends(model: Any) -> frozenset[Backend]:
    """What transformers' own functions execute for ``model``'s class (each with a
    mask function: a name without one gets no mask, padding silently dropped)."""
    out: set[Backend] = set()
    for backend, function in _FUNCTIONS.items():
        flag = _CLASS_FLAG.get(function)
        if flag is not None and not getattr(type(model), flag, False):
            continue
        if function != "eager" and (
            function not in ALL_ATTENTION_FUNCTIONS
            or function not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        ):
            continue
        out.add(Backend(backend))
    return frozenset(out)


# =============================================================================
# Facts read from the module, and the few code cannot tell
# =============================================================================


def _observed_requirements(module: Any) -> Requirements:
    # issue 22: a model's mask function builds padding masks (causal ones for a
    # decoder used as an encoder): key padding
    return Requirements(
        causal=getattr(module, "is_causal", False) is True, mask=MaskKind.KEY_PADDING
    )


def _t5_requirements(module: Any) -> Requirements:
    # issue 22: T5 passes its float position bias: an additive mask
    return Requirements(
        mask=MaskKind.ADDITIVE, causal=bool(module.is_decoder) and bool(module.is_causal)
    )


def _clip_requirements(module: Any) -> Requirements:
    # issue 22: the text model passes causal with key padding (create_causal_mask
    # of its attention_mask); the vision model passes no mask
    text = getattr(module.config, "model_type", "") == "clip_text_model"
    return Requirements(causal=text, mask=MaskKind.KEY_PADDING if text else MaskKind.NONE)


#: module class name -> the requirements its code does not tell before the call,
#: checked against transformers 5.24 (every other class: read from the module,
#: ``_observed_requirements``; a site's role: ``_plan.role``, T5's by its place)
_CLASS_FACTS: Mapping[str, Callable[[Any], Requirements]] = MappingProxyType(
    {
        # is_causal is False on the module: the text model passes causal per call
        "CLIPAttention": _clip_requirements,
        # T5 always passes its float position bias as the mask
        "T5Attention": _t5_requirements,
        "UMT5Attention": _t5_requirements,
    }
)


#: a module's query projection, and its fused query/key/value one (three widths)
_QUERY = ("q_proj", "query", "query_proj", "to_q", "q")
_FUSED = ("qkv", "qkv_proj", "c_attn", "in_proj")


def _query_width(module: Any) -> int | None:
    """The width of the queries ``module`` projects, read from its projection.

    A query projection twice as wide as the output projection takes emits a
    gate with the query (Qwen3-Next, Qwen3.5, MiniCPM-V 4.6 in transformers 5.24:
    ``q_proj`` is heads x head size x 2, its output gates the attention's before
    ``o_proj``): the queries are the output projection's width (found by the
    runtime sweep: planned with twice the heads its calls carry)."""
    for names, parts in ((_QUERY, 1), (_FUSED, 3)):
        for name in names:
            child = getattr(module, name, None)
            if not isinstance(child, torch.nn.Module):
                continue
            width = _route._int_attr(child, ("out_features", "nf", "out_channels"))
            if width is not None and width % parts == 0:
                width //= parts
                out = _out_width(module)
                return out if parts == 1 and out is not None and width == 2 * out else width
    return None


def _out_width(module: Any) -> int | None:
    """What the output projection of ``module`` takes: heads x head size."""
    for name in ("o_proj", "out_proj"):
        child = getattr(module, name, None)
        if isinstance(child, torch.nn.Linear):
            return int(child.in_features)
    return None


def _head_facts(module: Any) -> tuple[int, int, int] | None:
    """``(heads, kv_heads, head_size)`` from the module, else from its config.

    The head size is the query/key one (multi-head latent attention holds
    ``qk_head_dim`` and a smaller ``v_head_dim``). A module that holds only one
    of head count and head size has the other from its width: the width it
    holds, or the one its query projection produces."""
    config = getattr(module, "config", None)
    heads = _route._int_attr(
        module, ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attn_heads", "heads")
    )
    size = _route._int_attr(
        module,
        (
            "qk_head_dim",
            "head_dim",
            "attention_head_size",
            "key_value_proj_dim",
            "head_size",
            "dim_head",
            "d_head",
            "key_dim",
        ),
    )
    width = _route._int_attr(
        module, ("all_head_size", "internal_dim", "embed_dim", "dim_model", "dim")
    )
    if width is None:
        width = _query_width(module)
    if heads is None and size is not None and width is not None and width % size == 0:
        heads = width // size
    if heads is None and config is not None:
        heads = _route._int_attr(config, ("num_attention_heads", "num_heads", "n_head"))
    if size is None and heads is not None and width is not None and width % heads == 0:
        size = width // heads
    if size is None and config is not None:
        size = _route._int_attr(config, ("head_dim", "d_head", "d_kv"))
    if heads is None or size is None:
        return None
    kv = _route._int_attr(module, ("num_key_value_heads", "num_kv_heads"))
    groups = _route._int_attr(module, ("num_key_value_groups",))
    if kv is None and groups is not None and heads % groups == 0:
        kv = heads // groups
    if kv is None and config is not None:
        kv = _route._int_attr(config, ("num_key_value_heads",))
    return heads, (kv if kv is not None and heads % kv == 0 else heads), size


#: the classes every transformers model shares: their methods (which name the
#: attention interface to configure it) are not a model's attention code
_SHARED_BASES = frozenset(transformers.PreTrainedModel.__mro__)

#: how a module computes attention, read from what its own code calls
_INTERFACE, _SDPA, _BY_HAND = "interface", "sdpa", "by hand"
#: names that, with a softmax, mean softmax attention computed by hand
_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum", "@"})


def _own_functions(cls: type) -> list[types.FunctionType]:
    """The methods of ``cls``'s own classes: not torch's, and not the base
    classes every transformers model shares."""
    return list(_route.methods_of(cls, _SHARED_BASES).values())


def _own_calls(module: Any) -> frozenset[str]:
    """What the code of ``module``'s own classes names; ``@`` when it multiplies
    matrices with the operator (which names nothing)."""
    functions = _own_functions(type(module))
    names = _route.names_of(module, 1, _SHARED_BASES)
    if names >= _NORMALISERS:
        # exp(x - logsumexp(x)) is a softmax written out (Reformer's LSH and local
        # attention)
        names |= {"softmax"}
    if "softmax" in names and any(_matmul_operator(f.__code__) for f in functions):
        names |= {"@"}
    if "softmax" in names and not names & _PRODUCTS:
        # a product computed by a submodule its code calls (SqueezeBERT's
        # MatMulWrapper: ``self.matmul_qk(q, k)``)
        for attr, child in module.named_children():
            if attr in names and _route.calls_of([type(child).forward], depth=1) & _PRODUCTS:
                names |= {"@"}
                break
    return names


#: the calls that normalise scores as a softmax does, written out
_NORMALISERS = frozenset({"logsumexp", "exp"})


def _matmul_operator(code: types.CodeType) -> bool:
    """Whether ``code`` (or a code object it holds) multiplies with ``@``."""
    found = (i for c in _route._codes(code) for i in dis.get_instructions(c))
    return any(i.opname == "BINARY_OP" and i.argrepr == "@" for i in found)


def _kind(module: Any, calls: frozenset[str]) -> str | None:
    """How ``module``'s own code computes attention (observed, never by class name):
    through the attention interface, by calling SDPA itself, or by hand (a
    softmax of a product); ``None``: it computes none."""
    if _route.INTERFACE in calls and hasattr(
        getattr(module, "config", None), "_attn_implementation"
    ):
        return _INTERFACE
    if _route.SDPA in calls:
        return _SDPA
    if "softmax" in calls and calls & _PRODUCTS:
        return _BY_HAND
    return None


def computes_by_hand(module: Any) -> bool:
    """Whether ``module``'s own code computes softmax attention by hand (a softmax
    of a product, multiplied with values), observed as :func:`describe_sites` does."""
    own = _kind(module, _own_calls(module)) == _BY_HAND
    return own and _not_softmax_attention(module) is None


def custom_scale(scale: object, head_size: int) -> bool:
    """Whether a softmax scale differs from the default 1/sqrt(head size)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return False
    return _route._custom(scale, head_size)


def _with_call_facts(
    req: Requirements, module: Any, facts: tuple[int, int, int], backward: bool
) -> Requirements:
    """``req`` with ``gqa`` (of ``facts``: heads, kv heads, head size) and what
    every transformers attention call passes besides q, k, v: ``scaling`` (T5
    uses 1.0), ``sliding_window`` (set per layer), a logit softcap and (issue 19)
    attention sinks: a module holding ``sinks`` passes them (GPT-OSS's
    ``s_aux``), which only a kernel implementing them computes."""
    config = getattr(module, "config", None)
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is None and config is not None:
        softcap = getattr(config, "attn_logit_softcapping", None)
    # a window the module holds (Qwen2's per-layer one), or one its call passes
    # from its config (issue 32 item 4: ``sliding_window=getattr(self.config,
    # "sliding_window", None)`` in Mistral, Phi-3, Starcoder2, Mixtral)
    if hasattr(module, "sliding_window"):  # the layer's own (None: a full-attention layer)
        window = module.sliding_window is not None
    else:
        window = getattr(config, "sliding_window", None) is not None and bool(
            _WINDOW_ARGUMENTS & _passed_keywords(type(module))
        )
    heads, kv_heads, head_size = facts
    return attrs.evolve(
        req,
        backward=backward,
        gqa=kv_heads < heads,
        custom_scale=custom_scale(getattr(module, "scaling", None), head_size),
        sliding_window=window,
        softcap=softcap is not None,
        # (a module that holds no sinks, ``sinks = None``, passes none)
        sinks=bool(_SINK_ARGUMENTS & _passed_keywords(type(module)))
        and getattr(module, "sinks", True) is not None,
    )


#: the keyword arguments an attention call passes attention sinks as (GPT-OSS's
#: ``s_aux``, Inkling2's per-token ``sinks``; transformers 5.24), and its sliding
#: window as
_SINK_ARGUMENTS = frozenset({"s_aux", "sinks"})
_WINDOW_ARGUMENTS = frozenset({"sliding_window"})


#: class -> the keywords its own methods pass a call (read once per class)
_KEYWORDS_READ: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _passed_keywords(cls: type) -> frozenset[str]:
    """The keywords the code of ``cls``'s own methods passes to a call with a
    value other than ``None``, read from their source (once per class)."""
    if cls not in _KEYWORDS_READ:
        trees = [_route.source_tree(func) for func in _own_functions(cls)]
        _KEYWORDS_READ[cls] = frozenset(
            k.arg
            for tree in trees
            if tree is not None
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            for k in node.keywords
            if k.arg is not None
            and not (isinstance(k.value, ast.Constant) and k.value.value is None)
        )
    return _KEYWORDS_READ[cls]


def compute_dtype(module: Any, fallback: str) -> str:
    """A site's compute dtype: its first wide weight's, else ``fallback``
    (:func:`model_dtype`, read once per model: a diffusers model's ``dtype``
    walks every parameter)."""
    for param in module.parameters():
        if param.is_floating_point() and param.element_size() > 1:
            return normalize_dtype(param.dtype)
    return fallback


def model_dtype(model: Any) -> str:
    return normalize_dtype(getattr(model, "dtype", torch.float32))


def describe_sites(model: Any, component: str, dtype: str | None = None) -> list[SiteDescription]:
    """Every attention site of ``model``, described for the resolver (nothing changed).

    A site is a module whose own code computes attention (observed, see
    :func:`_kind`); modules inside a site are part of it:

    - it calls the attention interface: the site runs the function its
      model's config names (the innermost such module: a stack that names the
      interface to build masks holds attention modules that call it);
    - it calls SDPA itself: the generic route (:mod:`._route`) runs the kernel
      it was decided, as in diffusers;
    - it computes a softmax of a product by hand: its own code path, ``eager``
      only (where its code also calls SDPA, only when its config selects
      ``eager``);
    - a ``torch.nn.MultiheadAttention`` (SigLIP's pooling head) is a site of
      its own code path.
    """
    backward = trains(model)
    current_name = getattr(model.config, "_attn_implementation", None)
    out: list[SiteDescription] = []
    modules = [(n, m) for n, m in model.named_modules() if n]
    by_name = dict(modules)
    calls: dict[type, frozenset[str]] = {}
    kinds: dict[str, str] = {}
    for name, module in modules:
        if isinstance(module, torch.nn.MultiheadAttention):
            continue
        own = calls.get(type(module))
        if own is None:
            own = calls[type(module)] = _own_calls(module)
        kind = _kind(module, own)
        if kind == _SDPA and "softmax" in own and own & _PRODUCTS:
            # both paths in its code: the config picks one (Falcon)
            implementation = getattr(getattr(module, "config", None), "_attn_implementation", "")
            kind = _BY_HAND if implementation == "eager" else _SDPA
        if kind is not None:
            kinds[name] = kind
    api = _innermost(n for n, k in kinds.items() if k != _BY_HAND)
    hand = _innermost(
        n
        for n, k in kinds.items()
        if k == _BY_HAND and not any(_nested(n, a) or _nested(a, n) for a in api)
    )
    fallback = model_dtype(model)
    for name, module in modules:
        site_dtype = dtype or compute_dtype(module, fallback)
        if isinstance(module, torch.nn.MultiheadAttention):
            parent = model.get_submodule(name.rpartition(".")[0])
            out.append(_route.describe_mha(component, name, module, site_dtype, backward, parent))
        elif name in hand or (name in api and kinds[name] == _SDPA):
            out.append(_describe_own(component, name, module, site_dtype, backward, kinds[name]))
        elif name in api:
            owner = _owner(by_name, name, model)
            current = getattr(module.config, "_attn_implementation", current_name)
            out.append(
                _describe_interface(component, name, module, site_dtype, backward, owner, current)
            )
    return out


def _describe_interface(
    component: str,
    name: str,
    module: Any,
    dtype: str,
    backward: bool,
    owner: Any,
    current: str | None,
) -> SiteDescription:
    """A module that calls the attention interface: it runs the function its
    config names (``current``), one of what its ``owner`` model's class takes."""
    cls = type(module).__name__
    facts = _head_facts(module)
    now = _BY_FUNCTION.get(current or "eager")
    common: dict[str, Any] = {
        "component": component,
        "name": name,
        "module_class": cls,
        "route": ROUTE,
        "kind": RouteKind.INTERFACE,
        "dtype": dtype,
        "current": None if now is None else Backend(now),
    }
    if facts is None:
        # issue 19: its facts are read from its first call (the attention
        # function's products or SDPA call, _route.watch_forward)
        return SiteDescription(
            **common,
            supported=None,
            pending=True,
            why=f"{cls} calls the attention interface but holds no head count or "
            f"head size; they are read from the query and key of its first call",
        )
    heads, kv_heads, head_size = facts
    requirements = _CLASS_FACTS.get(cls, _observed_requirements)(module)
    flag = _hf_attention.opt_out_flag(type(owner))
    return SiteDescription(
        **common,
        # issue 19: a module holding attention sinks (GPT-OSS's ``s_aux``) requires
        # them (_with_call_facts), which the machine checks against each kernel
        supported=route_backends(owner),
        # issue 23: a class that opts out of attnres's function runs only
        # transformers' own functions, which take none of attnres's options
        host_kernel=None
        if flag is None
        else f"transformers' own attention function ({type(owner).__name__} "
        f"opts out of attnres's: {flag})",
        head_size=head_size,
        heads=heads,
        kv_heads=kv_heads,
        role=role(name, module),
        requirements=_with_call_facts(requirements, module, facts, backward),
    )


def _owner(modules: Mapping[str, Any], name: str, model: Any) -> Any:
    """The innermost transformers model holding the module ``name``: its class
    says which attention functions its code takes (a composite model's language
    model is a model of its own)."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        owner = modules.get(".".join(parts[:end]))
        if isinstance(owner, transformers.PreTrainedModel):
            return owner
    return model


def _nested(inner: str, outer: str) -> bool:
    return inner.startswith(outer + ".")


def _innermost(names: Iterable[str]) -> set[str]:
    found = list(names)
    return {n for n in found if not any(_nested(c, n) for c in found)}


def _describe_own(
    component: str, name: str, module: Any, dtype: str, backward: bool, kind: str
) -> SiteDescription:
    """A module that calls SDPA itself (the generic route) or computes softmax
    attention by hand (its own code path, ``eager`` only), as
    :func:`own_call_site` describes it. Its mask is whatever its own code builds:
    observed at its first call on the generic route.

    Issue 19: a module that holds no head facts is decided at its first call
    (its facts read from the query and key its first call brings,
    :func:`._route.watch_forward` for softmax by hand); a by-hand module whose
    softmax is not softmax attention (read from its source,
    :func:`_not_softmax_attention`) is recorded as such."""
    cls = type(module).__name__
    calls_sdpa = kind == _SDPA
    site = functools.partial(
        SiteDescription, component=component, name=name, module_class=cls, dtype=dtype
    )
    not_attention = None if calls_sdpa else _not_softmax_attention(module)
    if not_attention is not None:
        return site(
            route=f"own code in {cls}",
            kind=RouteKind.OWN_CODE,
            supported=None,
            softmax=False,
            why=f"{cls} {not_attention}",
        )
    facts = _head_facts(module)
    heads, kv_heads, head_size = facts if facts is not None else (None, None, None)
    req = Requirements(causal=getattr(module, "is_causal", False) is True, backward=backward)
    if facts is not None:
        req = _with_call_facts(req, module, facts, backward)
    cannot = _route.reroutes(module) if calls_sdpa else None
    site = functools.partial(
        site,
        head_size=head_size,
        heads=heads,
        kv_heads=kv_heads,
        role=role(name, module),
        requirements=req,
        pending=facts is None,
    )
    pinned = cannot if isinstance(cannot, str) else None
    return own_call_site(site, cls, cls, now=_TORCH_SDPA, by_hand=not calls_sdpa, pinned=pinned)


def own_call_site(
    site: functools.partial[SiteDescription],
    cls: str,
    owner: str,
    *,
    now: Backend | None,
    by_hand: bool = False,
    pinned: str | None = None,
    via: str = "SDPA",
) -> SiteDescription:
    """The site of a module of class ``cls`` whose own code (``owner``'s: its
    processor's, or its own) calls SDPA (``via``: or diffusers' dispatcher), which
    runs ``now``: the generic route; or (issue 30) computes softmax attention by
    hand: its own code, untouched, no kernel offered (the machine's
    written_by_hand). ``pinned``: why no copy can take its call, which then runs
    as written, pinned. ``site`` (either integration's) makes the description; one
    ``pending`` (decided at its first call) says why."""
    if by_hand:
        route, kind, now = _route.by_hand_route(owner), RouteKind.OWN_CODE, _EAGER
    elif pinned is not None:
        route, kind = f"its own attention call in {owner}, not reroutable: {pinned}", RouteKind.PIN
    else:
        # (the words of ``diffusers.ROUTE_GENERIC``)
        route, kind = f"generic route ({via} in {owner})", RouteKind.INTERCEPT
    why = None
    if site.keywords["pending"]:
        why = (
            f"{cls} holds no head count or head size; they are read from the query "
            f"and key of the scores product its first call computes"
            if by_hand
            else f"{cls} holds no head count and head size; they are read from the query, "
            f"key and value of its first call"
        )
    only = None if kind is RouteKind.INTERCEPT or now is None else frozenset({now})
    return site(route=route, kind=kind, supported=only, current=now, why=why)


#: the softmaxes attention normalises its scores with (by hand)
_SOFTMAXES = frozenset({"softmax", "hard_softmax", "gumbel_softmax"})
#: calls that hold the tensor as their first argument (``F.softmax(x, dim)``),
#: not as the receiver (``x.softmax(dim)``)
_FUNCTIONAL = frozenset({"F", "torch", "functional", "nn"})


def _not_softmax_attention(module: Any) -> str | None:
    """Why ``module``'s softmax of a product is not softmax attention, read from
    the source of its own classes' methods (``None``: it is, or the source cannot
    tell). Softmax attention normalises query-key scores (a product of two
    tensors) over the keys (the last axis) and multiplies the result with the
    values; a module whose every softmax normalises another axis, whose softmax
    takes no product, or whose softmax's result reaches no product, is not. A
    product is a matrix product, or a call of a helper whose code computes one (a
    method of its own, a function of its module, a submodule). On transformers
    5.24's 81 classes computing softmax by hand this records exactly three:
    GroupViT's assignment, SwiftFormer's additive attention and MGP-STR's token
    learner."""
    trees: list[tuple[str, ast.AST]] = []
    for func in _own_functions(type(module)):
        parsed = _route.source_tree(func)
        if parsed is None:
            return None
        trees.append((func.__name__, parsed))
    dims = [_softmax_dim(n) for _, tree in trees for n in ast.walk(tree) if _is_softmax(n)]
    if not dims:
        return None
    if all(isinstance(d, int) and d < -1 for d in dims):
        return (
            f"normalises its scores over axis {dims[0]} (softmax dim={dims[0]}), not over "
            f"the keys: an assignment, not softmax attention"
        )
    returning = {fn for fn, tree in trees if _returns_softmax(tree)}
    # a helper whose code multiplies matrices counts as a product where it is
    # called: a method of its own, a submodule whose own code does (a
    # relative-position scorer), a function of its module
    helpers = {fn for fn, tree in trees if _has_product(tree)}
    helpers |= {name for name, child in module.named_children() if _own_calls(child) & _PRODUCTS}
    glob = vars(sys.modules.get(type(module).__module__, types))
    helpers |= {
        node.func.id
        for _, tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and isinstance(value := glob.get(node.func.id), types.FunctionType)
        and _has_product(_route.source_tree(value))
    }

    def product(node: ast.AST) -> bool:
        if _is_product(node):
            return True
        if not isinstance(node, ast.Call):
            return False
        name = _self_call(node) or (node.func.id if isinstance(node.func, ast.Name) else None)
        return name in helpers

    def probability(node: ast.AST) -> bool:
        return _is_softmax(node) or (isinstance(node, ast.Call) and _self_call(node) in returning)

    for fn, tree in trees:
        if fn != "forward":
            continue
        scores, probs = _flow(tree, product), _flow(tree, probability)
        args = [_softmax_input(n) for n in ast.walk(tree) if _is_softmax(n)]
        if args and all(a is not None and not _mentions(a, scores, product) for a in args):
            return (
                "normalises no product of two tensors (no query-key scores: a learned "
                "projection's softmax, a token learner), not softmax attention"
            )
        if args and not any(
            product(n) and any(_mentions(o, probs) for o in _operands(n)) for n in ast.walk(tree)
        ):
            return (
                "multiplies its softmax's result with no values (it weighs and sums "
                "elementwise: additive attention), not softmax attention"
            )
    return None


def _is_softmax(node: ast.AST) -> TypeGuard[ast.Call]:
    return isinstance(node, ast.Call) and _called(node) in _SOFTMAXES


def _has_product(tree: ast.AST | None) -> bool:
    return tree is not None and any(_is_product(n) for n in ast.walk(tree))


def _called(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _self_call(node: ast.Call) -> str | None:
    func = node.func
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
    ):
        return func.attr
    return None


def _functional(node: ast.Call) -> bool:
    """``F.softmax(x)`` / ``torch.softmax(x)`` / ``nn.functional.softmax(x)`` /
    ``hard_softmax(x)`` / ``self.softmax(x)`` (a submodule): the tensor is the first
    argument."""
    func = node.func
    if isinstance(func, ast.Name) or _self_call(node) is not None:
        return True
    base = func.value if isinstance(func, ast.Attribute) else None
    while isinstance(base, ast.Attribute):
        if base.attr in _FUNCTIONAL:
            return True
        base = base.value
    return isinstance(base, ast.Name) and base.id in _FUNCTIONAL


def _softmax_input(node: ast.Call) -> ast.AST | None:
    if _functional(node):
        return node.args[0] if node.args else None
    func = node.func
    return func.value if isinstance(func, ast.Attribute) else None


def _softmax_dim(node: ast.Call) -> int | None:
    given = [k.value for k in node.keywords if k.arg == "dim"]
    if not given:
        position = 1 if _functional(node) else 0
        given = node.args[position : position + 1]
    value = given[0] if given else None
    if isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.USub):
        inner = value.operand
        if isinstance(inner, ast.Constant) and isinstance(inner.value, int):
            return -inner.value
    if isinstance(value, ast.Constant) and isinstance(value.value, int):
        return value.value
    return None


def _is_product(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return True
    return isinstance(node, ast.Call) and _called(node) in _PRODUCTS


def _operands(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp):
        return [node.left, node.right]
    assert isinstance(node, ast.Call)
    out: list[ast.AST] = [*node.args, *(k.value for k in node.keywords)]
    return out + ([node.func.value] if isinstance(node.func, ast.Attribute) else [])


def _mentions(
    node: ast.AST, names: set[str], source: Callable[[ast.AST], bool] | None = None
) -> bool:
    """Whether ``node`` holds one of ``names`` or a node ``source`` matches."""
    return any(
        (isinstance(n, ast.Name) and n.id in names) or (source is not None and source(n))
        for n in ast.walk(node)
    )


def _flow(tree: ast.AST, source: Callable[[ast.AST], bool]) -> set[str]:
    """The local names that hold a value computed from a node ``source`` matches
    (assignments followed to a fixed point)."""
    names: set[str] = set()
    assigns = [
        n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
    ]
    changed = True
    while changed:
        changed = False
        for node in assigns:
            if node.value is None or not _mentions(node.value, names, source):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name) and n.id not in names:
                        names.add(n.id)
                        changed = True
    return names


def _returns_softmax(tree: ast.AST) -> bool:
    """Whether a function returns a value computed from its softmax."""
    names = _flow(tree, _is_softmax)
    return any(
        isinstance(n, ast.Return) and n.value is not None and _mentions(n.value, names, _is_softmax)
        for n in ast.walk(tree)
    )


# =============================================================================
# plan / apply / verify / remove
# =============================================================================


def plan(
    model: Any,
    component: str,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
    *,
    dtype: DtypeChoice | None = None,
) -> PlanResult:
    """Describe and resolve every attention site of ``model`` as component ``component``."""
    sites = describe_sites(model, component, None if dtype is None else dtype.dtype)
    return plan_sites(
        title=type(model).__name__,
        components=[(component, dtype, sites)],
        config=config,
        platform=platform,
    )


@attrs.define(eq=False)
class _Install:
    """What apply changed on one config, to verify and undo it."""

    config: Any
    old: Any
    function: str
    backend: str
    sites: list[tuple[str, str, Any]] = attrs.Factory(list)  # (component, name, module)
    dtype: dict[str, str] = attrs.Factory(dict)


_INSTALLED_ATTR = "_attnres_installed"


def prepare(
    model: Any, result: PlanResult, component: str, prefix: str = ""
) -> tuple[list[Callable[[], object]], list[str]]:
    """The actions that install ``result``'s decisions for one model, and problems.

    ``prefix``: the model's name inside the component it is nested in (a
    transformers model held by a diffusers model, issue 19); only the sites
    under it are this model's. Nothing is changed until the actions run.
    """
    modules = {".".join(p for p in (prefix, n) if p): m for n, m in model.named_modules()}
    groups: dict[int, tuple[Any, dict[str, list[Site]]]] = {}
    problems: list[str] = []
    actions: list[Callable[[], object]] = []
    watched: list[tuple[Site, Any]] = []
    governed: set[tuple[str, str]] = set()  # every site decided here, installed or not
    for name, (_, module) in list(model.__dict__.get(_ROUTED_ATTR, {}).items()):
        # applied again: each earlier route is set aside first (a site routed again
        # gets its new one below), and put back where the apply fails
        actions.append(functools.partial(_set_aside, model, name, module))
    for site in result.sites:
        if site.component != component or (site.resolution is None and not site.pending):
            continue
        module = modules.get(site.name)
        if module is None:
            if not prefix:  # nested: the sites outside it are its holder's
                problems.append(f"{component}/{site.name}: module not found in the model")
            continue
        governed.add((component, site.name))
        if site.routed:
            # a module calling SDPA itself, or a MultiheadAttention (SigLIP's pooling
            # head): the generic route, installed only where the decision differs
            # from what the site runs (or it is decided at its first call)
            backend_now = None if site.resolution is None else site.resolution.backend
            if site.pending or backend_now != site.current:
                if backend_now is not None and get_kernel(backend_now.name) is None:
                    problems.append(
                        f"{component}/{site.name}: attnres has no kernel for {backend_now.name}"
                    )
                    continue
                actions.append(
                    functools.partial(_install_route, model, component, module, site, result)
                )
            continue
        if site.kind is RouteKind.INTERFACE and site.pending:
            watched.append((site, module))
            continue
        if site.kind in RUNS_OWN_CODE and site.pending:
            # issue 30: softmax by hand (or a call no copy can take) decided at its
            # first call: with no flag for its component nothing is wrapped; under
            # one, its first call is watched (its head facts read, nothing run but
            # its own code)
            if not _route.unflagged(result.config, component):
                watch = (model, component, module, site, result, site.current, site.route)
                actions.append(functools.partial(_install_route, *watch))
            continue
        if site.kind is not RouteKind.INTERFACE or site.resolution is None:
            continue  # its own code path runs what it was decided (or it was rejected)
        backend = site.resolution.backend.name
        function = _FUNCTIONS.get(backend)
        spec = site.spec
        owner = _owner(modules, site.name, model)
        # issue 23: options for the backend reach its kernel only through attnres's
        # function (transformers' own functions take none of attnres's)
        options = None if spec is None else dict(spec.backend_options).get(backend)
        if (options or Backend(backend) not in _native_backends(owner)) and Backend(
            backend
        ) in _hf_attention.backends_for(type(owner)):
            # issue 22: attnres's own function runs it (issue 19: with the masks the
            # class's code was written for)
            function = _hf_attention.name_for(type(owner))
        elif options and function is not None:
            problems.append(
                f"{component}/{site.name}: backend options "
                f"({', '.join(f'{backend}.{n}' for n, _ in options)}) cannot reach its kernel: "
                f"transformers' own {function!r} function runs {backend} there, not attnres's "
                f"(attnres has no kernel for it to run); drop them"
            )
            continue
        if function is None:
            problems.append(
                f"{component}/{site.name}: {backend} has no transformers attention function"
            )
            continue
        cfg, decided = groups.setdefault(id(module.config), (module.config, {}))
        # the attnres function runs one kernel per site; one config still takes
        # one function, so its sites must agree on the backend too
        key = function if function not in _hf_attention.NAMES else f"{function}:{backend}"
        decided.setdefault(key, []).append(site)
    for site, module in watched:
        # issue 19: an interface site decided at its first call runs the function
        # its config names (set by the sites sharing it, or as it was)
        shared = groups.get(id(module.config), (None, {}))[1]
        given: str | None = next(iter(shared)) if len(shared) == 1 else None
        if given is not None and given.partition(":")[0] in _hf_attention.NAMES:
            # attnres's function: it binds the site at its first call itself, from
            # the query and key it is given (each call checked, as everywhere)
            shared[given].append(site)
            continue
        runs = given or getattr(module.config, "_attn_implementation", None) or "eager"
        own = _BY_FUNCTION.get(runs)
        if own is None or own not in _WATCHED:
            problems.append(
                f"{component}/{site.name}: decided at its first call, and the attention "
                f"function its config runs ({runs}) is not one whose call attnres can "
                f"check before it runs ({', '.join(sorted(_WATCHED))} or attnres's own); "
                f"give this component one of those backends"
            )
            continue
        # transformers' eager or sdpa: its first call is watched before it runs
        route = f"{ROUTE} ({runs}, the function its config names)"
        watch = (model, component, module, site, result, Backend(own), route)
        actions.append(functools.partial(_install_route, *watch))
    for cfg, decided in groups.values():
        if len(decided) > 1:
            problems.append(
                f"{component}: sites sharing one config were given different backends ("
                + "; ".join(
                    f"{f}: {', '.join(s.name for s in group[:3])}"
                    for f, group in sorted(decided.items())
                )
                + "); transformers runs one attention function per config"
            )
            continue
        ((key, group),) = decided.items()
        install = (model, component, cfg, key, group, modules, result)
        actions.append(functools.partial(_install_function, *install))
    actions.append(functools.partial(_govern, model, governed))
    return actions, problems


_GOVERNED_ATTR = "_attnres_governed"


def _govern(model: Any, sites: set[tuple[str, str]]) -> Callable[[], None]:
    """Note ``sites`` (component, name) as governed by ``model``'s apply, what
    :func:`remove` restores and forgets, a site that installed nothing (it runs what
    it was decided) included; returns how to undo it."""
    before = model.__dict__.get(_GOVERNED_ATTR)
    model.__dict__[_GOVERNED_ATTR] = (before or set()) | sites

    def undo() -> None:
        if before is None:
            model.__dict__.pop(_GOVERNED_ATTR, None)
        else:
            model.__dict__[_GOVERNED_ATTR] = before

    return undo


#: what an interface site decided at its first call may run: the backends whose
#: call :func:`._route.watch_forward` sees before it runs (transformers' eager
#: function computes the scores product, its sdpa function calls SDPA)
_WATCHED = frozenset({"eager", "torch_sdpa"})


_ROUTED_ATTR = "_attnres_routed"


def _install_route(
    model: Any,
    component: str,
    module: Any,
    site: Site,
    result: PlanResult,
    own_backend: Backend | None = None,
    own_route: str | None = None,
) -> Callable[[], None]:
    """Install the generic route on one site: a module that calls SDPA itself (as
    diffusers' sites), or a MultiheadAttention (its own math, the attention the
    decided kernel); issue 19: a site decided at its first call whose route runs
    only its own code (``own_route``: softmax by hand, or ``own_backend`` through
    the attention interface) is watched (:func:`._route.watch_forward`).

    Returns how to undo it (run here too when it raises); an earlier apply's route
    on the site was set aside by a step before (:func:`_set_aside`), whose undo
    puts it back."""
    routed = model.__dict__.setdefault(_ROUTED_ATTR, {})

    def undo() -> None:  # apply failed: the site runs its own code again
        _route.remove_route(module)
        routed.pop(site.name, None)

    try:
        route = _route.site_route(site, result.config, result.platform, own_backend, own_route)
        own = (
            _route.mha_forward
            if isinstance(module, torch.nn.MultiheadAttention)
            else _route.watch_forward
            if own_route is not None
            else None
        )
        _route.install_route(module, route, own)
        route.tie(module)
        routed[site.name] = (component, module)
    except BaseException:
        undo()
        raise
    return undo


def _set_aside(model: Any, name: str, module: Any) -> Callable[[], None]:
    """Remove the route an earlier apply installed on the site ``name`` (``module``),
    if any; returns how to put it back (the apply failed)."""
    routed = model.__dict__.setdefault(_ROUTED_ATTR, {})
    entry, earlier = routed.pop(name, None), _route.remove_route(module)

    def put_back() -> None:
        if earlier is not None:
            _route.restore_route(module, earlier)
        if entry is not None:
            routed[name] = entry

    return put_back


def _install_function(
    model: Any,
    component: str,
    cfg: Any,
    key: str,
    sites: list[Site],
    modules: Mapping[str, Any],
    result: PlanResult,
) -> Callable[[], None]:
    """Set the attention function ``key`` names (``function`` or, for attnres's
    own, ``function:backend``) on one config its ``sites`` read.

    Returns how to undo it (run here too when it raises): the config and its
    modules run what they ran before, its earlier install where it was applied
    already, whose record this sets aside until then."""
    installs = model.__dict__.setdefault(_INSTALLED_ATTR, [])
    now = old = getattr(cfg, "_attn_implementation_internal", None)
    earlier = [r for r in installs if r.config is cfg]
    for record in earlier:
        # applied again: one record per config, and remove() still restores
        # the state before the first apply (issue 20, item 13)
        old = record.old
        installs.remove(record)
    # the modules' bound routes (issue 22) as they are, the earlier install's too
    touched = [modules[site.name] for site in sites] + [m for r in earlier for _, _, m in r.sites]
    bound = [(module, _hf_attention.bound_route(module)) for module in touched]
    function, _, backend = key.partition(":")
    rec = _Install(cfg, old, function, backend or _BY_FUNCTION[function])

    def undo() -> None:  # apply failed: the config runs what it ran before
        if rec in installs:
            installs.remove(rec)
        installs.extend(earlier)
        cfg._attn_implementation_internal = now
        for module, route in bound:
            if route is None:
                _hf_attention.unbind_module(module)
            else:
                _hf_attention.bind_module(module, route)

    try:
        fallback = model_dtype(model)
        cfg._attn_implementation_internal = function
        for site in sites:
            module = modules[site.name]
            if function in _hf_attention.NAMES:  # issue 22: bind the decided kernel
                _hf_attention.register()
                # issue 19: its route checks each call's facts against the plan
                # (where it decides torch SDPA, the function runs torch SDPA itself)
                route = _route.site_route(site, result.config, result.platform, _TORCH_SDPA)
                _hf_attention.bind_module(module, route)
            rec.sites.append((component, site.name, module))
            rec.dtype[site.name] = compute_dtype(module, fallback)
        # a module the earlier install bound that this one does not (another
        # function, or a site it no longer installs) keeps no unused binding
        rebound = {id(m) for _, _, m in rec.sites} if function in _hf_attention.NAMES else ()
        for module in (m for r in earlier for _, _, m in r.sites):
            if id(module) not in rebound:
                _hf_attention.unbind_module(module)
        installs.append(rec)
    except BaseException:
        undo()
        raise
    return undo


def apply(
    model: Any,
    component: str,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
) -> PlanResult:
    """Plan, then install every decision on ``model``, all or nothing. A transformers
    outside the supported range is refused first
    (:class:`~attnres.errors.UnsupportedVersionError`). Applied again, it replaces
    the earlier install (:func:`remove` still restores the untouched model); one
    that fails leaves the earlier install as it was."""
    check_version(transformers)
    result = plan(model, component, config, platform)
    refuse_to_apply(result)
    return install(result, *prepare(model, result, component))


def verify(model: Any) -> list[Problem]:
    """Installed decisions on ``model`` that no longer hold (empty: all hold)."""
    problems: list[Problem] = []
    fallback = model_dtype(model)
    for rec in model.__dict__.get(_INSTALLED_ATTR, []):
        now = getattr(rec.config, "_attn_implementation_internal", None)
        for component, name, module in rec.sites:
            if now != rec.function:
                why = f"attention implementation is {now!r} since apply installed "
                problems.append(Problem(component, name, f"{why}{rec.function!r} ({rec.backend})"))
            dtype = compute_dtype(module, fallback)
            if dtype != rec.dtype[name]:
                why = f"cast since apply: planned for {rec.dtype[name]}, now {dtype}"
                problems.append(Problem(component, name, f"{why}; plan and apply again"))
    return problems + [
        Problem(component, name, "the generic route apply installed is gone")
        for name, (component, module) in model.__dict__.get(_ROUTED_ATTR, {}).items()
        if _route.installed_route(module) is None
    ]


def routes(model: Any) -> dict[str, _route.GenericRoute]:
    """The generic routes apply installed on ``model``: ``component/site`` -> route."""
    out = {}
    for name, (component, module) in model.__dict__.get(_ROUTED_ATTR, {}).items():
        route = _route.installed_route(module)
        if route is not None:
            out[f"{component}/{name}"] = route
    return out


def remove(model: Any) -> int:
    """Restore the attention implementation(s) apply replaced; returns the number
    of attention sites restored (every site apply decided, one that installed
    nothing included; each once, however often apply ran); their ledger entries go
    with them."""
    installs = model.__dict__.pop(_INSTALLED_ATTR, [])
    for rec in reversed(installs):
        rec.config._attn_implementation_internal = rec.old
        for _, _, module in rec.sites:
            _hf_attention.unbind_module(module)  # issue 22
    routed = model.__dict__.pop(_ROUTED_ATTR, {})
    for _, module in routed.values():
        _route.remove_route(module)
    restored = model.__dict__.pop(_GOVERNED_ATTR, set())
    forget_decisions(restored)
    return len({name for _, name in restored})


def is_transformers_model(obj: Any) -> bool:
    return isinstance(obj, transformers.PreTrainedModel)
