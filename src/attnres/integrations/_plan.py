"""The plan types the diffusers and transformers integrations share.

A *site* is one attention call site of a component (one module); each is
described as a :class:`~attnres.LayerSpec` and resolved through
:func:`attnres.resolve` inside :func:`attnres.component_scope` (the component's
name), so it follows every rule of the selection contract like any layer
built with :class:`attnres.Attention`. Nothing here imports torch, diffusers
or transformers.
"""

from __future__ import annotations

import enum
import logging
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
from attrs import field, frozen

from attnres import audit as _audit
from attnres._states import Origin, Status
from attnres._varlen import check_layer_options
from attnres._vocab import Role
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
    LayerEntry,
    LayerPlan,
    Pipeline,
    PlanResult,
    UnplannedSite,
    unreached_role_override,
    write_plan_traces,
)
from attnres.platform import Platform
from attnres.render import render_plan
from attnres.runtime import (
    Resolution,
    capture_config,
    component_scope,
    resolve_entry,
    selection_config,
)
from attnres.scope import current_handle, scope_state
from attnres.trace import Outcome, Trace

__all__ = [
    "DtypeChoice",
    "IntegrationError",
    "IntegrationPlan",
    "Problem",
    "RouteKind",
    "Site",
    "SiteCode",
    "SiteDescription",
    "SiteError",
    "plan_sites",
]


@frozen
class DtypeChoice:
    """The dtype a component is planned for, and where it came from.

    ``source`` is one of ``--dtype``, ``--dtype COMPONENT=``, ``weights``
    (safetensors headers), ``config torch_dtype``, ``default float32`` or
    ``module`` (a live module's compute dtype).
    """

    dtype: str
    source: str
    detail: str | None = None

    def describe(self) -> str:
        text = f"{self.dtype} ({self.source}"
        return text + (f": {self.detail})" if self.detail else ")")


class SiteCode(str, enum.Enum):
    """Why an integration site is not selected (``Site.site_error``, with its ``code``)."""

    #: the machine rejected it (the trace's own code says which check)
    REJECTED = "rejected"
    #: its attention call could not be classified, in a strict component
    UNCLASSIFIED = "unclassified"
    # (a stand-in its route cannot run is the machine's ``not_on_route``: the
    # site's spec carries its route as ``LayerSpec.exact_route``)


class RouteKind(str, enum.Enum):
    """How a site's kernel is put in place (issue 30): code dispatches on this,
    never on the route's words (``Site.route`` is for people)."""

    #: the generic route: the site's own SDPA calls run the kernel decided per
    #: call signature
    INTERCEPT = "intercept"
    #: transformers' attention interface: the config names the function it runs
    INTERFACE = "interface"
    #: the site runs one kernel its code names (a host's dispatcher pinned to a
    #: backend, a kernel its code calls, torch's own MultiheadAttention path)
    PIN = "pin"
    #: the site's own code, untouched (not softmax attention, softmax attention
    #: written by hand -- issue 30: no kernel is offered there --, or nothing routes it)
    OWN_CODE = "own code"


@frozen
class SiteError:
    """A site's error: a code (:class:`SiteCode`, or the machine's check code for
    a rejection) and the message, as everywhere else in attnres."""

    code: str
    message: str

    def __str__(self) -> str:
        return self.message


@frozen
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
    (``softmax=False``) is not softmax attention.
    """

    component: str
    name: str
    module_class: str
    route: str
    supported: frozenset[Backend] | None
    head_size: int | None
    heads: int | None
    kv_heads: int | None
    dtype: str
    role: Role = Role.SELF
    requirements: Requirements = field(factory=Requirements)
    current: Backend | None = None
    why: str | None = None
    pending: bool = False
    softmax: bool = True
    #: how its kernel is put in place (its route's kind: dispatch on this)
    kind: RouteKind = field(kw_only=True)
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

    @property
    def routed(self) -> bool:
        """Whether the generic route serves it (:attr:`RouteKind.INTERCEPT`)."""
        return self.kind is RouteKind.INTERCEPT

    @property
    def classified(self) -> bool:
        return self.why is None and not self.pending and self.head_size is not None


@frozen
class Site:
    """One attention site and its outcome (``resolution`` or ``error``)."""

    component: str
    name: str
    module_class: str
    route: str
    heads: int | None
    kv_heads: int | None
    spec: LayerSpec | None
    resolution: Resolution | None
    site_error: SiteError | None
    trace: Trace | None = field(eq=False, repr=False)
    note: str | None = None
    current: Backend | None = None
    pending: bool = False
    kind: RouteKind = field(kw_only=True)

    def __attrs_post_init__(self) -> None:
        # one outcome: a site's status is its trace's (never a trace that says
        # selected under a rejected site, or the other way round)
        if self.trace is not None and self.trace.outcome.status != self.status:
            raise ValueError(
                f"site {self.name!r} is {self.status.value} but its trace says "
                f"{self.trace.outcome.status}"
            )

    @property
    def routed(self) -> bool:
        """Whether the generic route serves it (:attr:`RouteKind.INTERCEPT`)."""
        return self.kind is RouteKind.INTERCEPT

    @property
    def by_hand(self) -> bool:
        """Softmax attention its code computes by hand: its own code runs it, untouched
        (issue 30; its own code path is ``eager``)."""
        own = self.kind is RouteKind.OWN_CODE
        return own and self.current is not None and self.current.name == "eager"

    @property
    def error(self) -> str | None:
        return None if self.site_error is None else self.site_error.message

    @property
    def status(self) -> Status:
        if self.resolution is not None:
            return Status.SELECTED
        if self.site_error is not None:
            return Status.REJECTED
        return Status.PENDING if self.pending else Status.UNGOVERNED

    @property
    def backend(self) -> Backend | None:
        return None if self.resolution is None else self.resolution.backend

    def to_dict(self) -> dict[str, Any]:
        res = self.resolution
        return {
            "name": self.name,
            "class": self.module_class,
            "route": self.route,
            "status": self.status.value,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_size": None if self.spec is None else self.spec.head_size,
            "dtype": None if self.spec is None else self.spec.dtype,
            "backend": None if self.backend is None else self.backend.name,
            "reason": None if res is None or res.reason is None else res.reason.value,
            "origin": (
                res.origin.value
                if res is not None
                else (self.trace.outcome.origin.value if self.trace is not None else None)
            ),
            "error": self.error,
            "code": None if self.site_error is None else self.site_error.code,
            "note": self.note,
            "digest": None if self.trace is None else self.trace.digest,
        }


@frozen
class ComponentInfo:
    """A component of the plan: its kind, policy and dtype, and any problem."""

    name: str
    kind: str
    loader: str
    allow_global_fallback: bool
    dtype: DtypeChoice | None = None
    error: str | None = None


@frozen
class Problem:
    """An installed decision that no longer holds (what :func:`verify` reports)."""

    component: str
    name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.component}/{self.name}: {self.problem}"


@frozen
class IntegrationPlan:
    """Every site of every component, resolved; what ``plan`` and ``apply`` return."""

    title: str
    source: str
    config: SelectionConfig
    platform: Platform
    components: tuple[ComponentInfo, ...]
    sites: tuple[Site, ...]
    #: issue 20: components of a model folder that are not models (tokenizers,
    #: schedulers, absent optional parts), as (name, why); ``plan DIR`` says so
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> tuple[str, ...]:
        out = [f"{c.name}: {c.error}" for c in self.components if c.error]
        out += [f"{s.component}/{s.name}: {s.error}" for s in self.sites if s.error]
        return tuple(out)

    def by_component(self) -> dict[str, list[Site]]:
        """Component name -> its sites, in module order (components in plan order)."""
        out: dict[str, list[Site]] = {c.name: [] for c in self.components}
        for site in self.sites:
            out.setdefault(site.component, []).append(site)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``attnres plan --json`` prints it: one schema for a pipeline
        file, a folder and a live pipeline (``PlanResult.to_dict``)."""
        return self.to_plan_result().to_dict()

    def to_plan_result(self) -> PlanResult:
        """The same plan as an :class:`attnres.plan.PlanResult` (rows of like sites):
        the one plan model ``attnres plan`` renders, serialises and writes."""
        entries: list[ComponentEntry] = []
        planned: list[ComponentPlan] = []
        groups = self.by_component()
        for comp in self.components:
            layer_entries = []
            layer_plans = []
            unplanned = []
            for pattern, sites in _group_rows(groups[comp.name]):
                first = sites[0]
                if first.trace is None:  # no resolution at plan time
                    unplanned += [
                        UnplannedSite(
                            name=s.name,
                            module_class=s.module_class,
                            route=s.route,
                            status=s.status,
                            note=s.note,
                            error=s.error,
                            code=None if s.site_error is None else s.site_error.code,
                        )
                        for s in sites
                    ]
                    continue
                assert first.spec is not None
                layer_entries.append(LayerEntry(pattern, len(sites), first.spec))
                res = first.resolution
                layer_plans.append(
                    LayerPlan(
                        component=comp.name,
                        name=pattern,
                        count=len(sites),
                        outcome=(
                            res.outcome
                            if res is not None
                            else Outcome(
                                Status.REJECTED,
                                first.trace.outcome.origin,
                                code=first.trace.outcome.code,
                                error=first.error,
                            )
                        ),
                        trace=first.trace,
                        sites=tuple(s.name for s in sites),
                        route=first.route,
                        heads=first.heads,
                        kv_heads=first.kv_heads,
                    )
                )
            entries.append(
                ComponentEntry(comp.name, comp.kind, None, (), None, tuple(layer_entries))
            )
            error = comp.error
            planned.append(
                ComponentPlan(
                    name=comp.name,
                    kind=comp.kind,
                    loader=comp.loader,
                    allow_global_fallback=comp.allow_global_fallback,
                    layers=tuple(layer_plans),
                    error=error,
                    dtype=None if comp.dtype is None else comp.dtype.dtype,
                    dtype_source=None if comp.dtype is None else comp.dtype.source,
                    dtype_detail=None if comp.dtype is None else comp.dtype.detail,
                    unplanned=tuple(unplanned),
                )
            )
        pipeline = Pipeline(self.title, self.source, tuple(entries))
        return PlanResult(
            pipeline, self.platform, self.config, tuple(planned), skipped=self.skipped
        )

    def render(self) -> str:
        """The same table as ``attnres plan``, plus each component's dtype and source."""
        return "\n".join(render_plan(self.to_plan_result()))

    def dump_traces(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write one replayable trace per row of like sites, and the folder's
        manifest (as ``attnres plan --trace-out``); returns the files written."""
        return list(
            write_plan_traces(
                self.to_plan_result(), directory, written_by=f"attnres plan {self.source}"
            )
        )


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _group_rows(sites: Sequence[Site]) -> list[tuple[str, list[Site]]]:
    """Like sites (same pattern, spec and outcome) share one row, in module order."""
    rows: dict[tuple[Any, ...], tuple[str, list[Site]]] = {}
    for site in sites:
        pattern = _INDEX.sub("*", site.name)
        spec = None if site.spec is None else attrs.evolve(site.spec, name=None)
        res = site.resolution
        key = (
            pattern,
            spec,
            site.status,
            None if res is None else (res.backend, res.reason, res.origin),
            None if site.error is None else _INDEX.sub("*", site.error.replace(site.name, "")),
        )
        if key not in rows:
            rows[key] = (pattern, [])
        rows[key][1].append(site)
    return list(rows.values())


# =============================================================================
# Resolving described sites
# =============================================================================


def plan_sites(
    *,
    title: str,
    source: str,
    components: Iterable[tuple[str, DtypeChoice | None, Sequence[SiteDescription]]],
    config: SelectionConfig | None,
    platform: Platform | None,
) -> IntegrationPlan:
    """Resolve every described site inside its component's scope.

    A component that may fall back from the global flag gets each site's
    current backend as the site's declared default; a strict one never does
    (a declared default would relax the operator's flag, SPEC 3.2). A site that
    cannot be classified is an error in a strict component and a recorded
    note in one that may fall back: it keeps running its own code path.
    """
    cfg = selection_config() if config is None else config
    plat = Platform.detect() if platform is None else platform
    infos: list[ComponentInfo] = []
    sites: list[Site] = []
    for comp, dtype, described in components:
        state = scope_state(comp)
        relaxed = state.allow_global_fallback
        first = len(sites)
        with component_scope(comp):
            for desc in described:
                sites.append(_plan_one(desc, relaxed, cfg, plat))
        # a command-line role override that reaches none of its sites is an
        # error, as for a pipeline file (and apply refuses it)
        error = unreached_role_override(
            comp, [s for s in sites[first:] if s.trace is not None], cfg
        )
        infos.append(ComponentInfo(comp, state.kind, state.loader, relaxed, dtype, error))
    return IntegrationPlan(title, source, cfg, plat, tuple(infos), tuple(sites))


def _plan_one(
    desc: SiteDescription, relaxed: bool, config: SelectionConfig, platform: Platform
) -> Site:
    common: dict[str, Any] = {
        "component": desc.component,
        "name": desc.name,
        "module_class": desc.module_class,
        "route": desc.route,
        "heads": desc.heads,
        "kv_heads": desc.kv_heads,
        "current": desc.current,
        "kind": desc.kind,
    }
    if desc.pending:
        return Site(
            **common,
            spec=None,
            resolution=None,
            site_error=None,
            trace=None,
            pending=True,
            note="decided at first call: "
            + (
                desc.why
                or "its head facts are read from the query, key and value of its first call"
            ),
        )
    if not desc.softmax:
        return Site(
            **common,
            spec=None,
            resolution=None,
            site_error=None,
            trace=None,
            note=f"not softmax attention, left on its own code path: {desc.why}",
        )
    if not desc.classified:
        why = desc.why or "its attention call cannot be classified"
        if relaxed:
            return Site(
                **common,
                spec=None,
                resolution=None,
                site_error=None,
                trace=None,
                note=f"unclassified, left on its own code path: {why}",
            )
        return Site(
            **common,
            spec=None,
            resolution=None,
            trace=None,
            site_error=SiteError(
                SiteCode.UNCLASSIFIED.value,
                (
                    f"attention site {desc.name!r} ({desc.module_class}) of strict component "
                    f"{desc.component!r} cannot be classified: {why}; attnres cannot make it run "
                    f"the requested backend. Run a dry run (attnres.integrations.diffusers."
                    f"find_sdpa_calls) to see what it calls, or plan that component with an "
                    f"explicit per-component backend"
                ),
            ),
        )
    assert desc.head_size is not None
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
            # add_bias_kv names the fact that keeps it on its own code path)
            # issue 19: a class that keeps its sites to transformers' own functions
            # says so, with the flag its code sets
            only = f"; {desc.host_kernel} only" if desc.host_kernel is not None else ""
            message += f" (the site's route: {spec.exact_route}{only})"
        return Site(
            **common,
            spec=spec,
            resolution=None,
            trace=exc.trace,
            site_error=SiteError(str(exc.code), message),
        )
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
        return Site(
            **common,
            spec=spec,
            resolution=None,
            site_error=None,
            trace=None,
            note=f"nothing requested, left on its own code path ({desc.current.name}): "
            f"automatic selection would move it to {res.backend.name} ({failed}), which "
            f"changes its output; request a backend to move it",
        )
    _check_options(desc, spec, res, platform)
    return Site(**common, spec=spec, resolution=res, site_error=None, trace=res.trace)


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


def _release(version: str) -> tuple[int, ...]:
    """The release numbers a version string starts with (``5.24.0.dev0`` -> 5, 24, 0)."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in found.group(0).split(".")) if found else ()


def check_version(module: Any) -> None:
    """Refuse, typed, the library ``module`` (the package an integration imported)
    at a version outside :data:`SUPPORTED_VERSIONS` (its ``__version__``): its
    code is not what attnres's routes were written against, and a route that
    half-works changes outputs silently
    (transformers 4.x: no flag moved Gemma 2 from sdpa to eager)."""
    package = module.__name__
    low, high = SUPPORTED_VERSIONS[package]
    installed = str(getattr(module, "__version__", "unknown"))
    release = _release(installed)
    if release and _release(low) <= release < _release(high):
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


def refuse_to_apply(result: IntegrationPlan) -> None:
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


def emit_installed(result: IntegrationPlan) -> None:
    """Record the installed plan's site decisions as their current ledger entries
    (one per site: applying again replaces them) and log one ``attention backend
    installed`` audit event per installed site."""
    set_decisions(
        Decision(site.component, site.name, site.trace.outcome, site.trace)
        for site in result.sites
        if site.trace is not None
    )
    log = _audit._logger(logging.INFO)
    if log is None:
        return
    for site in result.sites:
        res = site.resolution
        if res is None or site.trace is None:
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
