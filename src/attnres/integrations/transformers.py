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

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch
import transformers
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnres._vocab import MaskKind, Role, normalize_dtype
from attnres.backends import Backend
from attnres.integrations import _hf_attention, _route
from attnres.integrations._plan import (
    DtypeChoice,
    IntegrationError,
    IntegrationPlan,
    Problem,
    Site,
    SiteDescription,
    emit_installed,
    plan_sites,
    refuse_to_apply,
    trains,
)
from attnres.layer import Requirements, SelectionConfig
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

    Issue 22: a class that dispatches through the attention interface
    (``_supports_attention_backend``) also runs every dense backend with an
    attnres kernel, through attnres's own function (:mod:`._hf_attention`).
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


def _self(name: str, module: Any) -> Role:
    return Role.CROSS if getattr(module, "is_cross_attention", False) is True else Role.SELF


def _t5_role(name: str, module: Any) -> Role:
    return Role.CROSS if name.rsplit(".", 1)[-1] == "EncDecAttention" else Role.SELF


class _Fact:
    """What code cannot tell about one attention class before its call."""

    def __init__(
        self,
        role: Callable[[str, Any], Role],
        requirements: Callable[[Any], Requirements],
        why: str,
    ) -> None:
        self.role = role
        self.requirements = requirements
        self.why = why


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


_T5 = _Fact(
    _t5_role,
    _t5_requirements,
    "T5 always passes its float position bias as the mask; its cross-attention is "
    "told only by its place (EncDecAttention)",
)

#: module class name -> the facts its code does not tell before the call,
#: checked against transformers 5.24 (every other fact is read from the module)
_CLASS_FACTS: Mapping[str, _Fact] = MappingProxyType(
    {
        "CLIPAttention": _Fact(
            _self,
            _clip_requirements,
            "is_causal is False on the module: the text model passes causal per call",
        ),
        "T5Attention": _T5,
        "UMT5Attention": _T5,
    }
)


def _observed_requirements(module: Any, heads: int, kv_heads: int) -> Requirements:
    # issue 22: a model's mask function builds padding masks (causal ones for a
    # decoder used as an encoder): key padding
    return Requirements(
        causal=getattr(module, "is_causal", False) is True,
        gqa=kv_heads < heads,
        mask=MaskKind.KEY_PADDING,
    )


def _head_facts(module: Any) -> tuple[int, int, int] | None:
    """``(heads, kv_heads, head_size)`` from the module, else from its config."""
    config = getattr(module, "config", None)
    heads = _route._int_attr(module, ("num_heads", "num_attention_heads", "n_heads", "heads"))
    if heads is None and config is not None:
        heads = _route._int_attr(config, ("num_attention_heads", "num_heads", "n_head"))
    size = _route._int_attr(
        module, ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size")
    )
    if heads is None or size is None:
        return None
    kv = _route._int_attr(module, ("num_key_value_heads", "num_kv_heads"))
    groups = _route._int_attr(module, ("num_key_value_groups",))
    if kv is None and groups is not None and heads % groups == 0:
        kv = heads // groups
    if kv is None and config is not None:
        kv = _route._int_attr(config, ("num_key_value_heads",))
    return heads, (kv if kv is not None and heads % kv == 0 else heads), size


def _is_interface_site(module: Any) -> bool:
    """Whether the module's own code looks its attention function up in
    ``ALL_ATTENTION_FUNCTIONS`` (observed, never by class name)."""
    if not hasattr(getattr(module, "config", None), "_attn_implementation"):
        return False
    return _route.INTERFACE in _route.calls_of(_route.methods_of(module), depth=1)


def custom_scale(scale: object, head_size: int) -> bool:
    """Whether a softmax scale differs from the default 1/sqrt(head size)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return False
    default = 1.0 / math.sqrt(head_size)
    return abs(float(scale) - default) > 1e-6 * default


def _with_call_facts(
    req: Requirements, module: Any, head_size: int, backward: bool
) -> Requirements:
    """What every transformers attention call passes besides q, k, v: ``scaling``
    (T5 uses 1.0), ``sliding_window`` (set per layer) and a logit softcap."""
    config = getattr(module, "config", None)
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is None and config is not None:
        softcap = getattr(config, "attn_logit_softcapping", None)
    return attrs.evolve(
        req,
        backward=backward,
        custom_scale=custom_scale(getattr(module, "scaling", None), head_size),
        sliding_window=getattr(module, "sliding_window", None) is not None,
        softcap=softcap is not None,
    )


def _compute_dtype(module: Any, model: Any) -> str:
    for param in module.parameters():
        if param.is_floating_point() and param.element_size() > 1:
            return normalize_dtype(param.dtype)
    return normalize_dtype(getattr(model, "dtype", torch.float32))


def describe_sites(model: Any, component: str, dtype: str | None = None) -> list[SiteDescription]:
    """Every attention site of ``model``, described for the resolver (nothing changed).

    A site is a module whose own code calls the attention interface; modules
    inside a site are part of it. A ``torch.nn.MultiheadAttention`` (SigLIP's
    pooling head) is a site of its own code path.
    """
    supported = route_backends(model)
    backward = trains(model)
    current_name = getattr(model.config, "_attn_implementation", None)
    out: list[SiteDescription] = []
    modules = [(n, m) for n, m in model.named_modules() if n]
    # the innermost modules whose code calls the interface are the sites (a stack
    # that names it to build masks holds attention modules that call it)
    calling = [n for n, m in modules if _is_interface_site(m)]
    sites = {n for n in calling if not any(c.startswith(n + ".") for c in calling)}
    for name, module in modules:
        site_dtype = dtype or _compute_dtype(module, model)
        if isinstance(module, torch.nn.MultiheadAttention):
            parent = model.get_submodule(name.rpartition(".")[0])
            out.append(_route.describe_mha(component, name, module, site_dtype, backward, parent))
            continue
        if name not in sites:
            continue
        cls = type(module).__name__
        facts = _head_facts(module)
        if facts is None:
            out.append(
                SiteDescription(
                    component=component,
                    name=name,
                    module_class=cls,
                    route=ROUTE,
                    supported=None,
                    head_size=None,
                    heads=None,
                    kv_heads=None,
                    dtype=site_dtype,
                    why=f"{cls} calls the attention interface but holds no head count or "
                    f"head size attnres can read",
                )
            )
            continue
        heads, kv_heads, head_size = facts
        fact = _CLASS_FACTS.get(cls)
        req = (
            fact.requirements(module)
            if fact is not None
            else _observed_requirements(module, heads, kv_heads)
        )
        site_current = getattr(module.config, "_attn_implementation", current_name)
        current = _BY_FUNCTION.get(site_current or "eager")
        out.append(
            SiteDescription(
                component=component,
                name=name,
                module_class=cls,
                route=ROUTE,
                supported=supported,
                head_size=head_size,
                heads=heads,
                kv_heads=kv_heads,
                dtype=site_dtype,
                role=(fact.role if fact is not None else _self)(name, module),
                requirements=_with_call_facts(
                    attrs.evolve(req, gqa=kv_heads < heads), module, head_size, backward
                ),
                current=None if current is None else Backend(current),
            )
        )
    return out


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
) -> IntegrationPlan:
    """Describe and resolve every attention site of ``model`` as component ``component``."""
    sites = describe_sites(model, component, None if dtype is None else dtype.dtype)
    return plan_sites(
        title=type(model).__name__,
        source=f"<{type(model).__name__} object>",
        components=[(component, dtype, sites)],
        config=config,
        platform=platform,
    )


class _Install:
    """What apply changed on one config, to verify and undo it."""

    __slots__ = ("backend", "config", "dtype", "function", "old", "sites")

    def __init__(self, config: Any, old: Any, function: str, backend: str) -> None:
        self.config = config
        self.old = old
        self.function = function
        self.backend = backend
        self.sites: list[tuple[str, str, Any]] = []  # (component, name, module)
        self.dtype: dict[str, str] = {}


_INSTALLED_ATTR = "_attnres_installed"


def prepare(
    model: Any, result: IntegrationPlan, component: str
) -> tuple[list[Callable[[], None]], list[str]]:
    """The actions that install ``result``'s decisions for one model, and problems.

    Nothing is changed until the actions run.
    """
    modules = dict(model.named_modules())
    groups: dict[int, tuple[Any, dict[str, list[str]]]] = {}
    sites: dict[str, Site] = {}
    problems: list[str] = []
    actions: list[Callable[[], None]] = []
    for site in result.sites:
        if site.component != component or site.resolution is None:
            continue
        module = modules.get(site.name)
        if module is None:
            problems.append(f"{component}/{site.name}: module not found in the model")
            continue
        if site.routed:  # issue 19: a MultiheadAttention (SigLIP's pooling head)
            if site.resolution.backend != site.current:  # what it runs already: nothing
                actions.append(_mha_installer(model, module, site, result))
            continue
        if isinstance(module, torch.nn.MultiheadAttention):
            # its own code path only (its supported set is what it runs): nothing
            # to install, whatever was decided is what runs
            continue
        backend = site.resolution.backend.name
        function = _FUNCTIONS.get(backend)
        spec = site.spec
        if Backend(backend) not in _native_backends(model) and Backend(
            backend
        ) in _hf_attention.backends_for(type(model)):
            function = _hf_attention.NAME  # issue 22: attnres's own function runs it
        if function is None:
            problems.append(
                f"{component}/{site.name}: {backend} has no transformers attention function"
            )
            continue
        cfg, decided = groups.setdefault(id(module.config), (module.config, {}))
        # the attnres function runs one kernel per site; one config still takes
        # one function, so its sites must agree on the backend too
        key = function if function != _hf_attention.NAME else f"{function}:{backend}"
        decided.setdefault(key, []).append(site.name)
        if spec is not None:
            sites[site.name] = site
    for cfg, decided in groups.values():
        if len(decided) > 1:
            problems.append(
                f"{component}: sites sharing one config were given different backends ("
                + "; ".join(f"{f}: {', '.join(n[:3])}" for f, n in sorted(decided.items()))
                + "); transformers runs one attention function per config"
            )
            continue
        ((key, names),) = decided.items()
        function = key.partition(":")[0]
        actions.append(_installer(model, component, cfg, function, names, modules, sites, result))
    return actions, problems


_ROUTED_ATTR = "_attnres_routed"


def _mha_installer(
    model: Any, module: Any, site: Site, result: IntegrationPlan
) -> Callable[[], None]:
    def install() -> None:
        route = _route.site_route(site, result.config, result.platform)
        _route.install_route(module, route, _route.mha_forward(module, route))
        route.tie(module)
        model.__dict__.setdefault(_ROUTED_ATTR, {})[site.name] = module

    return install


def _installer(
    model: Any,
    component: str,
    cfg: Any,
    function: str,
    names: list[str],
    modules: Mapping[str, Any],
    sites: Mapping[str, Site],
    result: IntegrationPlan,
) -> Callable[[], None]:
    def install() -> None:
        installs = model.__dict__.setdefault(_INSTALLED_ATTR, [])
        old = getattr(cfg, "_attn_implementation_internal", None)
        for earlier in [r for r in installs if r.config is cfg]:
            # applied again: one record per config, and remove() still restores
            # the state before the first apply (issue 20, item 13)
            old = earlier.old
            installs.remove(earlier)
        backend = _BY_FUNCTION.get(function) or sites[names[0]].backend.name  # type: ignore[union-attr]
        rec = _Install(cfg, old, function, backend)
        cfg._attn_implementation_internal = function
        for name in names:
            module = modules[name]
            if function == _hf_attention.NAME:  # issue 22: bind the decided kernel
                _hf_attention.register()
                # issue 19: its route checks each call's facts against the plan
                # (where it decides torch SDPA, the function runs torch SDPA itself)
                route = _route.site_route(
                    sites[name], result.config, result.platform, Backend("torch_sdpa")
                )
                _hf_attention.bind_module(module, route)
            rec.sites.append((component, name, module))
            rec.dtype[name] = _compute_dtype(module, model)
        installs.append(rec)

    return install


def apply(
    model: Any,
    component: str,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
) -> IntegrationPlan:
    """Plan, then install every decision on ``model``, all or nothing."""
    result = plan(model, component, config, platform)
    refuse_to_apply(result)
    actions, problems = prepare(model, result, component)
    if problems:
        raise IntegrationError(
            "cannot install the plan; nothing was changed: " + "; ".join(problems), result
        )
    for action in actions:
        action()
    emit_installed(result)
    return result


def verify_model(model: Any) -> list[Problem]:
    problems: list[Problem] = []
    for rec in model.__dict__.get(_INSTALLED_ATTR, []):
        now = getattr(rec.config, "_attn_implementation_internal", None)
        for component, name, module in rec.sites:
            if now != rec.function:
                problems.append(
                    Problem(
                        component,
                        name,
                        (
                            f"attention implementation is {now!r} since apply installed "
                            f"{rec.function!r} ({rec.backend})"
                        ),
                    )
                )
            dtype = _compute_dtype(module, model)
            if dtype != rec.dtype[name]:
                problems.append(
                    Problem(
                        component,
                        name,
                        (
                            f"cast since apply: planned for {rec.dtype[name]}, now {dtype}; plan "
                            f"and apply again"
                        ),
                    )
                )
    return problems


def verify(model: Any) -> list[Problem]:
    """Installed decisions on ``model`` that no longer hold (empty: all hold)."""
    return verify_model(model)


def remove(model: Any) -> int:
    """Restore the attention implementation(s) apply replaced; returns the number
    of attention sites restored (each site once, however often apply ran)."""
    installs = model.__dict__.pop(_INSTALLED_ATTR, [])
    for rec in reversed(installs):
        rec.config._attn_implementation_internal = rec.old
        for _, _, module in rec.sites:
            _hf_attention.unbind_module(module)  # issue 22
    routed = model.__dict__.pop(_ROUTED_ATTR, {})
    for module in routed.values():
        _route.remove_route(module)
    return len({name for rec in installs for _, name, _ in rec.sites} | set(routed))


def is_transformers_model(obj: Any) -> bool:
    return isinstance(obj, transformers.PreTrainedModel)
