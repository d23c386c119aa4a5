"""Pipeline files -> plans: which backend every layer of every component runs.

A pipeline file (TOML, SPEC 6) lists a pipeline's components and their
attention layers. :func:`load_pipeline` reads and validates one strictly (every
mistake is a :class:`PipelineError` naming the file, the component and the
layer); :func:`plan_pipeline` resolves every layer the way a runtime would --
inside its component's :func:`~attnres.runtime.component_scope`, through
:func:`~attnres.runtime.resolve` -- and reports every layer, rejected or not.

No selection rule lives here: the machine decides, this module only builds its
inputs from the file and collects its outcomes.

Decisions (documented in ``docs/cli.md``):

- Identical layers are declared once with ``count``; each entry is resolved
  once and its count reported.
- Component overrides keep the library's default ``require_selection`` (on for
  an explicit ``backend`` or ``role_backends``), so a plan predicts what the
  runtime would do on scope exit: an override that controls none of its
  component's layers (a ``role_backends`` entry for a role the component has no
  layer of, say) is reported as that component's ``error`` and makes the plan
  ``rejected`` -- it is never raised. When a layer of the component was
  rejected, the rejection already says why the override did not apply, and the
  component error is not repeated.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from attrs import field, frozen

from attnres._codec import (
    CHECKS,
    closest_key,
    field_names,
    field_types,
    is_int,
    located,
    missing_keys,
    required_field_names,
    unknown_keys,
)
from attnres._files import read_bounded, write_manifest
from attnres._outcome import OutcomeView
from attnres._precision_view import describe_precision, precision_of_trace
from attnres._states import (
    Code,
    KernelSource,
    PlanStatus,
    RouteKind,
    SiteCode,
    Status,
    to_site_code,
)
from attnres._varlen import check_layer_options
from attnres._vocab import Role, normalize_component
from attnres.backends import Backend, BackendOptions, lookup_spec, merge_backend_options
from attnres.errors import (  # PipelineError: attnres.errors holds every exception
    BackendNotAppliedError,
    InvalidArgumentError,
    PipelineError,
    ResolutionError,
    TraceWriteError,
)
from attnres.explain import explain
from attnres.kernels import kernel_source
from attnres.layer import (
    ErrorBudget,
    LayerSpec,
    Requirements,
    SelectionConfig,
    parse_error_budget,
    split_component_key,
)
from attnres.layout import LAYOUT_KINDS, SequenceLayout
from attnres.platform import Platform
from attnres.render import (
    _field,
    _opt,
    _platform_text,
    _plural,
    _table,
    _width,
    _wrap,
    request_text,
)
from attnres.runtime import Resolution, component_scope, resolve, selection_config
from attnres.scope import component_kind, loader_for
from attnres.trace import Outcome, Trace, dump_trace

__all__ = [
    "ComponentEntry",
    "ComponentPlan",
    "DtypeChoice",
    "LayerEntry",
    "LayerPlan",
    "Pipeline",
    "PipelineError",
    "PlanResult",
    "Site",
    "SiteError",
    "load_pipeline",
    "parse_pipeline",
    "plan_pipeline",
    "render_plan",
    "trace_file_name",
]

_TOP_KEYS = ("pipeline", "components")
_PIPELINE_KEYS = ("name", "description")
#: A layer entry: the LayerSpec's fields (``requirements`` is spelled ``requires``
#: in the file), plus ``count`` and the per-layer ``backend``.
_TOML_NAMES = {"requirements": "requires"}
#: issue 23: optional LayerSpec fields a layer entry may give (exact_route is a
#: trace-only field: an integration sets it, never a file)
_FILE_OPTIONAL = ("preferred", "required", "backend_options")
_LAYER_KEYS = (
    "name",
    "count",
    *(_TOML_NAMES.get(n, n) for n in field_names(LayerSpec) if n != "name"),
    # issue 23: the optional LayerSpec fields a pipeline file may give
    *_FILE_OPTIONAL,
    "backend",
)
#: what TOML value each LayerSpec field's type is written as (its converter
#: parses the text: a backend or role by name, requirements by name)
_TOML_KIND_OF_TYPE: dict[Any, str] = {
    int: "integer",
    str: "string",
    Role: "string",
    Backend: "string",
    frozenset[Backend]: "array of strings",
    Requirements: "array of strings",
    BackendOptions: "table",  # issue 23: { fa = { deterministic = true } }
}
#: the kind of every key of a layer entry but its name (checked on its own,
#: it names the layer in every message): LayerSpec's fields, by their types
_LAYER_KINDS: dict[str, str] = {
    "count": "integer",
    **{
        _TOML_NAMES.get(n, n): _TOML_KIND_OF_TYPE[tp]
        for n, tp in field_types(LayerSpec).items()
        if n != "name" and (n in field_names(LayerSpec) or n in _FILE_OPTIONAL)
        # not a trace-only field (exact_route; issue 24: the layout)
    },
    "backend": "string",
}
#: a layer entry must give the LayerSpec fields that have no default
_LAYER_REQUIRED = tuple(_TOML_NAMES.get(n, n) for n in required_field_names(LayerSpec))


# =============================================================================
# The pipeline, as read from its file
# =============================================================================


@frozen
class LayerEntry:
    """One ``[[components.layers]]`` entry: ``count`` identical layers."""

    name: str
    count: int
    spec: LayerSpec
    backend: Backend | None = None


@frozen
class ComponentEntry:
    """One ``[[components]]`` entry."""

    name: str
    kind: str | None
    backend: Backend | None
    role_backends: tuple[tuple[Role, Backend], ...]
    allow_global_fallback: bool | None
    layers: tuple[LayerEntry, ...]
    #: issue 34: ``attention_error = "exact"`` or ``2e-2`` in the file (``None``: none)
    attention_error: ErrorBudget | None = None

    @property
    def resolved_kind(self) -> str:
        """The kind given in the file, else the one inferred from the name."""
        return self.kind if self.kind is not None else component_kind(self.name)


#: A component entry's keys: its fields (issue 34: ``attention_error`` too)
_COMPONENT_KEYS = field_names(ComponentEntry)


@frozen
class Pipeline:
    """A validated pipeline file."""

    name: str
    path: str
    components: tuple[ComponentEntry, ...]
    description: str | None = None

    @property
    def layer_count(self) -> int:
        return sum(layer.count for c in self.components for layer in c.layers)


# =============================================================================
# Reading and validation
# =============================================================================


def load_pipeline(path: str | os.PathLike[str]) -> Pipeline:
    """Read and validate a pipeline file; any problem is a :class:`PipelineError`."""
    source = os.fspath(path)
    try:
        raw = read_bounded(source, what="pipeline file")
    except IsADirectoryError:
        raise PipelineError(f"{source}: is a directory, not a pipeline file", path=source) from None
    except OSError as exc:
        raise PipelineError(
            f"{source}: cannot read pipeline file: {exc.strerror or exc}", path=source
        ) from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raise PipelineError(
            f"{source}:1: the file starts with a UTF-8 byte-order mark (BOM), which TOML "
            f"does not allow; save it as UTF-8 without a BOM",
            path=source,
            line=1,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PipelineError(
            f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})", path=source
        ) from None
    try:
        doc: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        line = getattr(exc, "lineno", None)
        if line is None:
            m = re.search(r"\(at line (\d+), column (\d+)\)", message)
            line = int(m.group(1)) if m else None
        where = f"{source}:{line}" if line is not None else source
        raise PipelineError(f"{where}: invalid TOML: {message}", path=source, line=line) from None
    except RecursionError:
        raise PipelineError(
            f"{source}: not a pipeline: TOML nested too deeply (arrays or inline tables "
            f"inside one another hundreds of levels deep)",
            path=source,
        ) from None
    except ValueError as exc:
        # tomllib lets int() refuse a number of more than 4300 digits with a bare
        # ValueError that names neither the file nor the line: find the line
        m = re.search(r"[0-9][0-9_]{4000,}", text)
        line = text.count("\n", 0, m.start()) + 1 if m else None
        where = f"{source}:{line}" if line is not None else source
        digits = sum(c.isdigit() for c in m.group(0)) if m else None
        size = f"of {digits} digits " if digits else ""
        raise PipelineError(
            f"{where}: invalid TOML: a number {size}is too long to read "
            f"(at most {sys.get_int_max_str_digits()} digits)"
            if hasattr(sys, "get_int_max_str_digits")
            else f"{where}: invalid TOML: {exc}",
            path=source,
            line=line,
        ) from None
    return parse_pipeline(doc, source=source)


def parse_pipeline(doc: Mapping[str, Any], *, source: str = "<pipeline>") -> Pipeline:
    """Validate an already-parsed pipeline document (the TOML as a mapping)."""
    return _Parser(source).pipeline(doc)


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    # -- errors ---------------------------------------------------------------
    def fail(
        self,
        what: str,
        *,
        component: tuple[int, str | None] | None = None,
        layer: tuple[int, str | None] | None = None,
    ) -> PipelineError:
        where = [self.source]
        if component is not None:
            index, name = component
            where.append(
                f"component {name!r} (components[{index}])" if name else f"components[{index}]"
            )
        if layer is not None:
            index, name = layer
            where.append(f"layer {name!r} (layers[{index}])" if name else f"layers[{index}]")
        return PipelineError(
            located(*where, message=what),  # the error format of every loader (issue 21)
            path=self.source,
            component=None if component is None else component[1],
            layer=None if layer is None else layer[1],
        )

    def check_keys(
        self,
        table: Mapping[str, Any],
        allowed: tuple[str, ...],
        what: str,
        **where: Any,
    ) -> None:
        for key in unknown_keys(table, allowed)[:1]:
            close = closest_key(key, allowed)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise self.fail(
                f"unknown key {key!r} in {what}{hint}; allowed keys: {', '.join(allowed)}",
                **where,
            )

    # -- the document ---------------------------------------------------------
    def pipeline(self, doc: Mapping[str, Any]) -> Pipeline:
        if not isinstance(doc, Mapping):
            raise self.fail(f"a pipeline file must be a TOML table, got {_type(doc)}")
        self.check_keys(doc, _TOP_KEYS, "the top level")
        header = doc.get("pipeline", {})
        if not isinstance(header, Mapping):
            raise self.fail(f"[pipeline] must be a table, got {_type(header)}")
        self.check_keys(header, _PIPELINE_KEYS, "[pipeline]")
        name = header.get("name", Path(self.source).stem)
        if not isinstance(name, str) or not name.strip():
            raise self.fail(f"[pipeline] name must be a non-empty string, got {name!r}")
        description = header.get("description")
        if description is not None and not isinstance(description, str):
            raise self.fail(f"[pipeline] description must be a string, got {_type(description)}")
        components = doc.get("components")
        if components is None:
            raise self.fail(
                "no components: add at least one [[components]] table with its "
                "[[components.layers]]"
            )
        if not isinstance(components, list) or not components:
            raise self.fail(
                f"components must be a non-empty array of tables ([[components]]), got "
                f"{_type(components)}"
            )
        parsed: list[ComponentEntry] = []
        seen: set[str] = set()
        for index, table in enumerate(components):
            entry = self.component(index, table)
            if entry.name in seen:
                raise self.fail(
                    f"duplicate component name {entry.name!r}: each component appears once",
                    component=(index, entry.name),
                )
            seen.add(entry.name)
            parsed.append(entry)
        return Pipeline(
            name=name, path=self.source, components=tuple(parsed), description=description
        )

    def named(
        self, level: str, index: int, table: Any, allowed: tuple[str, ...], where: dict[str, Any]
    ) -> str:
        """The name of the table at ``level`` (``component`` or ``layer``), with its keys
        checked; ``where`` (updated) locates it in the errors."""
        where[level] = (index, None)
        if not isinstance(table, Mapping):
            raise self.fail(f"a {level} must be a table, got {_type(table)}", **where)
        raw_name = table.get("name")
        if isinstance(raw_name, str) and raw_name.strip():
            where[level] = (index, raw_name)
        self.check_keys(table, allowed, f"a {level}", **where)
        if raw_name is None:
            raise self.fail("missing required key 'name'", **where)
        if not isinstance(raw_name, str) or not raw_name.strip():
            raise self.fail(f"name must be a non-empty string, got {raw_name!r}", **where)
        return raw_name

    def component(self, index: int, table: Any) -> ComponentEntry:
        where: dict[str, Any] = {}
        name = self.named("component", index, table, _COMPONENT_KEYS, where)
        kind = table.get("kind")
        if kind is not None:
            if not isinstance(kind, str):
                raise self.fail(f"kind must be a string, got {_type(kind)}", **where)
            try:
                loader_for(kind)
            except ValueError as exc:
                raise self.fail(f"kind: {exc}", **where) from None
        backend = self.backend(table.get("backend"), "backend", where)
        role_backends = self.role_backends(table.get("role_backends"), where)
        allow = table.get("allow_global_fallback")
        if allow is not None and not isinstance(allow, bool):
            raise self.fail(f"allow_global_fallback must be true or false, got {allow!r}", **where)
        budget: ErrorBudget | None = None
        if table.get("attention_error") is not None:  # issue 34
            try:
                budget = parse_error_budget(table["attention_error"])
            except ValueError as exc:
                raise self.fail(str(exc), **where) from None
        layers_doc = table.get("layers")
        if layers_doc is None:
            raise self.fail(
                "no layers: add its attention layers as [[components.layers]] tables", **where
            )
        if not isinstance(layers_doc, list) or not layers_doc:
            raise self.fail(
                f"layers must be a non-empty array of tables ([[components.layers]]), got "
                f"{_type(layers_doc)}",
                **where,
            )
        layers: list[LayerEntry] = []
        seen: set[str] = set()
        for layer_index, layer_doc in enumerate(layers_doc):
            layer = self.layer(layer_index, layer_doc, where)
            if layer.name in seen:
                raise self.fail(
                    f"duplicate layer name {layer.name!r} in this component; declare "
                    f"identical layers once with count = N",
                    layer=(layer_index, layer.name),
                    **where,
                )
            seen.add(layer.name)
            layers.append(layer)
        return ComponentEntry(
            name=name,
            kind=kind,
            backend=backend,
            role_backends=role_backends,
            allow_global_fallback=allow,
            layers=tuple(layers),
            attention_error=budget,
        )

    def backend(self, value: Any, key: str, where: Mapping[str, Any]) -> Backend | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(f"{key} must be a backend name (string), got {_type(value)}", **where)
        try:
            return Backend.parse(value)
        except ValueError as exc:
            raise self.fail(f"{key}: {exc}", **where) from None

    def role_backends(
        self, value: Any, where: Mapping[str, Any]
    ) -> tuple[tuple[Role, Backend], ...]:
        if value is None:
            return ()
        if not isinstance(value, Mapping):
            raise self.fail(
                f'role_backends must be a table such as {{ cross = "torch_sdpa" }}, got '
                f"{_type(value)}",
                **where,
            )
        out: dict[Role, Backend] = {}
        for role_name, backend_name in value.items():
            try:
                role = Role.parse(role_name)
            except ValueError as exc:
                raise self.fail(f"role_backends: {exc}", **where) from None
            parsed = self.backend(backend_name, f"role_backends.{role_name}", where)
            assert parsed is not None
            out[role] = parsed
        return tuple(sorted(out.items(), key=lambda kv: kv[0].value))

    def layer(self, index: int, table: Any, component_where: Mapping[str, Any]) -> LayerEntry:
        where: dict[str, Any] = dict(component_where)
        name = self.named("layer", index, table, _LAYER_KEYS, where)
        for key in missing_keys(table, _LAYER_REQUIRED)[:1]:
            raise self.fail(f"missing required key {key!r}", **where)
        count = table.get("count", 1)
        if not is_int(count) or count < 1:
            raise self.fail(f"count must be a positive integer, got {count!r}", **where)
        for key, kind in _LAYER_KINDS.items():
            if key in table and not CHECKS[kind](table[key]):
                article = "an" if kind[0] in "aeiou" else "a"
                raise self.fail(f"{key} must be {article} {kind}, got {_type(table[key])}", **where)
        try:
            spec = LayerSpec(
                head_size=table["head_size"],
                dtype=table["dtype"],
                supported=table.get("supported"),
                default=table.get("default"),
                role=table.get("role", "self"),
                requirements=Requirements.of(table.get("requires", ()), field="requires"),
                name=name,
                preferred=table.get("preferred"),  # issue 23
                required=table.get("required"),
                # issue 23: checked by the one option checker (BackendOptionError)
                backend_options=table.get("backend_options"),
            )
        except ValueError as exc:
            raise self.fail(str(exc), **where) from None
        backend = self.backend(table.get("backend"), "backend", where)
        return LayerEntry(name=name, count=count, spec=spec, backend=backend)


def _type(value: Any) -> str:
    names = {
        str: "a string",
        int: "an integer",
        float: "a float",
        bool: "a boolean",
        list: "an array",
        dict: "a table",
    }
    for cls, text in names.items():
        if type(value) is cls:
            return f"{text} ({value!r})" if cls in (str, int, float, bool) else text
    return type(value).__name__


# =============================================================================
# Planning
# =============================================================================


@frozen
class LayerPlan(OutcomeView):
    """The outcome for one layer entry (``count`` identical layers)."""

    component: str
    name: str
    count: int
    #: how the layer's resolution ended for the plan (usually the trace's own
    #: outcome; a route that cannot run the choice rejects it with its error);
    #: ``status``, ``backend``, ``reason``, ``origin``, ``error`` and ``code``
    #: read through to it
    outcome: Outcome
    trace: Trace
    #: for a selected layer, whether a kernel serves its backend in this install
    #: (``none``: the plan holds, but running it needs a kernel registered first,
    #: e.g. a sparse backend an operator supplies by plugin); ``None`` if rejected
    kernel: KernelSource | None = None
    #: a live or folder plan: the module paths of the sites this row stands for
    #: (a pipeline file declares layers, not sites: empty)
    sites: tuple[str, ...] = ()
    #: a live or folder plan: what executes the row's sites (``None`` for a file)
    route: str | None = None
    #: a live or folder plan: the heads and kv heads read from the module
    heads: int | None = None
    kv_heads: int | None = None

    @property
    def needs_kernel(self) -> bool:
        """Selected, but this install has no kernel to run it."""
        return self.kernel is KernelSource.NONE

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "count": self.count,
            "status": self.status,
            "backend": None if self.backend is None else self.backend.name,  # a JSON string
            "reason": self.reason,
            "origin": self.origin,
            "error": self.error,
            "code": self.code,
            "kernel": None if self.kernel is None else self.kernel.value,
            "digest": self.trace.digest,
            "head_size": self.trace.input.layer.head_size,
            "dtype": self.trace.input.layer.dtype,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "route": self.route,
            "sites": list(self.sites),
            # issue 23: the typed kernel options the layer was planned with
            "backend_options": {
                backend: dict(pairs) for backend, pairs in self.trace.input.layer.backend_options
            },
            **self._precision(),
        }

    def _precision(self) -> dict[str, Any]:
        """Issue 34: ``precision`` (exact or lossy, how, the budget, any measurement),
        only for a layer with an error budget (a plan without one keeps its keys)."""
        record = precision_of_trace(self.trace)
        if record is None:
            return {}
        m = record.measured
        return {
            "precision": {
                "kind": record.precision,
                "how": record.how,
                "budget": record.budget,
                "budget_key": record.budget_key,
                "measured": None
                if m is None
                else {
                    "rel_l2": m.rel_l2,
                    "max_abs": m.max_abs,
                    "cosine": m.cosine,
                    "call": m.call,
                    "emulated": m.emulated,
                    "source": m.source,
                },
            }
        }


@frozen
class DtypeChoice:
    """The dtype a component of a live or folder plan is planned for, and where it
    came from.

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


@frozen
class SiteError:
    """Why a site of a live or folder plan is rejected: its code (the machine's
    :class:`~attnres.Code`, or :class:`~attnres._states.SiteCode`) and the message,
    as everywhere else in attnres."""

    code: Code | SiteCode = field(converter=to_site_code)
    message: str

    def __str__(self) -> str:
        return self.message


@frozen
class Site:
    """One attention site of a live or folder plan and its outcome: ``resolution``
    (selected), ``error`` (rejected), or neither (``pending``, or left on its own
    code path with the reason in ``note``)."""

    component: str
    name: str
    module_class: str
    route: str
    heads: int | None
    kv_heads: int | None
    spec: LayerSpec | None
    resolution: Resolution | None
    error: SiteError | None
    trace: Trace | None = field(eq=False, repr=False)
    note: str | None = None
    current: Backend | None = None
    pending: bool = False
    kind: RouteKind = field(kw_only=True)

    def __attrs_post_init__(self) -> None:
        # one outcome: a site's status is its trace's (never a trace that says
        # selected under a rejected site, or the other way round)
        if self.trace is not None and self.trace.outcome.status != self.status:
            raise InvalidArgumentError(
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
    def status(self) -> Status:
        if self.resolution is not None:
            return Status.SELECTED
        if self.error is not None:
            return Status.REJECTED
        return Status.PENDING if self.pending else Status.UNGOVERNED

    @property
    def backend(self) -> Backend | None:
        return None if self.resolution is None else self.resolution.backend

    def to_dict(self) -> dict[str, Any]:
        """A site with no resolution at plan time, as ``plan --json`` lists it
        (a component's ``unplanned``; a resolved site is in its row)."""
        return {
            "name": self.name,
            "class": self.module_class,
            "route": self.route,
            "status": self.status.value,
            "note": self.note,
            "error": None if self.error is None else self.error.message,
            "code": None if self.error is None else self.error.code.value,
        }


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def like_sites(sites: Sequence[Site]) -> list[tuple[str, list[Site]]]:
    """Like sites (same pattern, spec and outcome) share one row, in module order:
    ``(pattern, sites)``, ``transformer_blocks.*.attn`` for the numbered ones."""
    rows: dict[tuple[Any, ...], tuple[str, list[Site]]] = {}
    for site in sites:
        pattern = _INDEX.sub("*", site.name)
        spec = None if site.spec is None else attrs.evolve(site.spec, name=None)
        res = site.resolution
        error = site.error
        key = (
            pattern,
            spec,
            site.status,
            None if res is None else (res.backend, res.reason, res.origin),
            None if error is None else _INDEX.sub("*", error.message.replace(site.name, "")),
        )
        if key not in rows:
            rows[key] = (pattern, [])
        rows[key][1].append(site)
    return list(rows.values())


@frozen
class ComponentPlan:
    """The outcomes for one component, and any problem with its overrides."""

    name: str
    kind: str
    loader: str
    allow_global_fallback: bool
    layers: tuple[LayerPlan, ...]
    error: str | None = None
    #: a live or folder plan: the dtype it was planned for and where it came from
    dtype: DtypeChoice | None = None
    #: a live or folder plan: every site, in module order (``layers`` holds the
    #: resolved ones as rows of like sites)
    sites: tuple[Site, ...] = ()

    @property
    def unplanned(self) -> tuple[Site, ...]:
        """A live or folder plan's sites with no resolution at plan time (no trace),
        in the order of their rows."""
        return tuple(s for _, like in like_sites(self.sites) for s in like if s.trace is None)

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and all(layer.status is Status.SELECTED for layer in self.layers)
            and all(site.error is None for site in self.sites)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "status": "ok" if self.ok else "rejected",
            "error": self.error,
            "dtype": None if self.dtype is None else self.dtype.dtype,
            "dtype_source": None if self.dtype is None else self.dtype.source,
            "layers": [layer.to_dict() for layer in self.layers],
            "unplanned": [u.to_dict() for u in self.unplanned],
        }


@frozen
class PlanResult:
    """Every component's plan, with the inputs it was made for."""

    pipeline: Pipeline
    platform: Platform
    config: SelectionConfig
    components: tuple[ComponentPlan, ...]
    #: a folder plan: entries that are not models (tokenizers, schedulers), as
    #: (name, why); planned by nobody, and said so (issue 20)
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.components)

    @property
    def status(self) -> PlanStatus:
        return PlanStatus.OK if self.ok else PlanStatus.REJECTED

    @property
    def layers(self) -> tuple[LayerPlan, ...]:
        return tuple(layer for c in self.components for layer in c.layers)

    @property
    def sites(self) -> tuple[Site, ...]:
        """A live or folder plan: every site of every component (a file's: none)."""
        return tuple(site for c in self.components for site in c.sites)

    def by_component(self) -> dict[str, list[Site]]:
        """A live or folder plan: component name -> its sites, in module order."""
        return {c.name: list(c.sites) for c in self.components}

    @property
    def errors(self) -> tuple[str, ...]:
        """Every problem, one line each: each component's, then each rejected site
        (a live or folder plan) or rejected layer (a pipeline file)."""
        out = [f"{c.name}: {c.error}" for c in self.components if c.error]
        out += [f"{s.component}/{s.name}: {s.error}" for s in self.sites if s.error]
        return tuple(
            out
            + [
                f"{la.component}/{la.name}: {la.error}"
                for la in self.layers
                if not la.sites and la.status is not Status.SELECTED
            ]
        )

    def render(self) -> str:
        """The plan as ``attnres plan`` prints it (:func:`render_plan`)."""
        return "\n".join(render_plan(self))

    def dump_traces(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write one replayable trace per row, and the folder's manifest (as
        ``attnres plan --trace-out``); returns the files written."""
        return list(
            write_plan_traces(self, directory, written_by=f"attnres plan {self.pipeline.path}")
        )

    def to_dict(self) -> dict[str, Any]:
        config = self.config
        return {
            "status": self.status,
            "pipeline": self.pipeline.name,
            "file": self.pipeline.path,
            "platform": self.platform.describe(),
            "simulated": self.platform.simulated,
            "attention_backend": (
                None if config.global_backend is None else config.global_backend.name
            ),
            "attention_backend_explicit": (
                None if config.global_backend is None else config.global_backend_explicit
            ),
            "components": [c.to_dict() for c in self.components],
            "skipped": [{"name": name, "why": why} for name, why in self.skipped],
        }


def render_plan(result: PlanResult) -> list[str]:
    """A :class:`~attnres.plan.PlanResult` as ``attnres plan`` shows it."""
    width = _width()
    pipeline, config = result.pipeline, result.config
    lines = _wrap(f"Plan for pipeline {pipeline.name!r} ({pipeline.path})", width, "", "  ")
    lines += _field("Platform:", _platform_text(result.platform), width)
    request = request_text(config, "a preference", "--attention-backend ")
    lines += _field("Request:", request, width)
    dtypes = [f"{c.name} {c.dtype.describe()}" for c in result.components if c.dtype is not None]
    if dtypes:
        lines += _field("Dtypes:", "; ".join(dtypes), width)
    if result.skipped:  # issue 20: a folder's entries that are not models, said so
        listed = "; ".join(f"{name} ({why})" for name, why in result.skipped)
        lines += _field("Skipped:", listed, width)
    fallbacks: dict[str, int] = {}
    for component in result.components:
        entry = next(c for c in pipeline.components if c.name == component.name)
        policy = (
            "may fall back from the global flag"
            if component.allow_global_fallback
            else "the global flag is strict here"
        )
        extras = []
        if entry.backend is not None:
            extras.append(f"override {entry.backend.name}")
        for role, backend in entry.role_backends:
            extras.append(f"{role.value}-attention override {backend.name}")
        header = f"{component.name}  [{component.kind}, {component.loader}: {policy}"
        header += "".join(f"; {e}" for e in extras) + "]"
        lines.append("")
        lines += _wrap(header, width, "", "  ")
        rows = []
        for layer in component.layers:
            if layer.status is Status.SELECTED:
                detail = _opt(layer.reason)
                if layer.reason:
                    fallbacks[layer.reason] = fallbacks.get(layer.reason, 0) + layer.count
                    why = explain(layer.trace).fallback_failures
                    if why:
                        detail += f" ({why})"
            else:
                detail = str(layer.error)
            if layer.needs_kernel:
                missing = f"no kernel for {layer.backend} in this install (register one to run)"
                detail = missing if detail == "-" else f"{detail}; {missing}"
            precision = describe_precision(layer.trace)  # issue 34: only under a budget
            if precision and layer.status is Status.SELECTED:
                detail = precision if detail == "-" else f"{detail}; {precision}"
            rows.append(
                [
                    layer.name,
                    str(layer.count),
                    layer.backend.name if layer.backend else "REJECTED",
                    layer.origin,
                    detail,
                ]
            )
        if rows:
            lines += _table(
                ["layer", "count", "backend", "origin", "reason / error"],
                rows,
                width=width,
                wrap=[4, 0],
                right=[1],
                min_width=28,
                ordered=True,
            )
        elif not component.unplanned:  # an empty table says less than one line
            lines.append("  (no attention sites)")
        for site in component.unplanned:
            label = _UNPLANNED_LABEL[site.status]
            text = site.note if site.error is None else site.error.message
            lines += _wrap(
                f"{site.name} ({site.module_class}): {text}", width, f"  {label}: ", "    "
            )
        if component.error:
            lines += _wrap(component.error, width, "  problem: ", "           ")
    lines.append("")
    layers = result.layers
    total = sum(layer.count for layer in layers)
    scope = (
        f"{_plural(total, 'layer')} ({len(layers)} distinct) in "
        f"{_plural(len(result.components), 'component')}"
    )
    # issue 32 item 8: sites decided at their first call (softmax by hand in a plain
    # module, a class that holds no head facts) are counted, not read as "0 layers"
    pending = sum(1 for c in result.components for u in c.unplanned if u.status is Status.PENDING)
    if pending:
        scope += f", {_plural(pending, 'site')} decided at first call"
    if result.ok:
        fell = (
            "fallbacks: "
            + ", ".join(f"{r} ({_plural(n, 'layer')})" for r, n in sorted(fallbacks.items()))
            if fallbacks
            else "no fallback"
        )
        verdict = f"Verdict: ok - {scope}; {fell}"
        lacking = [la for la in layers if la.needs_kernel]
        if lacking:
            names = sorted({str(la.backend) for la in lacking})
            verdict += (
                f"; {_plural(sum(la.count for la in lacking), 'layer')} need a kernel this "
                f"install lacks ({', '.join(names)})"
            )
    else:
        rejected = [la for la in layers if la.status is not Status.SELECTED]
        problems = [c.name for c in result.components if c.error]
        unclassified = [
            f"{c.name}/{u.name}"
            for c in result.components
            for u in c.unplanned
            if u.status is Status.REJECTED
        ]
        parts = []
        if rejected:
            count = sum(la.count for la in rejected)
            parts.append(
                f"{len(rejected)} of {len(layers)} distinct layers ({_plural(count, 'layer')}) "
                f"rejected: " + ", ".join(f"{la.component}/{la.name}" for la in rejected)
            )
        if unclassified:
            parts.append(
                f"{_plural(len(unclassified), 'site')} cannot be classified: "
                + ", ".join(unclassified)
            )
        if problems:
            parts.append(f"override not applied in {', '.join(problems)}")
        verdict = "Verdict: rejected - " + "; ".join(parts)
    lines += _wrap(verdict, width, "", "  ")
    return lines


#: how a site with no resolution at plan time is labelled under its component
_UNPLANNED_LABEL = {
    Status.PENDING: "pending",
    Status.UNGOVERNED: "ungoverned",
    Status.REJECTED: "unclassified",
}


def with_file_budgets(config: SelectionConfig, pipeline: Pipeline) -> SelectionConfig:
    """Issue 34: ``config`` with the error budgets the pipeline file gives its
    components (``attention_error = ...``); a budget given by the config itself
    (``--attention-error``) wins for its key."""
    budgets = {
        normalize_component(e.name): e.attention_error
        for e in pipeline.components
        if e.attention_error is not None
    }
    if not budgets:
        return config
    return attrs.evolve(config, attention_error={**budgets, **dict(config.attention_error)})


def plan_pipeline(
    pipeline: Pipeline,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
) -> PlanResult:
    """Resolve every layer of every component; never raises for a rejected layer.

    ``config`` defaults to the process-wide selection config, ``platform`` to
    :meth:`Platform.detect`. Each component's layers are resolved inside its
    :func:`~attnres.scope.component_scope`, once per layer entry, through
    :func:`~attnres.runtime.resolve` -- so, as for any resolution, the decisions
    are recorded in :func:`attnres.decisions` and the audit events emitted.
    """
    cfg = with_file_budgets(selection_config() if config is None else config, pipeline)
    plat = Platform.detect() if platform is None else platform
    components: list[ComponentPlan] = []
    for entry in pipeline.components:
        layers: list[LayerPlan] = []
        error: str | None = None
        kind = entry.resolved_kind
        loader = loader_for(kind)
        allow = (
            loader.allow_global_fallback
            if entry.allow_global_fallback is None
            else entry.allow_global_fallback
        )
        try:
            with component_scope(
                entry.name,
                backend=entry.backend,
                role_backends=dict(entry.role_backends) or None,
                allow_global_fallback=entry.allow_global_fallback,
                kind=kind,
            ) as scope:
                allow = scope.state.allow_global_fallback
                for layer in entry.layers:
                    layers.append(_plan_layer(entry.name, layer, cfg, plat))
        except BackendNotAppliedError as exc:
            if all(layer.status == Status.SELECTED for layer in layers):
                error = str(exc)
        if error is None:
            error = unreached_role_override(entry.name, layers, cfg)
        components.append(
            ComponentPlan(
                name=entry.name,
                kind=kind,
                loader=loader.__name__,
                allow_global_fallback=allow,
                layers=tuple(layers),
                error=error,
            )
        )
    return PlanResult(pipeline=pipeline, platform=plat, config=cfg, components=tuple(components))


def _plan_layer(
    component: str,
    layer: LayerEntry,
    config: SelectionConfig,
    platform: Platform,
) -> LayerPlan:
    spec = layer.spec
    if config.backend_options:  # issue 23: the config's options under the layer's own
        options = merge_backend_options(config.backend_options, spec.backend_options)
        spec = attrs.evolve(spec, backend_options=options)
    try:
        resolution = resolve(spec, config=config, platform=platform, backend=layer.backend)
    except ResolutionError as exc:
        trace: Trace = exc.trace
        return LayerPlan(
            component=component,
            name=layer.name,
            count=layer.count,
            outcome=trace.outcome,
            trace=trace,
        )
    # issue 23: the served backend's function on this platform takes the options
    check_layer_options(
        lookup_spec(resolution.backend),
        spec,
        platform,
        f" for layer {layer.name!r} of component {component!r}",
    )
    return LayerPlan(
        component=component,
        name=layer.name,
        count=layer.count,
        outcome=resolution.outcome,
        trace=resolution.trace,
        kernel=kernel_source(resolution.backend.name),
    )


def unreached_role_override(component: str, layers: Any, config: SelectionConfig) -> str | None:
    """The problem with a ``COMPONENT.ROLE`` override given on the command line (in
    ``config``) that reaches none of ``component``'s layers, as a role override
    in a pipeline file is (SPEC 3.6); ``None`` when every one reaches a layer.

    ``layers`` are :class:`LayerPlan` rows or integration sites (anything whose
    ``trace`` holds the layer's role).
    """
    key = normalize_component(component)
    roles = {layer.trace.input.layer.role for layer in layers}
    for name, backend in config.component_backends:
        owner, role = split_component_key(name)
        if owner != key or role is None or role in roles:
            continue
        have = ", ".join(sorted(r.value for r in roles)) or "none"
        return (
            f"--attention-backend {name}={backend.name}: component {component!r} has no "
            f"{role.value}-attention layer (its layers' roles: {have}), so the override "
            f"applies nowhere; drop it or name the component and role it is meant for"
        )
    return None


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def trace_file_name(component: str, layer: str) -> str:
    """A safe file name for one layer's trace: ``<component>__<layer>.json``."""

    def clean(text: str) -> str:
        return _UNSAFE.sub("_", text).strip("._") or "_"

    return f"{clean(component)}__{clean(layer)}.json"


def write_plan_traces(
    result: PlanResult,
    directory: str | os.PathLike[str],
    *,
    written_by: str = "attnres.plan.write_plan_traces",
) -> tuple[Path, ...]:
    """Write every planned layer's trace to ``directory``; the paths, in plan order.

    File names are :func:`trace_file_name` (``<component>__<layer>.json``), with
    ``-2``, ``-3``... when two layers would share one. Each file is written
    atomically (:func:`attnres.trace.dump_trace`). The folder's manifest marks
    the run (``written_by``) incomplete first and lists the files once all are
    written, so an interrupted run fails replay. A failure raises
    :class:`~attnres.errors.TraceWriteError` (an ``OSError``) saying which step.
    """
    folder = Path(directory)
    try:
        write_manifest(folder, written_by)
    except OSError as exc:
        raise TraceWriteError(
            f"cannot write traces into {str(folder)!r}: {exc.strerror or exc}"
        ) from None
    used: set[str] = set()
    paths: list[Path] = []
    for component in result.components:
        for layer in component.layers:
            name = trace_file_name(component.name, layer.name)
            stem, n = name[: -len(".json")], 2
            while name in used:
                name, n = f"{stem}-{n}.json", n + 1
            used.add(name)
            path = folder / name
            try:
                dump_trace(layer.trace, path)
            except OSError as exc:
                raise TraceWriteError(
                    f"cannot write trace file {str(path)!r}: {exc.strerror or exc}"
                ) from None
            paths.append(path)
    try:
        write_manifest(folder, written_by, [p.name for p in paths])
    except OSError as exc:
        raise TraceWriteError(
            f"cannot write the manifest into {str(folder)!r}: {exc.strerror or exc}"
        ) from None
    return tuple(paths)


# -- issue 24: a sequence-parallel layout for the sites that take one --------------


def with_layout(pipeline: Pipeline, layout: SequenceLayout | None) -> Pipeline:
    """``pipeline`` with ``layout`` on every layer of the components whose kind takes
    one (:data:`attnres.layout.LAYOUT_KINDS`, the denoiser); other components (VAE,
    encoders) keep no layout. A pipeline file gives no head counts, so a layout
    given here checks the log-sum-exp need of a ring, not Ulysses head division.
    """
    if layout is None:
        return pipeline
    components = tuple(
        attrs.evolve(
            entry,
            layers=tuple(
                attrs.evolve(layer, spec=attrs.evolve(layer.spec, layout=layout))
                for layer in entry.layers
            ),
        )
        if entry.resolved_kind in LAYOUT_KINDS
        else entry
        for entry in pipeline.components
    )
    return attrs.evolve(pipeline, components=components)
