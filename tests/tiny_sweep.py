"""The per-class checks of the tiny diffusers sweep (issue 19, item 5).

For one class, built tiny on the CPU (:mod:`tiny_models`), :func:`check` runs:

- **no flag**: ``apply`` with no flag, then the output is bit-identical to the
  untouched model's;
- **remove exact**: ``remove`` returns the number of sites ``apply`` installed,
  and the modules, processors, instance ``forward``\\s, ``state_dict`` and
  output are what they were before ``apply``;
- **explicit eager, strict**: ``apply`` with ``eager`` on the strict
  ``transformer`` component installs the route at every site; a spy on the
  kernels the routes bind (``GenericRoute._kernel``) sees eager run at every
  site the forward reaches, and each call brings the facts the plan said
  (head size, heads, kv heads, dtype, mask and its kind, causal, softmax scale):
  a planned site that met a call its plan did not describe is a mismatch
  (``first_calls``); a site decided at first call is counted apart;
- the sites the forward reaches with a mask, and the mask's kind (for the
  table's mask column and the padding-mask check).

Problems are returned as strings (empty: every check held).
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from attnres import SelectionConfig
from attnres._states import Status
from attnres._vocab import MaskKind
from attnres.integrations import _route
from attnres.integrations import diffusers as idf
from attnres.integrations import transformers as itf

EAGER = SelectionConfig(global_backend="eager")
COMPONENT = "transformer"  # strict: the global flag is aimed at it


@dataclass
class Result:
    name: str
    sites: int = 0
    installed: int = 0
    removed: int = 0
    bit_identical: bool = False
    remove_exact: bool = False
    eager_everywhere: bool = False
    spied: int = 0  # sites whose kernel calls the spy saw and checked against the plan
    not_reached: list[str] = field(default_factory=list)
    pending: int = 0
    by_hand: int = 0
    #: transformers interface sites (nested in a diffusers model) whose config
    #: names the decided function: no route, transformers calls it
    interface: int = 0
    #: site -> the mask kinds its calls brought (observed by the spy)
    masks: dict[str, set[MaskKind]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    if hasattr(out, "to_tuple"):
        return _tensors(out.to_tuple())
    return []


def _run(model: torch.nn.Module, inputs: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' own deprecations and autocast notes
        return _tensors(model(**inputs()))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.nan_to_num(), y.nan_to_num())
        for x, y in zip(a, b, strict=True)
    )


def _state(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "modules": [(n, type(m), id(m)) for n, m in model.named_modules()],
        "processors": {n: id(getattr(m, "processor", None)) for n, m in model.named_modules()},
        "forwards": {n: m.__dict__.get("forward") for n, m in model.named_modules()},
        "state": {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()},
        "homes": {k for k in sys.modules if k.startswith("attnres._routed_")},
        "functions": {  # a nested transformers model's attention function
            n: m.config.__dict__.get("_attn_implementation_internal")
            for n, m in model.named_modules()
            if itf.is_transformers_model(m)
        },
    }


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    keys = ("modules", "processors", "forwards", "homes", "functions")
    out = [k for k in keys if a[k] != b[k]]
    if a["state"].keys() != b["state"].keys() or any(
        a["state"][k][0] != b["state"][k][0] or not torch.equal(a["state"][k][1], b["state"][k][1])
        for k in a["state"]
    ):
        out.append("state_dict")
    return out


def _installed(model: torch.nn.Module) -> int:
    """Sites apply governs: pinned diffusers modules, and the sites of a nested
    transformers model (its config's function, or a route)."""
    count = sum(1 for m in model.modules() if "_attnres_pin" in m.__dict__)
    for m in model.modules():
        if itf.is_transformers_model(m):
            installs = m.__dict__.get(itf._INSTALLED_ATTR, [])
            named = {name for rec in installs for _, name, _ in rec.sites}
            count += len(named | set(m.__dict__.get(itf._ROUTED_ATTR, {})))
    return count


class _Spy:
    """Wraps every kernel a route binds; records each call's facts per site."""

    def __init__(self) -> None:
        self.calls: dict[str, list[_route.CallFacts]] = {}

    def __enter__(self) -> _Spy:
        self.real = _route.GenericRoute._kernel
        spy = self

        def _kernel(route: Any, backend: Any, spec: Any, *rest: Any) -> Any:
            kernel = spy.real(route, backend, spec, *rest)
            if kernel is None:
                return None

            def spied(q: Any, k: Any, v: Any, attn_mask: Any, causal: bool, scale: Any) -> Any:
                spy.calls.setdefault(route.name, []).append(
                    _route.CallFacts.observe(q, k, attn_mask, 0.0, causal, scale, heads_dim=-2)
                )
                return kernel(q, k, v, attn_mask, causal, scale)

            return spied

        _route.GenericRoute._kernel = _kernel  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        _route.GenericRoute._kernel = self.real  # type: ignore[method-assign]


def _reached(model: torch.nn.Module, names: set[str], inputs: Any) -> set[str]:
    """The site modules a forward calls."""
    seen: set[str] = set()
    handles = [
        m.register_forward_pre_hook(lambda *_, n=n: seen.add(n))
        for n, m in model.named_modules()
        if n in names
    ]
    try:
        _run(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def check(name: str, model: torch.nn.Module, inputs: Any) -> Result:
    res = Result(name)
    comps = {COMPONENT: model}
    before = _state(model)
    ref = _run(model, inputs)

    # --- no flag: bit-identical, then remove restores exactly
    plan = idf.apply(comps)
    res.sites = len(plan.sites)
    res.installed = _installed(model)
    governed = [s for s in plan.sites if s.status in (Status.SELECTED, Status.PENDING)]
    if res.installed != len(governed):
        res.problems.append(
            f"no flag: {res.installed} installed for {len(governed)} governed sites"
        )
    res.bit_identical = _same(_run(model, inputs), ref)
    if not res.bit_identical:
        res.problems.append("no flag: output is not bit-identical")
    res.removed = idf.remove(comps)
    changed = _same_state(before, _state(model))
    after = _run(model, inputs)
    res.remove_exact = res.removed == res.installed and not changed and _same(after, ref)
    if not res.remove_exact:
        res.problems.append(
            f"remove: {res.removed} restored for {res.installed} installed; changed: {changed}; "
            f"output {'same' if _same(after, ref) else 'differs'}"
        )

    # --- explicit eager on a strict component: installed and running at every site
    sites = {s.name: s for s in plan.sites if s.status in (Status.SELECTED, Status.PENDING)}
    reached = _reached(model, set(sites), inputs)
    modules = dict(model.named_modules())
    with _Spy() as spy:
        eager = idf.apply(comps, EAGER)
        routes = {k.split("/", 1)[1]: r for k, r in idf.routes(comps).items()}
        functions = {
            s.name: getattr(modules[s.name].config, "_attn_implementation", None)
            for s in eager.sites
            if s.route == itf.ROUTE
        }
        out = _run(model, inputs)
        idf.remove(comps)
    if _same_state(before, _state(model)):
        res.problems.append("eager: remove did not restore")
    bad = [s.name for s in eager.sites if s.resolution is not None and s.backend.name != "eager"]
    if bad:
        res.problems.append(f"eager: decided otherwise at {bad[:2]}")
    everywhere = True
    for site in eager.sites:
        if site.name not in sites:
            continue
        if site.by_hand:  # softmax by hand: eager is its own code, no route
            res.by_hand += 1
            continue
        if site.name in functions:  # transformers calls the function its config names
            if functions[site.name] != "eager":
                everywhere = False
                res.problems.append(f"eager: {site.name} runs {functions[site.name]!r}")
            res.interface += 1
            continue
        route = routes.get(site.name)
        if route is None:
            everywhere = False
            res.problems.append(f"eager: no route at {site.name}")
            continue
        if site.name not in reached:
            res.not_reached.append(site.name)
            continue
        calls = spy.calls.get(site.name, [])
        if not calls:
            everywhere = False
            res.problems.append(f"eager: the kernel never ran at {site.name}")
            continue
        for facts in calls:
            if facts.mask.present:
                res.masks.setdefault(site.name, set()).add(facts.mask.kind)
        if site.pending:
            res.pending += 1
            continue
        res.spied += 1
        planned = _route.CallFacts.planned(site.spec, site.heads, site.kv_heads)
        wrong = {d for facts in calls for d in facts.differences(planned)}
        if route.first_calls or wrong:
            seen = {d for fc in route.first_calls for d in fc.changed} | wrong
            res.problems.append(f"facts: {site.name} planned otherwise: {sorted(seen)}")
    res.eager_everywhere = everywhere
    close = all(
        torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3, equal_nan=True)
        for a, b in zip(out, ref, strict=True)
    ) and len(out) == len(ref)
    if not close:
        res.problems.append("eager: output differs from the untouched model's beyond 1e-3")
    return res


def check_without_forward(name: str, model: torch.nn.Module) -> Result:
    """The checks that need no forward, for a class built tiny that cannot be run
    here: the plan with no flag is ok; ``apply`` installs a pin at every governed
    site and ``remove`` restores the modules, processors, instance forwards and
    ``state_dict`` exactly; an explicit strict ``eager`` installs its route at
    every governed site (softmax by hand excepted: eager is its own code)."""
    res = Result(name)
    comps = {COMPONENT: model}
    before = _state(model)
    plan = idf.apply(comps)
    res.sites = len(plan.sites)
    res.installed = _installed(model)
    governed = {s.name for s in plan.sites if s.status in (Status.SELECTED, Status.PENDING)}
    if not plan.ok or res.installed != len(governed):
        res.problems.append(f"no flag: ok={plan.ok}, {res.installed} installed for {governed}")
    res.removed = idf.remove(comps)
    changed = _same_state(before, _state(model))
    res.remove_exact = res.removed == res.installed and not changed
    if not res.remove_exact:
        res.problems.append(f"remove: {res.removed} for {res.installed}; changed: {changed}")
    eager = idf.apply(comps, EAGER)
    routes = {k.split("/", 1)[1] for k in idf.routes(comps)}
    idf.remove(comps)
    missing = [
        s.name for s in eager.sites if s.name in governed and not s.by_hand and s.name not in routes
    ]
    res.eager_everywhere = eager.ok and not missing
    if not res.eager_everywhere:
        res.problems.append(f"eager: ok={eager.ok}, no route at {missing[:2]}")
    if _same_state(before, _state(model)):
        res.problems.append("eager: remove did not restore")
    return res


def summary(results: list[Result]) -> Counter[str]:
    return Counter(
        {
            "run": len(results),
            "bit_identical": sum(r.bit_identical for r in results),
            "remove_exact": sum(r.remove_exact for r in results),
            "spied": sum(r.spied > 0 or r.pending > 0 for r in results),
            "eager_everywhere": sum(r.eager_everywhere for r in results),
        }
    )
