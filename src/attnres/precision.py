"""Precision as a decision input (issue 34): measured error, with the evidence kept.

The machine's ``precision`` check (:data:`attnres.machine.PRECISION_RULES`)
holds a lossy kernel to its layer's error budget
(``SelectionConfig.attention_error``, ``--attention-error``) by its facts
(:data:`attnres.backends.PRECISION_FACTS`) and by what was measured on the
layer's own inputs (``TraceInput.measured_error``). This module measures:

- :func:`error_figures`: relative L2, max abs and cosine of an output against a
  float64 reference (:func:`reference_attention`);
- :func:`calibrate`: every :class:`attnres.Attention` layer of a module, on the
  inputs one forward gives it: its kernel's time and, by default, its error;
- :func:`calibrate_pipeline`: every attention site of a diffusers pipeline that
  a plan gives a lossy kernel, on the inputs one run of the pipeline gives it
  (captured where the site calls SDPA), the kernel emulated where it cannot
  run (:mod:`attnres.kernels.sage_emulated`); each site is resolved again with
  its measurement in the input, so its trace says why it kept or lost the kernel;
- :func:`emulate_lossy_kernels`: a context manager that registers the emulation
  as ``sage_attn``'s kernel for a simulated platform only;
- :func:`save_calibration` / :func:`load_calibration`: a results file that keeps
  every figure and replays (``attnres calibrate --save`` / ``--load``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import frozen
from torch import Tensor

from attnres._error import error_figures, reference_attention, timed
from attnres._files import atomic_write_text, read_bounded
from attnres._precision_view import describe_precision, precision_of_trace
from attnres.backends import Backend, lookup_spec
from attnres.errors import InvalidArgumentError, ResultsFileError
from attnres.kernels import register_kernel, unregister_kernel
from attnres.kernels.sage_emulated import sage_attention_emulated
from attnres.layer import describe_budget
from attnres.machine import layer_budget, precision_here, run_machine
from attnres.modules import Attention
from attnres.platform import Platform
from attnres.records import ErrorMeasurement
from attnres.trace import Trace

__all__ = [
    "CalibrationReport",
    "SiteCalibration",
    "calibrate",
    "calibrate_pipeline",
    "calibrate_plan",
    "describe_precision",
    "emulate_lossy_kernels",
    "error_figures",
    "load_calibration",
    "precision_of_trace",
    "reference_attention",
    "save_calibration",
]

#: The kernels attnres can emulate where they cannot run, by backend.
EMULATED = frozenset({"sage_attn"})
RESULTS_FORMAT = "attnres-calibration"
RESULTS_VERSION = 1


# =============================================================================
# Figures
# =============================================================================


def _call(q: Tensor, dtype: str | None = None) -> str:
    return f"q {tuple(q.shape)} {dtype or str(q.dtype).removeprefix('torch.')}"


# =============================================================================
# The emulation, registered for a simulated platform only
# =============================================================================


def _emulation(backend: str, platform: Platform) -> Callable[..., Tensor]:
    if backend != "sage_attn":
        raise InvalidArgumentError(
            f"attnres has no emulation of {backend!r} (emulated: {sorted(EMULATED)})"
        )
    return functools.partial(sage_attention_emulated, capability=platform.capability)


@contextlib.contextmanager
def emulate_lossy_kernels(platform: Platform) -> Iterator[None]:
    """Register the emulated SageAttention 2 as ``sage_attn``'s kernel while the
    block runs, for layers built on the simulated ``platform`` (its compute
    capability picks the scheme). A detected platform is refused: a real
    machine runs the real kernel or none."""
    if not platform.simulated:
        raise InvalidArgumentError(
            "emulate_lossy_kernels: the emulation stands in for kernels on a simulated platform "
            f"only; {platform.describe()} is detected"
        )
    fn = _emulation("sage_attn", platform)

    def kernel(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool, scale: float | None
    ) -> Tensor:
        return fn(q, k, v, attn_mask, causal, scale)

    kernel.emulated = True  # type: ignore[attr-defined]
    register_kernel("sage_attn", kernel, replace=True)
    try:
        yield
    finally:
        unregister_kernel("sage_attn")


# =============================================================================
# Calibrating a module's attnres layers
# =============================================================================


@frozen
class SiteCalibration:
    """One layer or site: what it runs, its precision, the budget and the figures.

    ``trace`` is the site's decision resolved again with its measurement in the
    input (``None`` for a module's layers: their decision is bound); ``backend``
    what it runs after calibration (``None``: rejected, ``trace`` says why).
    """

    component: str
    site: str
    planned: Backend | None
    backend: Backend | None
    precision: str
    budget: str
    measured: ErrorMeasurement | None
    median_ns: int | None = None
    trace: Trace | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        m = self.measured
        return {
            "component": self.component,
            "site": self.site,
            "planned": None if self.planned is None else self.planned.name,
            "backend": None if self.backend is None else self.backend.name,
            "precision": self.precision,
            "budget": self.budget,
            "measured": None if m is None else _measurement_doc(m),
            "median_ns": self.median_ns,
            "code": None if self.trace is None else self.trace.outcome.code,
            "note": self.note,
        }


@frozen
class CalibrationReport:
    """What :func:`calibrate` or :func:`calibrate_pipeline` measured, site by site."""

    sites: tuple[SiteCalibration, ...]
    platform: Platform
    errors: bool = True

    @property
    def ok(self) -> bool:
        """No site was rejected (when planned, or once measured)."""
        return all(s.backend is not None for s in self.sites)

    def measurements(self) -> tuple[tuple[str, str, ErrorMeasurement], ...]:
        return tuple((s.component, s.site, s.measured) for s in self.sites if s.measured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform.describe(),
            "sites": [s.to_dict() for s in self.sites],
        }

    def render(self) -> list[str]:
        """The report as ``attnres calibrate`` prints it."""
        lines = [f"Calibration on {self.platform.describe()} (float64 reference)"]
        for s in self.sites:
            runs = "REJECTED" if s.backend is None else s.backend.name
            moved = s.note or "not measured"
            if s.measured is not None:
                m = s.measured
                tags = [t for t in ("emulated" if m.emulated else "", m.source) if t]
                moved = (
                    f"moved rel L2 {m.rel_l2:.3g}, max abs {m.max_abs:.3g}, cosine "
                    f"{m.cosine:.6f} ({', '.join(tags)})"
                )
            if s.trace is not None and s.trace.outcome.code:
                moved += f"; {s.trace.outcome.code}"
            elif s.planned is not None and s.backend != s.planned:
                moved += f"; over budget: {s.planned.name} -> {runs}"
            lines.append(
                f"  {s.component}/{s.site}: {runs} [{s.precision}; budget {s.budget}] {moved}"
            )
        return lines


def calibrate(
    module: torch.nn.Module,
    *args: Any,
    errors: bool = True,
    warmup: int = 3,
    repeats: int = 8,
    **kwargs: Any,
) -> CalibrationReport:
    """Measure every :class:`attnres.Attention` layer of ``module`` on the inputs
    one forward ``module(*args, **kwargs)`` gives it: its kernel's median time
    and (``errors``, the default) its error against a float64 reference.

    Layers that see the same input (shapes and values) share one measurement.
    ``errors=False`` times only (the baseline ``make bench`` compares with);
    ``warmup`` and ``repeats`` are autotune's defaults.
    """
    captured: dict[str, tuple[Attention, tuple[Tensor, Tensor, Tensor, Tensor | None]]] = {}
    handles = []
    for name, layer in module.named_modules():
        if isinstance(layer, Attention):

            def hook(m: Any, inputs: tuple[Any, ...], name: str = name) -> None:
                if name not in captured:
                    q, k, v, *rest = inputs
                    mask = rest[0] if rest else None
                    captured[name] = (m, (q.detach(), k.detach(), v.detach(), mask))

            handles.append(layer.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    sites = []
    platform = Platform.detect()
    with torch.no_grad():
        for name, (layer, (q, k, v, mask)) in captured.items():
            backend = layer.backend
            assert backend is not None  # a layer that ran has a backend
            median, _, out = timed(layer, (q, k, v, mask), warmup + 1, repeats)
            res = layer.resolution
            measured = None
            if errors:
                ref = reference_attention(q, k, v, mask, layer.causal, layer.softmax_scale)
                rel, mx, cos = error_figures(out, ref)
                measured = ErrorMeasurement(backend, rel, mx, cos, _call(q))
            trace = None if res is None else res.trace
            budget = None if trace is None else layer_budget(trace.input)
            spec = lookup_spec(backend)
            fact = None if spec is None else precision_here(spec, platform)
            sites.append(
                SiteCalibration(
                    ""
                    if trace is None or trace.input.scope is None
                    else trace.input.scope.component,
                    name,
                    layer.backend,
                    layer.backend,
                    "undeclared" if fact is None else fact.kind,
                    "-" if budget is None else f"{budget.key}: {describe_budget(budget.value)}",
                    measured,
                    median,
                )
            )
    return CalibrationReport(tuple(sites), platform, errors)


# =============================================================================
# Calibrating a diffusers pipeline's sites, planned for a (simulated) platform
# =============================================================================


#: ``torch.nn.functional.scaled_dot_product_attention``'s positional parameters.
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def _first_calls(
    calls: dict[tuple[str, str], tuple[Tensor, Tensor, Tensor, Tensor | None, bool, float | None]],
) -> Callable[[tuple[str, str] | None, tuple[Any, ...], dict[str, Any]], None]:
    """What :func:`attnres.integrations.diffusers.sdpa_calls` hands each SDPA call
    to: the first call of each innermost module, per component, kept in
    attnres's layout."""

    def keep(where: tuple[str, str] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if where is None or where in calls:
            return
        bound = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
        q, k, v = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        calls[where] = (
            q.detach().transpose(1, 2),
            k.detach().transpose(1, 2),
            v.detach().transpose(1, 2),
            None if mask is None else mask.detach(),
            bool(bound.get("is_causal", False)),
            bound.get("scale"),
        )

    return keep


def calibrate_pipeline(
    pipe: Any,
    run: Callable[[Any], Any],
    config: Any,
    platform: Platform,
    *,
    results: Mapping[tuple[str, str], ErrorMeasurement] | None = None,
) -> CalibrationReport:
    """Plan ``pipe`` for ``platform`` under ``config`` and measure each site whose
    planned kernel is lossy on the inputs ``run(pipe)`` gives it.

    The pipeline itself runs as it is (nothing is installed); each site's first
    SDPA call is captured. A lossy kernel that cannot run here is emulated
    (``ErrorMeasurement.emulated``). Each measured site is resolved again with
    its measurement in the input (``TraceInput.measured_error``): the new trace
    admits the kernel within the budget, or records ``error_over_budget`` and
    falls back or rejects by its origin. ``results`` (``load_calibration``)
    supplies measurements instead of measuring (their ``source`` is ``loaded``).
    """
    from attnres.integrations import diffusers as _diffusers

    plan = _diffusers.plan(pipe, config, platform)
    calls: dict[tuple[str, str], Any] = {}
    if results is None:
        with (
            torch.no_grad(),
            _diffusers.sdpa_calls(_diffusers._components(pipe), _first_calls(calls)),
        ):
            run(pipe)
    sites = []
    for site in plan.sites:
        res = site.resolution
        if res is None:
            continue
        trace = res.trace
        backend = res.backend
        spec = lookup_spec(backend)
        fact = None if spec is None else precision_here(spec, platform)
        kind = "undeclared" if fact is None else fact.kind
        budget = layer_budget(trace.input)
        budget_text = "-" if budget is None else f"{budget.key}: {describe_budget(budget.value)}"
        key = (site.component, site.name)
        measured: ErrorMeasurement | None = None
        note = ""
        if kind == "exact":
            note = "exact to its dtype (facts), not measured"
        elif results is not None:
            measured = results.get(key)
            note = "" if measured is not None else "no measurement in the results file"
        elif key not in calls:
            note = "no SDPA call captured for this site"
        else:
            q, k, v, mask, causal, scale = calls[key]
            if mask is not None:
                note = "its call passes a mask, which the lossy kernel does not take"
            else:
                measured = _measure_lossy(trace, q, k, v, causal, scale)
        new_trace = trace
        if measured is not None:
            new_trace = run_machine(attrs.evolve(trace.input, measured_error=(measured,)))
        sites.append(
            SiteCalibration(
                site.component,
                site.name,
                backend,
                new_trace.outcome.backend,
                kind,
                budget_text,
                measured,
                None,
                new_trace,
                note,
            )
        )
    return CalibrationReport(tuple(sites), platform)


def _measure_lossy(
    trace: Trace, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None
) -> ErrorMeasurement:
    """The lossy kernel ``trace`` selected, on these inputs cast to the layer's
    dtype, against float64: emulated (this machine cannot run the kernel)."""
    backend = trace.outcome.backend
    assert backend is not None
    dtype = trace.input.layer.dtype
    cast = getattr(torch, dtype)
    qc, kc, vc = (t.to(cast) for t in (q, k, v))
    out = _emulation(backend.name, trace.input.platform)(qc, kc, vc, None, causal, scale)
    rel, mx, cos = error_figures(out, reference_attention(q, k, v, None, causal, scale))
    return ErrorMeasurement(backend, rel, mx, cos, _call(q, dtype), True)


def calibrate_plan(
    result: Any,
    *,
    tokens: int = 1024,
    heads: int = 8,
    seed: int = 0,
    results: Mapping[tuple[str, str], ErrorMeasurement] | None = None,
) -> CalibrationReport:
    """``attnres calibrate PIPELINE.toml``: each layer of a planned pipeline file
    (:class:`attnres.plan.PlanResult`) whose chosen kernel is lossy, measured on
    seeded synthetic inputs (a pipeline file carries no weights: q, k, v normal,
    ``tokens`` x ``heads`` at the layer's head size and dtype; the Python API
    :func:`calibrate_pipeline` measures a model's own captured inputs), and
    resolved again with the measurement in its input."""
    sites = []
    for layer in result.layers:
        trace = layer.trace
        budget = layer_budget(trace.input)
        budget_text = "-" if budget is None else f"{budget.key}: {describe_budget(budget.value)}"
        backend = trace.outcome.backend
        if backend is None:
            sites.append(
                SiteCalibration(layer.component, layer.name, None, None, "-", budget_text, None,
                                trace=trace, note=f"rejected when planned ({trace.outcome.code})")
            )  # fmt: skip
            continue
        spec = lookup_spec(backend)
        fact = None if spec is None else precision_here(spec, trace.input.platform)
        kind = "undeclared" if fact is None else fact.kind
        measured: ErrorMeasurement | None = None
        note = ""
        key = (layer.component, layer.name)
        if kind == "exact":
            note = "exact to its dtype (facts), not measured"
        elif results is not None:
            measured = results.get(key)
            note = "" if measured is not None else "no measurement in the results file"
        elif backend.name not in EMULATED:
            note = f"attnres has no emulation of {backend.name} to measure here"
        else:
            g = torch.Generator().manual_seed(seed)
            head = trace.input.layer.head_size
            q, k, v = (torch.randn(1, tokens, heads, head, generator=g) for _ in range(3))
            measured = _measure_lossy(trace, q, k, v, trace.input.layer.requirements.causal, None)
            measured = attrs.evolve(measured, call=measured.call + f" synthetic (seed {seed})")
        new_trace = trace
        if measured is not None:
            new_trace = run_machine(attrs.evolve(trace.input, measured_error=(measured,)))
        sites.append(
            SiteCalibration(layer.component, layer.name, backend, new_trace.outcome.backend,
                            kind, budget_text, measured, None, new_trace, note)
        )  # fmt: skip
    return CalibrationReport(tuple(sites), result.platform)


# =============================================================================
# Results files
# =============================================================================


def _measurement_doc(m: ErrorMeasurement) -> dict[str, Any]:
    return {
        "backend": m.backend.name,
        "rel_l2": m.rel_l2,
        "max_abs": m.max_abs,
        "cosine": m.cosine,
        "call": m.call,
        "emulated": m.emulated,
    }


def save_calibration(report: CalibrationReport, path: str | os.PathLike[str]) -> Path:
    """Write every measurement of ``report`` (both figures: error and time) to a
    results file, atomically."""
    doc = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "platform": report.platform.describe(),
        "entries": [
            {
                "component": s.component,
                "site": s.site,
                **_measurement_doc(s.measured),
                "median_ns": s.median_ns,
            }
            for s in report.sites
            if s.measured is not None
        ],
    }
    target = Path(path)
    atomic_write_text(target, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return target


def load_calibration(path: str | os.PathLike[str]) -> dict[tuple[str, str], ErrorMeasurement]:
    """A results file's measurements by (component, site), marked ``loaded``.

    A file that cannot be read or is not one is a :class:`ResultsFileError` (a
    ``ValueError``) that says what is wrong."""
    try:
        raw = read_bounded(Path(path), what="calibration results file")
    except OSError as exc:
        raise ResultsFileError(
            f"{path}: cannot read the calibration results: {exc.strerror or exc}"
        ) from None
    text = raw.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsFileError(f"{path}: not a calibration results file: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != RESULTS_FORMAT:
        raise ResultsFileError(
            f"{path}: not a calibration results file (format {RESULTS_FORMAT!r})"
        )
    if doc.get("version") != RESULTS_VERSION:
        raise ResultsFileError(
            f"{path}: unsupported calibration results version {doc.get('version')!r}"
        )
    out: dict[tuple[str, str], ErrorMeasurement] = {}
    for i, e in enumerate(doc.get("entries") or []):
        try:
            out[(str(e["component"]), str(e["site"]))] = ErrorMeasurement(
                Backend.parse(e["backend"]),
                float(e["rel_l2"]),
                float(e["max_abs"]),
                float(e["cosine"]),
                str(e["call"]),
                bool(e["emulated"]),
                "loaded",
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ResultsFileError(f"{path}: entries[{i}]: {exc}") from None
    return out
