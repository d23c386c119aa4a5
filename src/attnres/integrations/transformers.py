"""Govern a transformers model: every attention module's backend, decided by attnres.

transformers (5.x) modules look their attention function up on each call, by
``module.config._attn_implementation``, in ``ALL_ATTENTION_FUNCTIONS``
(``AttentionInterface``); the model builds its masks with the function of the
same name in ``ALL_MASK_ATTENTION_FUNCTIONS`` (``AttentionMaskInterface``). A
name with no mask function gets no mask at all -- padding silently dropped --
so a route counts only names registered in both.

The route that executes a site is its model's attention implementation; what
it can execute is :data:`FUNCTIONS` restricted to what the model class
declares (``_supports_sdpa``, ``_supports_flash_attn``, ``_supports_flex_attn``)
and to what is registered. Installing a decision sets the implementation on the
config the site's module reads; every site that reads one config must agree.

Importing this module imports torch and transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import transformers
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnres._vocab import MaskKind, Role, normalize_dtype
from attnres.backends import Backend
from attnres.integrations import _hf_attention
from attnres.integrations._plan import (
    DtypeChoice,
    IntegrationError,
    IntegrationPlan,
    Problem,
    SiteDescription,
    emit_installed,
    plan_sites,
    refuse_to_apply,
    trains,
)
from attnres.layer import Requirements, SelectionConfig
from attnres.platform import Platform

__all__ = [
    "CLASS_FACTS",
    "FUNCTIONS",
    "ROUTE",
    "apply",
    "describe_sites",
    "plan",
    "remove",
    "route_backends",
    "verify",
]

ROUTE = "transformers attention interface"

#: attnres backend -> the transformers attention function that executes it.
FUNCTIONS: dict[str, str] = {
    "torch_sdpa": "sdpa",
    "eager": "eager",
    "fa": "flash_attention_2",
    "fa3": "flash_attention_3",
    "flex_attention": "flex_attention",
}
_BY_FUNCTION = {v: k for k, v in FUNCTIONS.items()}

#: which class flag a model needs for a function (eager needs none)
_CLASS_FLAG: dict[str, str] = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}


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
    for backend, function in FUNCTIONS.items():
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
# Per-class facts: module attributes lie
# =============================================================================


class _Facts:
    """heads, kv heads, head size, role and requirements of one module class."""

    def __init__(
        self,
        heads: Callable[[Any], int],
        kv_heads: Callable[[Any], int],
        head_size: Callable[[Any], int],
        role: Callable[[str, Any], Role],
        requirements: Callable[[Any], Requirements],
        note: str,
    ) -> None:
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_size = head_size
        self.role = role
        self.requirements = requirements
        self.note = note


def _self(name: str, module: Any) -> Role:
    return Role.SELF


def _t5_role(name: str, module: Any) -> Role:
    return Role.CROSS if name.rsplit(".", 1)[-1] == "EncDecAttention" else Role.SELF


def _clip_causal(module: Any) -> Requirements:
    # issue 22: the text model passes causal with key padding (create_causal_mask
    # of its attention_mask); the vision model passes no mask
    text = getattr(module.config, "model_type", "") == "clip_text_model"
    return Requirements(causal=text, mask=MaskKind.KEY_PADDING if text else MaskKind.NONE)


def _t5_requirements(module: Any) -> Requirements:
    # issue 22: T5 passes its float position bias: an additive mask
    return Requirements(
        mask=MaskKind.ADDITIVE, causal=bool(module.is_decoder) and bool(module.is_causal)
    )


def _decoder_requirements(module: Any) -> Requirements:
    heads = module.config.num_attention_heads
    kv = getattr(module.config, "num_key_value_heads", None) or heads
    # issue 22: a decoder used as an encoder passes causal with key padding
    return Requirements(causal=bool(module.is_causal), gqa=kv < heads, mask=MaskKind.KEY_PADDING)


_T5 = _Facts(
    heads=lambda m: int(m.n_heads),
    kv_heads=lambda m: int(m.n_heads),
    head_size=lambda m: int(m.key_value_proj_dim),
    role=_t5_role,
    requirements=_t5_requirements,
    note="T5 always passes its float position bias as the mask: attn_mask is required",
)
_DECODER = _Facts(
    heads=lambda m: int(m.config.num_attention_heads),
    kv_heads=lambda m: int(
        getattr(m.config, "num_key_value_heads", None) or m.config.num_attention_heads
    ),
    head_size=lambda m: int(m.head_dim),
    role=_self,
    requirements=_decoder_requirements,
    note="heads come from the config: the module has no num_heads",
)

#: module class name -> its facts. Anything else with a ``config`` and a
#: ``head_dim`` is read like a decoder (:data:`_DECODER`).
CLASS_FACTS: dict[str, _Facts] = {
    "CLIPAttention": _Facts(
        heads=lambda m: int(m.num_heads),
        kv_heads=lambda m: int(m.num_heads),
        head_size=lambda m: int(m.head_dim),
        role=_self,
        requirements=_clip_causal,
        note="is_causal is False on the module: the text model passes causal per call",
    ),
    "T5Attention": _T5,
    "UMT5Attention": _T5,
    "Qwen2Attention": _DECODER,
    "Qwen3Attention": _DECODER,
    "LlamaAttention": _DECODER,
    "MistralAttention": _DECODER,
    "GemmaAttention": _DECODER,
    "Gemma2Attention": _DECODER,
}


def _facts_for(module: Any) -> _Facts | None:
    facts = CLASS_FACTS.get(type(module).__name__)
    if facts is not None:
        return facts
    config = getattr(module, "config", None)
    if (
        config is not None
        and hasattr(config, "_attn_implementation")
        and isinstance(getattr(module, "head_dim", None), int)
        and isinstance(getattr(config, "num_attention_heads", None), int)
        and hasattr(module, "is_causal")
    ):
        return _DECODER
    return None


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


def _looks_like_attention(module: Any) -> bool:
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name


def _compute_dtype(module: Any, model: Any) -> str:
    for param in module.parameters():
        if param.is_floating_point() and param.element_size() > 1:
            return normalize_dtype(param.dtype)
    return normalize_dtype(getattr(model, "dtype", torch.float32))


def describe_sites(
    model: Any, component: str, dtype: str | None = None
) -> list[SiteDescription]:
    """Every attention site of ``model``, described for the resolver (nothing changed)."""
    supported = route_backends(model)
    backward = trains(model)
    current_name = getattr(model.config, "_attn_implementation", None)
    modules = list(model.named_modules())
    found: list[tuple[str, Any, _Facts]] = [
        (name, m, f) for name, m in modules if (f := _facts_for(m)) is not None
    ]
    site_names = [name for name, _, _ in found]
    out: list[SiteDescription] = []
    seen = set(site_names)
    for name, module in modules:
        if name in seen:
            facts = next(f for n, _, f in found if n == name)
            site_current = getattr(module.config, "_attn_implementation", current_name)
            current = _BY_FUNCTION.get(site_current or "eager")
            out.append(
                SiteDescription(
                    component=component,
                    name=name,
                    module_class=type(module).__name__,
                    route=ROUTE,
                    supported=supported,
                    head_size=facts.head_size(module),
                    heads=facts.heads(module),
                    kv_heads=facts.kv_heads(module),
                    dtype=dtype or _compute_dtype(module, model),
                    role=facts.role(name, module),
                    requirements=_with_call_facts(
                        facts.requirements(module), module, facts.head_size(module), backward
                    ),
                    current=None if current is None else Backend(current),
                )
            )
        elif (
            name
            and _looks_like_attention(module)
            and not any(s.startswith(name + ".") or name.startswith(s + ".") for s in site_names)
        ):
            out.append(
                SiteDescription(
                    component=component,
                    name=name,
                    module_class=type(module).__name__,
                    route="unknown",
                    supported=None,
                    head_size=None,
                    heads=None,
                    kv_heads=None,
                    dtype=dtype or _compute_dtype(module, model),
                    why=f"{type(module).__name__} is not in attnres's table of transformers "
                    f"attention classes",
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
    kernels: dict[str, tuple[str, Requirements]] = {}
    problems: list[str] = []
    for site in result.sites:
        if site.component != component or site.resolution is None:
            continue
        module = modules.get(site.name)
        if module is None:
            problems.append(f"{component}/{site.name}: module not found in the model")
            continue
        backend = site.resolution.backend.name
        function = FUNCTIONS.get(backend)
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
            kernels[site.name] = (backend, spec.requirements)
    actions: list[Callable[[], None]] = []
    for cfg, decided in groups.values():
        if len(decided) > 1:
            problems.append(
                f"{component}: sites sharing one config were given different backends ("
                + "; ".join(f"{f}: {', '.join(n[:3])}" for f, n in sorted(decided.items()))
                + "); transformers runs one attention function per config"
            )
            continue
        (key, names), = decided.items()
        function = key.partition(":")[0]
        actions.append(_installer(model, component, cfg, function, names, modules, kernels))
    return actions, problems


def _installer(
    model: Any, component: str, cfg: Any, function: str, names: list[str],
    modules: Mapping[str, Any], kernels: Mapping[str, tuple[str, Requirements]],
) -> Callable[[], None]:
    def install() -> None:
        backend = _BY_FUNCTION.get(function) or kernels[names[0]][0]
        rec = _Install(cfg, getattr(cfg, "_attn_implementation_internal", None), function,
                       backend)
        cfg._attn_implementation_internal = function
        for name in names:
            module = modules[name]
            if function == _hf_attention.NAME:  # issue 22: bind the decided kernel
                _hf_attention.register()
                backend, requirements = kernels[name]
                _hf_attention.bind_module(module, backend, requirements)
            rec.sites.append((component, name, module))
            rec.dtype[name] = _compute_dtype(module, model)
        installs = model.__dict__.setdefault(_INSTALLED_ATTR, [])
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
                problems.append(Problem(component, name, (
                    f"attention implementation is {now!r} since apply installed "
                    f"{rec.function!r} ({rec.backend})")))
            dtype = _compute_dtype(module, model)
            if dtype != rec.dtype[name]:
                problems.append(Problem(component, name, (
                    f"cast since apply: planned for {rec.dtype[name]}, now {dtype}; plan "
                    f"and apply again")))
    return problems


def verify(model: Any) -> list[Problem]:
    """Installed decisions on ``model`` that no longer hold (empty: all hold)."""
    return verify_model(model)


def remove(model: Any) -> int:
    """Restore the attention implementation(s) apply replaced; returns how many."""
    installs = model.__dict__.pop(_INSTALLED_ATTR, [])
    for rec in reversed(installs):
        rec.config._attn_implementation_internal = rec.old
        for _, _, module in rec.sites:
            _hf_attention.unbind_module(module)
    return len(installs)


def is_transformers_model(obj: Any) -> bool:
    return isinstance(obj, transformers.PreTrainedModel)

