"""Govern a diffusers pipeline: every attention site of every component.

How diffusers (0.42) runs attention, and what follows for attnres:

- Processors built on the dispatcher (``FluxAttnProcessor``, ``WanAttnProcessor``,
  any processor class with an ``_attention_backend`` attribute) call
  ``dispatch_attention_fn(..., backend=self._attention_backend)``: a processor
  whose own ``_attention_backend`` is set runs that backend; one left at
  ``None`` runs the registry's *active* backend, which
  ``ModelMixin.set_attention_backend`` sets process-wide. attnres therefore
  pins each processor's ``_attention_backend`` and never touches the active
  backend; a processor shared by several modules is copied first, so that a
  pin reaches only its own site.
- ``set_attention_backend`` refuses a backend without context-parallel
  support when a processor has a ``_parallel_config``; a pinned site keeps
  that check: its route then executes only context-parallel backends.
- Legacy processors (:data:`LEGACY_PROCESSORS`: ``AttnProcessor2_0``,
  ``JointAttnProcessor2_0``, ...) call their kernel themselves and never reach
  the dispatcher: their route executes exactly one backend.
- Plain modules that call ``F.scaled_dot_product_attention`` themselves
  (:data:`DIRECT_SDPA_CLASSES`, the Wan VAE's ``WanAttentionBlock``) are found
  by class; any other module whose class name says attention is an
  *unclassified* site: an error in a strict component, a recorded note in one
  that may fall back. :func:`find_sdpa_calls` (an opt-in dry run) shows what
  a module really calls.
- The dtype that matters is the compute dtype: with layerwise casting the
  weights are stored in fp8 and the hook's ``compute_dtype`` is what runs.

Components that are transformers models (text encoders) are described by
:mod:`attnres.integrations.transformers`. Importing this module imports torch,
diffusers and transformers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import (
    AttentionBackendName,
    _AttentionBackendRegistry,
    _check_attention_backend_requirements,
)
from diffusers.models.attention_processor import Attention as _LegacyAttention

from attnres._vocab import Role, normalize_dtype
from attnres.backends import Backend
from attnres.integrations import transformers as _tf
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
    "DIRECT_SDPA_CLASSES",
    "DISPATCHER_BACKENDS",
    "LEGACY_PROCESSORS",
    "MASK_FACTS",
    "ROLE_FACTS",
    "ROUTE_DISPATCHER",
    "apply",
    "describe_sites",
    "find_sdpa_calls",
    "plan",
    "remove",
    "route_backends",
    "verify",
]

ROUTE_DISPATCHER = "diffusers dispatcher"

#: attnres backend -> the diffusers ``AttentionBackendName`` value that runs it.
#: Hub kernels (``*_hub``) are left out: they download code at run time.
DISPATCHER_BACKENDS: dict[str, str] = {
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
_BY_DIFFUSERS = {v: k for k, v in DISPATCHER_BACKENDS.items()}

#: processor class -> the one attnres backend it runs (it calls its kernel itself).
LEGACY_PROCESSORS: dict[str, str] = {
    "AttnProcessor2_0": "torch_sdpa",
    "JointAttnProcessor2_0": "torch_sdpa",
    "FusedAttnProcessor2_0": "torch_sdpa",
    "FusedJointAttnProcessor2_0": "torch_sdpa",
    "AttnAddedKVProcessor2_0": "torch_sdpa",
    "AttnProcessor": "eager",
    "AttnAddedKVProcessor": "eager",
    "XFormersAttnProcessor": "xformers",
}


def _wan_block(module: Any) -> tuple[int, int]:
    # one head over all channels (qkv reshaped to heads=1); no is_causal passed,
    # whatever the class docstring says
    return 1, int(module.dim)


#: plain modules that call ``F.scaled_dot_product_attention`` themselves:
#: class name -> (heads, head size) of an instance.
DIRECT_SDPA_CLASSES: dict[str, Callable[[Any], tuple[int, int]]] = {
    "WanAttentionBlock": _wan_block,
}

def _last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


#: attention module class -> role, from the module and its path.
#: ``FluxAttention``'s ``added_kv_proj_dim`` marks joint self-attention (text
#: and image tokens in one sequence), not cross; ``LTXAttention`` sets
#: ``cross_attention_dim`` to the query width on its self-attention, so only
#: its place (``attn2``) tells.
ROLE_FACTS: dict[str, Callable[[str, Any], Role]] = {
    "FluxAttention": lambda n, m: Role.SELF,
    "Attention": lambda n, m: Role.CROSS if bool(m.is_cross_attention) else Role.SELF,
    "WanAttention": lambda n, m: Role.CROSS if bool(m.is_cross_attention) else Role.SELF,
    "LTXAttention": lambda n, m: Role.CROSS if _last(n) == "attn2" else Role.SELF,
}

#: attention module class -> whether its caller passes a mask to the kernel.
#: LTX passes the prompt's padding mask to its cross-attention (``attn2``).
MASK_FACTS: dict[str, Callable[[str, Any], bool]] = {
    "LTXAttention": lambda n, m: _last(n) == "attn2",
}


def _role(name: str, module: Any) -> Role:
    fact = ROLE_FACTS.get(type(module).__name__)
    if fact is not None:
        return fact(name, module)
    return Role.CROSS if getattr(module, "is_cross_attention", False) is True else Role.SELF


def _requirements(
    name: str, module: Any, heads: int, kv_heads: int, head_size: int, trains: bool
) -> Requirements:
    mask = MASK_FACTS.get(type(module).__name__)
    return Requirements(
        attn_mask=bool(mask(name, module)) if mask is not None else False,
        gqa=kv_heads < heads,
        backward=trains,
        # Attention(scale_qk=False) or scale= passes its own softmax scale
        custom_scale=_tf.custom_scale(getattr(module, "scale", None), head_size),
    )


def route_backends(processor: Any) -> frozenset[Backend]:
    """What the dispatcher can execute for ``processor`` in this process."""
    registered = {b.value for b in _AttentionBackendRegistry._backends}
    parallel = getattr(processor, "_parallel_config", None) is not None
    out: set[Backend] = set()
    for backend, name in DISPATCHER_BACKENDS.items():
        if name not in registered:
            continue
        if parallel and not _AttentionBackendRegistry._is_context_parallel_available(
            AttentionBackendName(name)
        ):
            continue
        out.add(Backend(backend))
    return frozenset(out)


def _is_dispatcher(processor: Any) -> bool:
    return processor is not None and hasattr(type(processor), "_attention_backend")


def _active_backend() -> str:
    name = _AttentionBackendRegistry._active_backend
    return str(getattr(name, "value", name))


def _dtype_of(module: Any, fallback: str) -> str:
    """The compute dtype: a layerwise-casting hook's, else the first wide weight's."""
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        hook = None if registry is None else registry.get_hook("layerwise_casting")
        if hook is not None:
            return normalize_dtype(hook.compute_dtype)
    for param in module.parameters():
        if param.is_floating_point() and param.element_size() > 1:
            return normalize_dtype(param.dtype)
    return fallback


def _is_attention_module(module: Any) -> bool:
    return isinstance(module, (AttentionModuleMixin, _LegacyAttention))


def describe_sites(
    model: Any, component: str, dtype: str | None = None
) -> list[SiteDescription]:
    """Every attention site of one component (a diffusers or transformers model)."""
    if _tf.is_transformers_model(model):
        return _tf.describe_sites(model, component, dtype)
    fallback = normalize_dtype(getattr(model, "dtype", torch.float32))
    backward = trains(model)
    modules = list(model.named_modules())
    site_names = [
        n for n, m in modules
        if _is_attention_module(m) or type(m).__name__ in DIRECT_SDPA_CLASSES
    ]
    out: list[SiteDescription] = []
    for name, module in modules:
        cls = type(module).__name__
        site_dtype = dtype or _dtype_of(module, fallback)
        if _is_attention_module(module):
            out.append(_describe_attention(component, name, module, site_dtype, backward))
        elif cls in DIRECT_SDPA_CLASSES:
            heads, head_size = DIRECT_SDPA_CLASSES[cls](module)
            out.append(
                SiteDescription(
                    component=component, name=name, module_class=cls,
                    route=f"F.scaled_dot_product_attention in {cls}",
                    supported=frozenset({Backend("torch_sdpa")}), head_size=head_size,
                    heads=heads, kv_heads=heads, dtype=site_dtype,
                    requirements=Requirements(backward=backward),
                    current=Backend("torch_sdpa"),
                )
            )
        elif (
            name
            and _tf._looks_like_attention(module)
            and not any(s.startswith(name + ".") or name.startswith(s + ".") for s in site_names)
        ):
            out.append(
                SiteDescription(
                    component=component, name=name, module_class=cls, route="unknown",
                    supported=None, head_size=None, heads=None, kv_heads=None,
                    dtype=site_dtype,
                    why=f"{cls} is neither a diffusers attention module nor in attnres's "
                    f"table of modules that call SDPA themselves",
                )
            )
    return out


def _describe_attention(
    component: str, name: str, module: Any, dtype: str, backward: bool
) -> SiteDescription:
    cls = type(module).__name__
    processor = getattr(module, "processor", None)
    heads = int(module.heads)
    head_dim = getattr(module, "head_dim", None)
    head_size = int(head_dim) if isinstance(head_dim, int) else int(module.inner_dim) // heads
    kv = getattr(module, "kv_heads", None)
    kv_heads = int(kv) if isinstance(kv, int) else heads
    common: dict[str, Any] = {
        "component": component, "name": name, "module_class": cls, "head_size": head_size,
        "heads": heads, "kv_heads": kv_heads, "dtype": dtype, "role": _role(name, module),
        "requirements": _requirements(name, module, heads, kv_heads, head_size, backward),
    }
    pname = type(processor).__name__
    if _is_dispatcher(processor):
        own = processor.__dict__.get("_attention_backend")
        current_name = str(getattr(own, "value", own)) if own is not None else _active_backend()
        current = _BY_DIFFUSERS.get(current_name)
        parallel = getattr(processor, "_parallel_config", None) is not None
        route = ROUTE_DISPATCHER + (" (context parallel)" if parallel else "")
        return SiteDescription(
            **common, route=f"{route} via {pname}", supported=route_backends(processor),
            current=None if current is None else Backend(current),
        )
    if pname in LEGACY_PROCESSORS:
        only = Backend(LEGACY_PROCESSORS[pname])
        return SiteDescription(
            **common, route=f"{only.name} in {pname}", supported=frozenset({only}),
            current=only,
        )
    return SiteDescription(
        **common, route="unknown", supported=None,
        why=f"processor {pname} is neither dispatcher-based nor in attnres's table of "
        f"processors that call their kernel themselves",
    )


def _components(pipe: Any) -> list[tuple[str, Any]]:
    items = pipe.components if hasattr(pipe, "components") else pipe
    if not isinstance(items, Mapping):
        raise TypeError(
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
) -> IntegrationPlan:
    """Describe and resolve every attention site of every component; changes nothing.

    ``dtypes`` (component -> :class:`DtypeChoice`) overrides the compute dtype
    read from the modules (``attnres plan DIR`` passes what it chose).
    """
    parts = []
    for name, module in _components(pipe):
        choice = None if dtypes is None else dtypes.get(name)
        sites = describe_sites(module, name, None if choice is None else choice.dtype)
        parts.append((name, choice, sites))
    name = title or type(pipe).__name__
    return plan_sites(
        title=name, source=source or f"<{name} object>", components=parts,
        config=config, platform=platform,
    )


# =============================================================================
# apply / verify / remove
# =============================================================================


class _Pin:
    """What apply changed on one attention module, to verify and undo it."""

    __slots__ = ("backend", "component", "dtype", "had_own", "name", "old_backend",
                 "original", "processor", "value")

    def __init__(self, component: str, name: str, original: Any, processor: Any,
                 had_own: bool, old_backend: Any, value: Any, backend: str, dtype: str) -> None:
        self.component = component
        self.name = name
        self.original = original
        self.processor = processor
        self.had_own = had_own
        self.old_backend = old_backend
        self.value = value
        self.backend = backend
        self.dtype = dtype


_PIN_ATTR = "_attnres_pin"


_Planned = tuple[str, str, Any, Any, str, str, str]


def _prepare(
    pipe: Any, result: IntegrationPlan
) -> tuple[list[_Planned], list[Callable[[], None]], list[str]]:
    """The pins and transformers installs ``result`` needs, and the problems; no change."""
    pins: list[_Planned] = []
    actions: list[Callable[[], None]] = []
    problems: list[str] = []
    by_component = result.by_component()
    for comp, model in _components(pipe):
        if _tf.is_transformers_model(model):
            acts, probs = _tf.prepare(model, result, comp)
            actions += acts
            problems += probs
            continue
        modules = dict(model.named_modules())
        for site in by_component.get(comp, []):
            if site.resolution is None or site.spec is None:
                continue
            module = modules[site.name]
            backend = site.resolution.backend.name
            processor = getattr(module, "processor", None)
            if _is_dispatcher(processor):
                value = DISPATCHER_BACKENDS.get(backend)
                if value is None:
                    problems.append(f"{comp}/{site.name}: the dispatcher has no route "
                                    f"for {backend}")
                    continue
                pins.append((comp, site.name, module, processor, value, backend,
                             site.spec.dtype))
            else:
                only = ",".join(sorted(b.name for b in site.spec.supported or ()))
                if backend != only:
                    problems.append(f"{comp}/{site.name}: its route ({site.route}) runs only "
                                    f"{only}, not {backend}")
                    continue
                # nothing to pin: the route runs its one backend; recorded for verify()
                pins.append((comp, site.name, module, processor, "", backend, site.spec.dtype))
    return pins, actions, problems


def _check_requirements(values: set[str]) -> list[str]:
    problems = []
    for value in sorted(values):
        try:
            _check_attention_backend_requirements(AttentionBackendName(value))
        except Exception as exc:
            problems.append(f"diffusers cannot run backend {value!r} here: {exc}")
    return problems


def apply(
    pipe: Any,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
) -> IntegrationPlan:
    """Plan, then install every decision, all or nothing.

    Raises :class:`~attnres.integrations.IntegrationError` (``.plan`` attached)
    and changes nothing when any site is rejected or any decision cannot be
    installed. With no flag on a machine, outputs are bit-identical to the
    untouched pipeline (every site keeps the backend it ran).
    """
    result = plan(pipe, config, platform)
    refuse_to_apply(result)
    planned, others, problems = _prepare(pipe, result)
    problems += _check_requirements({p[4] for p in planned if p[4]})
    if problems:
        raise IntegrationError(
            "cannot install the plan; nothing was changed: " + "; ".join(problems), result
        )
    # processors shared by several modules get their own copy before any pin
    users: dict[int, int] = {}
    for _, _, _, original, value, _, _ in planned:
        if value:
            users[id(original)] = users.get(id(original), 0) + 1
    done: list[tuple[Any, _Pin]] = []
    try:
        for comp, name, module, original, value, backend, dtype in planned:
            if not value:
                pin = _Pin(comp, name, original, original, False, None, None, backend, dtype)
                module.__dict__[_PIN_ATTR] = pin
                done.append((module, pin))
                continue
            processor = copy.copy(original) if users[id(original)] > 1 else original
            had_own = "_attention_backend" in processor.__dict__
            old = processor.__dict__.get("_attention_backend")
            earlier = module.__dict__.get(_PIN_ATTR)
            first = original
            if earlier is not None:  # applied again: remove() still restores the first state
                first = earlier.original
                if earlier.processor is processor and earlier.value is not None:
                    had_own, old = earlier.had_own, earlier.old_backend
            pinned = AttentionBackendName(value)
            if processor is not original:
                module.set_processor(processor)
            processor._attention_backend = pinned
            pin = _Pin(comp, name, first, processor, had_own, old, pinned, backend, dtype)
            module.__dict__[_PIN_ATTR] = pin
            done.append((module, pin))
        for action in others:
            action()
    except Exception:
        for module, pin in reversed(done):
            _unpin(module, pin)
        raise
    emit_installed(result)
    return result


def _unpin(module: Any, pin: _Pin) -> None:
    if pin.value is None:
        module.__dict__.pop(_PIN_ATTR, None)
        return
    if pin.had_own:
        pin.processor._attention_backend = pin.old_backend
    else:
        pin.processor.__dict__.pop("_attention_backend", None)
    if module.processor is not pin.original:
        module.set_processor(pin.original)
    module.__dict__.pop(_PIN_ATTR, None)


def verify(pipe: Any) -> list[Problem]:
    """Installed decisions that no longer hold (empty: every one holds).

    Reports a processor replaced since ``apply`` (IP-Adapter loading,
    ``set_attn_processor``), a pin changed, and a site cast to another compute
    dtype than it was planned for.
    """
    problems: list[Problem] = []
    for _, model in _components(pipe):
        if _tf.is_transformers_model(model):
            problems += _tf.verify_model(model)
            continue
        fallback = normalize_dtype(getattr(model, "dtype", torch.float32))
        for _, module in model.named_modules():
            pin = module.__dict__.get(_PIN_ATTR)
            if pin is None:
                continue
            where = (pin.component, pin.name)
            if getattr(module, "processor", None) is not pin.processor:
                problems.append(Problem(*where, (
                    f"processor replaced since apply (now "
                    f"{type(getattr(module, 'processor', None)).__name__}); "
                    f"its backend is no longer governed: plan and apply again")))
            elif pin.value is not None and (
                pin.processor.__dict__.get("_attention_backend") != pin.value
            ):
                problems.append(Problem(*where, (
                    f"pinned backend changed since apply (was {pin.value.value})")))
            dtype = _dtype_of(module, fallback)
            if dtype != pin.dtype:
                problems.append(Problem(*where, (
                    f"cast since apply: planned for {pin.dtype}, now {dtype}; plan and apply "
                    f"again")))
    return problems


def remove(pipe: Any) -> int:
    """Restore the original processors and implementations; returns sites restored."""
    count = 0
    for _, model in _components(pipe):
        if _tf.is_transformers_model(model):
            count += _tf.remove(model)
            continue
        for _, module in model.named_modules():
            pin = module.__dict__.get(_PIN_ATTR)
            if pin is not None:
                _unpin(module, pin)
                count += 1
    return count


# =============================================================================
# The opt-in dry run
# =============================================================================


@contextmanager
def _sdpa_spy(model: torch.nn.Module, calls: dict[str, int]) -> Iterator[None]:
    from torch.overrides import TorchFunctionMode

    stack: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, *_: stack.append(names[id(m)])))
        handles.append(module.register_forward_hook(lambda m, *_: (stack.pop(), None)[1]))

    sdpa = torch.nn.functional.scaled_dot_product_attention

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func is sdpa:
                where = stack[-1] if stack else ""
                calls[where] = calls.get(where, 0) + 1
            return func(*args, **(kwargs or {}))

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
    with torch.no_grad(), _sdpa_spy(model, calls):
        model(*args, **kwargs)
    return calls
