"""Site descriptions and their planning, shared by the diffusers and transformers
integrations; the plan itself is :class:`attnres.plan.PlanResult` (one model for
pipeline files, model folders and live pipelines), each site a
:class:`attnres.plan.Site`.

A *site* is one attention call site of a component (one module); each is
described as a :class:`~attnres.LayerSpec` and resolved through
:func:`attnres.resolve` inside :func:`attnres.component_scope` (the component's
name), so it follows every rule of the selection contract like any layer
built with :class:`attnres.Attention`. Nothing here imports torch, diffusers
or transformers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from attrs import evolve, field, frozen

from attnres import audit as _audit
from attnres._states import Origin, RouteKind, SiteCode, Status
from attnres._varlen import check_layer_options
from attnres._vocab import Role, release
from attnres.backends import Backend, lookup_spec
from attnres.errors import (  # all in errors
    BackendOptionError,
    IntegrationError,
    ResolutionError,
    UnsupportedVersionError,
)
from attnres.layer import LayerSpec, Requirements, SelectionConfig
from attnres.layout import SequenceLayout
from attnres.ledger import Decision, set_decisions
from attnres.plan import (
    ComponentEntry,
    ComponentPlan,
    DtypeChoice,
    LayerEntry,
    LayerPlan,
    Pipeline,
    PlanResult,
    Site,
    SiteError,
    like_sites,
    unreached_role_override,
)
from attnres.platform import Platform
from attnres.runtime import (
    Resolution,
    capture_config,
    component_scope,
    resolve_entry,
    selection_config,
)
from attnres.scope import current_handle, scope_state
from attnres.trace import Outcome

__all__ = [
    "RUNS_OWN_CODE",
    "DtypeChoice",
    "IntegrationError",
    "Problem",
    "RouteKind",
    "Site",
    "SiteCode",
    "SiteDescription",
    "SiteError",
    "install",
    "plan_sites",
]


@frozen(kw_only=True)
class SiteDescription:
    """What an integration found at one site, before it is resolved.

    ``route`` names what executes the site (``generic route (SDPA in
    AttnProcessor2_0)``, ``transformers attention interface``...);
    ``supported`` is what that route can execute (``None``: any backend attnres
    has a kernel for), exactly: a route with a set runs only the backends it
    names, never a stand-in (the site's spec carries the route as
    ``LayerSpec.exact_route``, which the machine checks); ``current`` is the
    backend the site runs now, declared as the site's default only in
    components that may fall back. ``pending``: the
    route is known but the head facts are not, the site is decided at its first
    call. ``why`` without ``pending``: the site cannot be classified, or
    (``softmax=False``) is not softmax attention. Head facts not given are
    unknown (``None``).
    """

    component: str
    name: str
    module_class: str
    route: str
    supported: frozenset[Backend] | None
    head_size: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    dtype: str
    role: Role = Role.SELF
    requirements: Requirements = field(factory=Requirements)
    current: Backend | None = None
    why: str | None = None
    pending: bool = False
    softmax: bool = True
    #: how its kernel is put in place (its route's kind: dispatch on this)
    kind: RouteKind
    #: issue 24: the sequence-parallel layout the model runs the site under
    #: (diffusers' context parallelism, :func:`attnres.layout.context_parallel_layout`)
    layout: SequenceLayout | None = None
    #: what automatic choices (no flag) may take (``LayerSpec.preferred``): a site
    #: whose route runs any kernel but whose own code runs one keeps it with no flag
    preferred: frozenset[Backend] | None = None
    #: issue 23: what runs the site's kernel when it is not attnres's (diffusers'
    #: dispatcher pinned to a backend): attnres cannot pass that kernel the
    #: per-backend options; ``None``: attnres's own kernel call, options passed
    host_kernel: str | None = None


@frozen
class Problem:
    """An installed decision that no longer holds (what :func:`verify` reports)."""

    component: str
    name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.component}/{self.name}: {self.problem}"


#: module class name -> the place (the last part of a site's name) of its
#: cross-attention, where only its place tells it (every other site: its
#: ``is_cross_attention``): T5's ``EncDecAttention`` (transformers 5.24);
#: ``LTXAttention`` sets ``cross_attention_dim`` to the query width on its
#: self-attention too, so only ``attn2`` tells (diffusers 0.42.1; its prompt
#: padding mask is key padding, as diffusers' ``_mask_kind`` reads it). A wrong
#: or missing entry is caught at the first call (the mask is observed and
#: re-resolved).
CROSS_BY_PLACE: Mapping[str, str] = MappingProxyType(
    {"T5Attention": "EncDecAttention", "UMT5Attention": "EncDecAttention", "LTXAttention": "attn2"}
)


#: the kinds of site that run only their own code: one decided at its first call
#: under a flag has that call watched (softmax written by hand; a pin, as an
#: attention call no copy can take)
RUNS_OWN_CODE = frozenset({RouteKind.OWN_CODE, RouteKind.PIN})


def role(name: str, module: Any) -> Role:
    """The role of the site ``name`` (both integrations): by its place where
    :data:`CROSS_BY_PLACE` has its class, else by its ``is_cross_attention`` flag
    alone (FluxAttention's ``added_kv_proj_dim`` is joint self-attention)."""
    place = CROSS_BY_PLACE.get(type(module).__name__)
    if place is not None:
        return Role.CROSS if name.rsplit(".", 1)[-1] == place else Role.SELF
    return Role.CROSS if getattr(module, "is_cross_attention", False) is True else Role.SELF


# =============================================================================
# Resolving described sites
# =============================================================================


def plan_sites(
    *,
    title: str,
    source: str | None = None,
    components: Iterable[tuple[str, DtypeChoice | None, Sequence[SiteDescription]]],
    config: SelectionConfig | None,
    platform: Platform | None,
) -> PlanResult:
    """Resolve every described site inside its component's scope: the plan's rows
    are its like sites (:func:`attnres.plan.like_sites`), and each component keeps
    every site for ``apply``.

    A component that may fall back from the global flag gets each site's
    current backend as the site's declared default; a strict one never does
    (a declared default would relax the operator's flag, SPEC 3.2). A site that
    cannot be classified is an error in a strict component and a recorded
    note in one that may fall back: it keeps running its own code path.
    ``source``: where the pipeline came from (default: ``<title object>``).
    """
    cfg = selection_config() if config is None else config
    plat = Platform.detect() if platform is None else platform
    entries: list[ComponentEntry] = []
    planned: list[ComponentPlan] = []
    for comp, dtype, described in components:
        state = scope_state(comp)
        relaxed = state.allow_global_fallback
        with component_scope(comp):
            sites = tuple(_plan_one(desc, relaxed, cfg, plat) for desc in described)
        rows = [_row(comp, pattern, like) for pattern, like in like_sites(sites)]
        layers = tuple(row for row in rows if row is not None)
        entries.append(
            ComponentEntry(comp, state.kind, None, (), None, tuple(e for e, _ in layers))
        )
        planned.append(
            ComponentPlan(
                name=comp,
                kind=state.kind,
                loader=state.loader,
                allow_global_fallback=relaxed,
                layers=tuple(row for _, row in layers),
                # a command-line role override that reaches none of its sites is an
                # error, as for a pipeline file (and apply refuses it)
                error=unreached_role_override(comp, [s for s in sites if s.trace is not None], cfg),
                dtype=dtype,
                sites=sites,
            )
        )
    pipeline = Pipeline(title, source or f"<{title} object>", tuple(entries))
    return PlanResult(pipeline, plat, cfg, tuple(planned))


def _row(
    component: str, pattern: str, sites: Sequence[Site]
) -> tuple[LayerEntry, LayerPlan] | None:
    """One row of like sites, as the pipeline file's entry and the plan's row: the
    first one's outcome stands for all (a rejection with the site's own message,
    which names its route). ``None``: no resolution at plan time (unplanned)."""
    first = sites[0]
    res, trace = first.resolution, first.trace
    if trace is None or first.spec is None:
        return None
    outcome = (
        res.outcome
        if res is not None
        else Outcome(
            Status.REJECTED,
            trace.outcome.origin,
            code=trace.outcome.code,
            error=None if first.error is None else first.error.message,
        )
    )
    return LayerEntry(pattern, len(sites), first.spec), LayerPlan(
        component=component,
        name=pattern,
        count=len(sites),
        outcome=outcome,
        trace=trace,
        sites=tuple(s.name for s in sites),
        route=first.route,
        heads=first.heads,
        kv_heads=first.kv_heads,
    )


def _plan_one(
    desc: SiteDescription, relaxed: bool, config: SelectionConfig, platform: Platform
) -> Site:
    # the site with no outcome: each outcome below is this site evolved
    bare = Site(
        component=desc.component,
        name=desc.name,
        module_class=desc.module_class,
        route=desc.route,
        heads=desc.heads,
        kv_heads=desc.kv_heads,
        current=desc.current,
        kind=desc.kind,
        pending=desc.pending,
        spec=None,
        resolution=None,
        error=None,
        trace=None,
    )
    if desc.pending:
        return evolve(
            bare,
            note="decided at first call: "
            + (
                desc.why
                or "its head facts are read from the query, key and value of its first call"
            ),
        )
    if not desc.softmax:
        return evolve(bare, note=f"not softmax attention, left on its own code path: {desc.why}")
    if desc.why is not None or desc.head_size is None:
        why = desc.why or "its attention call cannot be classified"
        if relaxed:
            return evolve(bare, note=f"unclassified, left on its own code path: {why}")
        return evolve(
            bare,
            error=SiteError(
                SiteCode.UNCLASSIFIED,
                (
                    f"attention site {desc.name!r} ({desc.module_class}) of strict component "
                    f"{desc.component!r} cannot be classified: {why}; attnres cannot make it run "
                    f"the requested backend. Run a dry run (attnres.integrations.diffusers."
                    f"find_sdpa_calls) to see what it calls, or plan that component with an "
                    f"explicit per-component backend"
                ),
            ),
        )
    spec = LayerSpec(
        head_size=desc.head_size,
        dtype=desc.dtype,
        supported=desc.supported,
        default=desc.current if relaxed else None,
        role=desc.role,
        requirements=desc.requirements,
        name=desc.name,
        layout=desc.layout,  # issue 24
        preferred=desc.preferred,
        # a route with a set runs exactly that set: the machine keeps stand-ins off it
        exact_route=None if desc.supported is None else desc.route,
        backend_options=config.backend_options,  # issue 23: recorded in the site's trace
    )
    try:
        # issue 33: planning changes nothing -- the decision goes to the scope's
        # checks, not to the ledger (apply records what it installs)
        res, _ = resolve_entry(
            spec, capture_config(config), current_handle(), platform, None, ledger=False
        )
    except ResolutionError as exc:
        message = str(exc)
        if spec.exact_route is not None and spec.exact_route not in message:
            # the route is what limits the site: say which (issue 19: an MHA with
            # add_bias_kv names the fact that keeps it on its own code path; a class
            # that keeps its sites to transformers' own functions, the flag it sets)
            only = f"; {desc.host_kernel} only" if desc.host_kernel is not None else ""
            message += f" (the site's route: {spec.exact_route}{only})"
        return evolve(bare, spec=spec, trace=exc.trace, error=SiteError(exc.code, message))
    if (
        res.origin in _NOTHING_REQUESTED
        and desc.current is not None
        and res.backend != desc.current
    ):
        # issue 30: with no flag attnres changes nothing. The site's own backend
        # failed a check here (Gemma 2 on transformers 4.x: sdpa "does not
        # implement softcap", which that sdpa ignored) and the fallback chose
        # another, or a strict component (no default) took the platform's order
        # (a transformers class that runs eager moved to torch SDPA): a change
        # nobody asked for. The site keeps what it runs, and says why
        failed = res.reason.value if res.reason is not None else "the platform's order"
        return evolve(
            bare,
            spec=spec,
            note=f"nothing requested, left on its own code path ({desc.current.name}): "
            f"automatic selection would move it to {res.backend.name} ({failed}), which "
            f"changes its output; request a backend to move it",
        )
    _check_options(desc, spec, res, platform)
    return evolve(bare, spec=spec, resolution=res, trace=res.trace)


#: the origins of a resolution nobody asked for (no flag, no override, no request)
_NOTHING_REQUESTED = frozenset({Origin.LAYER_DEFAULT, Origin.NONE})


def _check_options(
    desc: SiteDescription, spec: LayerSpec, res: Resolution, platform: Platform
) -> None:
    """Issue 23: the per-backend options of the site's backend reach its kernel:
    the function that runs them on this platform takes them, and the site's
    route is attnres's own kernel call. Else a
    :class:`~attnres.errors.BackendOptionError` naming the site and why."""
    options = dict(spec.backend_options).get(res.backend.name)
    if not options:
        return
    where = f" for attention site {desc.name!r} of component {desc.component!r}"
    check_layer_options(lookup_spec(res.backend), spec, platform, where)
    if desc.host_kernel is None:
        return
    given = ", ".join(f"{res.backend.name}.{name}" for name, _ in options)
    raise BackendOptionError(
        f"backend_options{where} ({desc.module_class}): {given} cannot reach its kernel: "
        f"{desc.host_kernel} runs {res.backend.name} there, not attnres, and attnres passes "
        f"it nothing. Drop the options for this component (the site's route: {desc.route}) "
        f"(docs/integrations.md#per-backend-options)",
        res.backend.name,
        options[0][0],
    )


#: issue 30: the one table of the library versions the integrations support, as
#: pyproject.toml's extras declare them (``>=low,<high``; a test checks they agree),
#: and the attribute each is checked against (``<package>.__version__``)
SUPPORTED_VERSIONS: dict[str, tuple[str, str]] = {
    "transformers": ("5", "6"),
    "diffusers": ("0.42", "0.43"),
}


def check_version(module: Any) -> None:
    """Refuse, typed, the library ``module`` (the package an integration imported)
    at a version outside :data:`SUPPORTED_VERSIONS` (its ``__version__``): its
    code is not what attnres's routes were written against, and a route that
    half-works changes outputs silently
    (transformers 4.x: no flag moved Gemma 2 from sdpa to eager)."""
    package = module.__name__
    low, high = SUPPORTED_VERSIONS[package]
    installed = str(getattr(module, "__version__", "unknown"))
    found = release(installed)
    if found and release(low) <= found < release(high):
        return
    supported = f">={low},<{high}"
    raise UnsupportedVersionError(
        f"attnres's {package} integration supports {package}{supported} (the version "
        f"attnres[{package}] declares), but {package} {installed} is installed; nothing was "
        f"changed. Install a supported version: pip install '{package}{supported}'",
        package,
        installed,
        supported,
    )


def trains(model: Any) -> bool:
    """Whether a forward of ``model`` is a training forward (it needs a backward pass):
    in training mode with at least one parameter that requires grad."""
    return bool(model.training) and any(p.requires_grad for p in model.parameters())


def refuse_to_apply(result: PlanResult) -> None:
    """Raise :class:`IntegrationError` when ``result`` cannot be installed (it has
    problems, or was made for a simulated platform); shared by every integration."""
    if not result.ok:
        raise IntegrationError(
            f"cannot apply: {len(result.errors)} problem(s) in the plan; nothing was "
            f"changed. "
            + "; ".join(result.errors[:5])
            + ("; ..." if len(result.errors) > 5 else ""),
            result,
        )
    if result.platform.simulated:
        raise IntegrationError(
            f"cannot apply a plan made for a simulated platform "
            f"({result.platform.describe()}); nothing was changed. Plan for this machine "
            f"(platform=None) to install decisions",
            result,
        )


def install(
    result: PlanResult, steps: Iterable[Callable[[], object]], problems: Sequence[str]
) -> PlanResult:
    """Install ``result`` (a plan :func:`refuse_to_apply` let through), all or nothing;
    every integration's ``apply`` ends here. ``problems`` (what keeps it from being
    installed) raise :class:`IntegrationError` before any step runs; a step may return
    how to undo it, and when one raises, those done are undone in reverse. Then the
    site decisions become their current ledger entries (one per site: applying again
    replaces them), with one ``attention backend installed`` audit event per site."""
    if problems:
        raise IntegrationError(
            "cannot install the plan; nothing was changed: " + "; ".join(problems), result
        )
    undo: list[Callable[[], object]] = []
    try:
        for step in steps:
            done = step()
            if callable(done):
                undo.append(done)
    except Exception:
        for action in reversed(undo):
            action()
        raise
    set_decisions(
        Decision(site.component, site.name, site.trace.outcome, site.trace)
        for site in result.sites
        if site.trace is not None
    )
    log = _audit._logger(logging.INFO)
    for site in result.sites:
        res = site.resolution
        if log is None or res is None or site.trace is None:
            continue
        log.info(
            "attention backend installed",
            component=site.component,
            layer=site.name,
            backend=res.backend.name,
            reason=res.reason,
            origin=res.origin,
            route=site.route,
            digest=site.trace.digest,
        )
    return result
