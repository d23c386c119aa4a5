"""Measured selection, the runtime part: time a layer's candidates on its real
inputs, and bind the winner.

:mod:`attnres.tuning` holds the rule and the trace; this module holds what
needs torch: the tuning wrapper a layer runs until it is tuned, the timing
loop, :func:`autotune` (tune a module eagerly on one example batch, before
``torch.compile``), and the results file (:func:`save_results`,
:func:`load_results`).

How a layer is tuned
--------------------
An :class:`attnres.Attention` whose decision is automatic (origin in
:data:`attnres.machine.TUNABLE_ORIGINS`) is *armed* when its config says
``autotune=True`` (or by :func:`autotune`): its forward body is replaced by a
wrapper, and only then -- a layer that is not armed runs exactly as before.
The wrapper runs the incumbent on every call; on the first call whose query
holds at least ``autotune_min_elements`` elements, outside ``torch.compile``,
``torch.jit`` tracing and CUDA-graph capture, it then times each candidate on
the same tensors (warm-up, then timed repeats, synchronising the device),
builds the tuned trace, records the decision (ledger and audit log), binds the
winner's kernel and steps aside: later calls cost what an untuned layer costs.

Layers whose decision input differs only by name and that see the same call
(shapes, dtype, device, mask, causal, scale) share one measurement.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import torch
from attrs import frozen
from torch import Tensor

from attnres._error import error_figures, reference_attention, timed
from attnres._fastcall import FastCallModule
from attnres._memo import GenerationMemo
from attnres.audit import emit_autotune_failed, emit_cache_hit, emit_resolution
from attnres.backends import Backend, BackendOptions, registered_backends
from attnres.errors import ArgumentTypeError, InvalidArgumentError, InvalidStateError
from attnres.kernels import KernelFn, KernelUnavailableError, get_kernel, specialized
from attnres.layer import LayerSpec
from attnres.ledger import Decision
from attnres.machine import numeric_budget
from attnres.platform import Platform
from attnres.runtime import Resolution
from attnres.trace import TUNED_SCHEMA_VERSION, Outcome, Record, Trace, TuningRecord
from attnres.tuning import (
    Measured,
    ResultEntry,
    entry_applies,
    facts_mismatch,
    is_tunable,
    is_tuned,
    measuring_checks,
    platform_facts,
    read_results,
    tolerance_for,
    tuned_trace,
    write_results,
)

__all__ = [
    "AutotuneReport",
    "LoadReport",
    "arm",
    "autotune",
    "clear_results",
    "is_armed",
    "load_results",
    "save_results",
    "use_timer",
]

Run = Callable[..., Tensor]
Timer = Callable[[], int]


class _Shape(Protocol):
    """What a layer fixed at construction that a candidate is timed with
    (``attnres.modules._LayerShape``)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def causal(self) -> bool: ...
    @property
    def softmax_scale(self) -> float | None: ...
    @property
    def softcap(self) -> float: ...
    @property
    def window(self) -> tuple[int, int] | None: ...
    @property
    def backend_options(self) -> BackendOptions: ...


class TunableLayer(Protocol):
    """What the tuner reads and calls on an :class:`attnres.Attention`.

    A protocol, not the class: :mod:`attnres.modules` imports this module (a
    layer arms its tuner and composes the measuring wrapper into its forward),
    so this one does not import it back.
    """

    __dict__: dict[str, Any]

    @property
    def layer_spec(self) -> LayerSpec: ...
    @property
    def _shape(self) -> _Shape: ...
    @property
    def resolution(self) -> Resolution | None: ...
    @property
    def kernel(self) -> KernelFn | None: ...
    @property
    def causal(self) -> bool: ...
    @property
    def softmax_scale(self) -> float | None: ...
    @property
    def softcap(self) -> float | None: ...
    @property
    def window(self) -> tuple[int | None, int | None] | None: ...
    def _bind_to(self) -> Resolution: ...
    def _set_tuner(self, tuner: object | None) -> None: ...
    def _adopt(self, resolution: Resolution) -> Decision: ...


#: The clock every measurement reads, in nanoseconds (tests inject their own).
_TIMER: Timer = time.perf_counter_ns
#: At most this many distinct measurements are kept in this process.
_SHARED_MAX: Final = 1024

_LOCK = threading.RLock()
# (decision input without the layer name, call, rule parameters) -> (records, outcome)
# A registry change (a backend or kernel registered, replaced or removed) may
# change any candidate list and any kernel: what this process derived or measured
# starts over (both belong to one registry generation, attnres._memo). Results
# loaded from a file stay: each entry names its candidates and platform facts,
# and applies only to a layer whose own match them.
_SHARED: GenerationMemo[tuple[object, ...], tuple[tuple[Record, ...], Outcome]] = GenerationMemo(
    _SHARED_MAX
)
# measurements taken in this process, for save_results: (platform key, call) -> entry
_MEASURED: GenerationMemo[tuple[str, str], ResultEntry] = GenerationMemo(_SHARED_MAX)
# loaded from results files: call -> [(entry, source path)]
_LOADED: dict[str, list[tuple[ResultEntry, str]]] = {}
# what the running autotune() call of this thread or task collects: (id of the
# layer, event, detail); a context variable, so concurrent calls keep their own
_COLLECTOR: contextvars.ContextVar[list[tuple[int, str, str]] | None] = contextvars.ContextVar(
    "attnres_autotune_collector", default=None
)


def clear_results() -> None:
    """Forget every measurement taken or loaded in this process."""
    with _LOCK:
        _SHARED.clear()
        _MEASURED.clear()
        _LOADED.clear()


@contextlib.contextmanager
def use_timer(timer: Timer) -> Iterator[None]:
    """Measure with ``timer`` (nanoseconds, monotonic) inside the block.

    For tests and simulations: a fake kernel that advances a fake clock makes
    every verdict deterministic.
    """
    global _TIMER
    previous, _TIMER = _TIMER, timer
    try:
        yield
    finally:
        _TIMER = previous


# =============================================================================
# Arming a layer
# =============================================================================


@frozen
class _Settings:
    min_elements: int
    margin: float
    warmup: int
    repeats: int


def is_armed(layer: TunableLayer) -> bool:
    """Whether the layer will measure its candidates on a large enough forward."""
    return layer.__dict__.get("_tuner") is not None


def _bound(layer: TunableLayer) -> Resolution:
    """The layer's decision; a pending layer (built without dtype) is bound first."""
    resolution = layer.resolution
    if resolution is None:
        resolution = layer._bind_to()
    return resolution


def _bound_kernel(layer: TunableLayer) -> KernelFn:
    _bound(layer)
    kernel = layer.kernel
    if kernel is None:  # pragma: no cover - a bound layer has its kernel
        raise InvalidStateError(
            "attnres autotune: the layer has no bound kernel; call attnres.bind(model) first"
        )
    return kernel


def arm(layer: TunableLayer, *, min_elements: int | None = None) -> bool:
    """Arm ``layer``'s tuner when its decision is automatic and untuned.

    Returns whether it is armed. The layer's config (the one its decision was
    made under) gives the margin, tolerances, warm-up and repeats, and
    ``min_elements`` unless given here.
    """
    if is_armed(layer):
        if min_elements is None:
            return True
        disarm(layer)
    if not is_tunable(_bound(layer).trace):
        return False
    config = _bound(layer).trace.input.config
    settings = _Settings(
        config.autotune_min_elements if min_elements is None else int(min_elements),
        config.autotune_margin,
        config.autotune_warmup,
        config.autotune_repeats,
    )
    layer._set_tuner(settings)  # the layer composes its forward (one writer)
    return True


def disarm(layer: TunableLayer) -> None:
    """Put the incumbent's forward body back (the layer stays untuned)."""
    if is_armed(layer):
        layer._set_tuner(None)


def _capturing() -> bool:
    """Inside torch.compile, torch.jit tracing or CUDA-graph capture: never tune."""
    if torch.compiler.is_compiling() or torch._C._get_tracing_state():
        return True
    cuda = torch.cuda
    return bool(cuda.is_available() and cuda.is_current_stream_capturing())


def armed_run(ref: Callable[[], TunableLayer | None], run: Run, settings: object) -> Run:
    """The measuring wrapper around the incumbent ``run`` (the layer composes it
    into its forward while armed: :meth:`attnres.Attention._compose`)."""
    assert isinstance(settings, _Settings)
    tuner: _Settings = settings
    min_elements = tuner.min_elements

    def tuning_run(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        if q.numel() < min_elements:
            if _COLLECTOR.get() is not None:  # an autotune() call wants to know why
                _note(ref, "small", f"query of {q.numel()} elements < min_elements {min_elements}")
            return run(q, k, v, attn_mask)
        if _capturing():
            return run(q, k, v, attn_mask)
        out = run(q, k, v, attn_mask)  # validates the inputs; an error leaves the tuner armed
        layer = ref()
        if layer is not None and layer.__dict__.get("_tuner") is settings:
            try:
                with torch.no_grad():
                    _tune(layer, run, (q, k, v, attn_mask), out.detach(), tuner)
            except Exception as exc:  # measuring must never break a forward
                layer._set_tuner(None)
                res = _bound(layer)
                emit_autotune_failed(res.component, res.layer, res.backend.name, _one_line(exc))
        return out

    return tuning_run


def _note(ref: Callable[[], TunableLayer | None], event: str, detail: str) -> None:
    events = _COLLECTOR.get()
    if events is not None:
        events.append((id(ref()), event, detail))


# =============================================================================
# Measuring
# =============================================================================


def describe_call(args: tuple[Tensor, Tensor, Tensor, Tensor | None], layer: TunableLayer) -> str:
    """The call a measurement applies to, as a stable text key."""
    q, k, v, mask = args
    scale = layer.softmax_scale
    mask_text = (
        "no mask"
        if mask is None
        else f"mask {tuple(mask.shape)} {str(mask.dtype).removeprefix('torch.')}"
    )
    extras = ""
    if layer.softcap is not None:
        extras += f", softcap={layer.softcap!r}"
    if layer.window is not None:
        extras += f", window={layer.window!r}"
    return (
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
        f"{str(q.dtype).removeprefix('torch.')} on {q.device.type}, {mask_text}, "
        f"causal={layer.causal}, scale={'default' if scale is None else repr(scale)}"
        f"{extras}"
    )


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if sync is None:  # pragma: no cover - a device without a synchronize()
        return lambda: None
    if device.type == "cuda":
        return lambda: sync(device)
    return lambda: sync()


def _deviation(out: Tensor, reference: Tensor) -> float | None:
    wide = torch.float64
    scale = float(reference.to(wide).abs().max()) if reference.numel() else 0.0
    diff = float((out.to(wide) - reference.to(wide)).abs().max()) if out.numel() else 0.0
    value = diff / max(scale, 1e-12)
    if not math.isfinite(value):
        return None
    return float(f"{value:.3g}")  # three significant digits: what the trace keeps


def _one_line(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def _measure(
    backend: Backend,
    fn: Run,
    args: tuple[Tensor, Tensor, Tensor, Tensor | None],
    reference: Tensor,
    settings: _Settings,
    sync: Callable[[], None],
    exact: Tensor | None = None,
) -> Measured:
    try:
        median, spread, out = timed(fn, args, settings.warmup, settings.repeats, sync, _TIMER)
    except Exception as exc:
        return Measured(backend, error=_one_line(exc))
    if not isinstance(out, Tensor) or out.shape != reference.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        return Measured(
            backend, error=f"returned {got}, expected a tensor of shape {tuple(reference.shape)}"
        )
    rel_l2 = None
    if exact is not None:  # issue 34: beside its time, its error against float64
        value = error_figures(out, exact)[0]
        rel_l2 = float(f"{value:.3g}") if math.isfinite(value) else 1e300
    return Measured(backend, median, spread, _deviation(out, reference), rel_l2=rel_l2)


def _float64_reference(
    layer: TunableLayer, args: tuple[Tensor, Tensor, Tensor, Tensor | None], trace: Trace
) -> Tensor | None:
    """Issue 34: the float64 output every candidate's error is measured against,
    only for a layer with a numeric error budget (else ``None``: nothing extra)."""
    if numeric_budget(trace.input) is None:
        return None
    shape = layer._shape
    q, k, v, mask = args
    return reference_attention(q, k, v, mask, shape.causal, shape.softmax_scale)


def _bare(kernel: KernelFn, layer: TunableLayer, backend: str) -> Run:
    """``kernel`` (``backend``'s) with the layer's fixed settings bound, without
    its input checks; the layer's options for that backend (issue 23) included,
    so a candidate is timed as it would run."""
    shape = layer._shape
    return specialized(
        kernel,
        shape.causal,
        shape.softmax_scale,
        shape.num_heads != shape.num_kv_heads,
        softcap=shape.softcap,
        window=shape.window,
        options=dict(shape.backend_options).get(backend, ()),
    )


def _tune(
    layer: TunableLayer,
    run: Run,
    args: tuple[Tensor, Tensor, Tensor, Tensor | None],
    reference: Tensor,
    settings: _Settings,
) -> None:
    machine_trace = _bound(layer).trace
    inp = machine_trace.input
    q = args[0]
    dtype = str(q.dtype).removeprefix("torch.")
    tolerance = tolerance_for(inp.config, dtype)
    call = describe_call(args, layer)
    nameless = attrs.evolve(inp, layer=attrs.evolve(inp.layer, name=None))
    key = (nameless, call, settings.margin, tolerance, settings.warmup, settings.repeats)
    with _LOCK:
        shared = _SHARED.get(key)
        if shared is None:
            records, outcome, event = _measure_all(
                layer, run, args, reference, settings, tolerance, call, machine_trace
            )
            _SHARED.put(key, (records, outcome))
        else:
            records, outcome = shared
            event = "reused"
    trace = Trace(inp, records, outcome, max(TUNED_SCHEMA_VERSION, inp.schema_version()))
    _adopt(layer, trace, fresh=event != "reused")
    _note(weakref.ref(layer), event, call)


def _measure_all(
    layer: TunableLayer,
    run: Run,
    args: tuple[Tensor, Tensor, Tensor, Tensor | None],
    reference: Tensor,
    settings: _Settings,
    tolerance: float,
    call: str,
    machine_trace: Trace,
) -> tuple[tuple[Record, ...], Outcome, str]:
    incumbent = machine_trace.outcome.backend
    assert incumbent is not None
    considered = tuple(Backend(spec.name) for spec in registered_backends())
    _, passing = measuring_checks(machine_trace, considered)
    no_kernel: dict[Backend, str] = {}
    kernels: list[tuple[Backend, Run]] = []
    for backend in passing:
        try:
            kernel = get_kernel(backend.name)
        except KernelUnavailableError as exc:
            no_kernel[backend] = _one_line(exc)
            continue
        if kernel is None:
            no_kernel[backend] = "no kernel is registered for it"
            continue
        kernels.append((backend, _bare(kernel, layer, backend.name)))
    here = platform_facts(machine_trace.input.platform)
    source, detail = "measured", "measured in this process"
    measured: list[Measured] | None = None
    ignored: list[str] = []
    for entry, path in _LOADED.get(call, ()):
        why = entry_applies(entry, incumbent, passing, here)
        if why is None and (entry.warmup, entry.repeats) == (settings.warmup, settings.repeats):
            measured = list(entry.measured)
            no_kernel = dict(entry.no_kernel)
            source, detail = "loaded", f"loaded from {path}"
            break
        ignored.append(f"{path}: {why or 'measured with other warm-up/repeat counts'}")
    if ignored:
        detail += "; ignored loaded results (" + "; ".join(ignored) + ")"
    if measured is None:
        sync = _synchronizer(args[0].device)
        # the incumbent is timed like every candidate: its bare kernel, without
        # the layer's input checks (its output on the real call is the reference)
        bare = _bare(_bound_kernel(layer), layer, incumbent.name)
        exact = _float64_reference(layer, args, machine_trace)
        measured = [_measure(incumbent, bare, args, reference, settings, sync, exact)]
        measured += [_measure(b, fn, args, reference, settings, sync, exact) for b, fn in kernels]
        entry = ResultEntry(
            platform=here,
            call=call,
            incumbent=incumbent,
            measured=tuple(measured),
            no_kernel=tuple(sorted(no_kernel.items(), key=lambda p: p[0].name)),
            warmup=settings.warmup,
            repeats=settings.repeats,
        )
        _MEASURED.put((entry.platform_key, call), entry)
    tuning = TuningRecord(
        call=call,
        elements=int(args[0].numel()),
        margin=settings.margin,
        tolerance=tolerance,
        warmup=settings.warmup,
        repeats=settings.repeats,
        considered=considered,
        source=source,
        detail=detail,
    )
    trace = tuned_trace(machine_trace, tuning, no_kernel, measured)
    return trace.records, trace.outcome, source


def _adopt(layer: TunableLayer, trace: Trace, *, fresh: bool) -> None:
    """Bind the tuned decision: the layer runs the winner; ledger and audit log say why."""
    previous = _bound(layer)
    outcome = trace.outcome
    assert outcome.backend is not None
    resolution = Resolution(outcome, trace, previous.component, previous.layer)
    decision = layer._adopt(resolution)  # replaces the layer's one ledger entry
    if fresh:
        emit_resolution(trace, decision)
    else:
        emit_cache_hit(decision)


# =============================================================================
# autotune(module, *example_inputs): tune eagerly, before compiling
# =============================================================================


@frozen
class AutotuneReport:
    """What one :func:`autotune` call did.

    ``decisions``: the tuned decisions it recorded, in call order;
    ``measured``/``loaded``/``reused``: how many layers timed their candidates,
    took a loaded result, or shared a measurement of the same shape;
    ``untuned``: ``(layer name, why)`` for each attention layer left as it was.
    """

    decisions: tuple[Decision, ...]
    measured: int
    loaded: int
    reused: int
    untuned: tuple[tuple[str, str], ...]


def autotune(
    module: torch.nn.Module,
    *example_inputs: Any,
    min_elements: int | None = None,
    **example_kwargs: Any,
) -> AutotuneReport:
    """Tune every automatic decision of ``module`` on one eager forward.

    Arms each :class:`attnres.Attention` inside ``module`` whose decision is
    automatic and untuned (whatever ``SelectionConfig.autotune`` says: calling
    this is the opt-in), runs ``module(*example_inputs, **example_kwargs)``
    under ``torch.no_grad()``, and disarms what it armed and did not tune, so
    that a later ``torch.compile`` sees plain layers. ``min_elements``
    overrides each layer's ``autotune_min_elements`` (``0``: tune every call).
    Explicit decisions (origin ``layer``, ``forced``, overrides, the global
    flag) are never tuned.
    """
    if not isinstance(module, torch.nn.Module):
        raise ArgumentTypeError(f"autotune() takes a torch.nn.Module, got {type(module).__name__}")
    if min_elements is not None and (
        isinstance(min_elements, bool) or not isinstance(min_elements, int) or min_elements < 0
    ):
        raise InvalidArgumentError(f"min_elements: expected an integer >= 0, got {min_elements!r}")
    # attnres's attention layers all derive from FastCallModule (attnres._fastcall):
    # checking it keeps this module from importing attnres.modules, which imports it
    layers: list[tuple[str, TunableLayer]] = [
        (name, m)  # type: ignore[misc]
        for name, m in module.named_modules()
        if isinstance(m, FastCallModule)
    ]
    for _, layer in layers:  # layers built without dtype: bound first (the server's decision)
        _bound(layer)
    armed_here: list[TunableLayer] = []
    untuned: dict[int, tuple[str, str]] = {}
    for name, layer in layers:
        label = layer.layer_spec.name or name
        trace = _bound(layer).trace
        if not is_tunable(trace):
            why = (
                "already tuned"
                if is_tuned(trace)
                else f"origin {trace.outcome.origin}: only automatic decisions are tuned"
            )
            untuned[id(layer)] = (label, why)
            continue
        was_armed = is_armed(layer)
        arm(layer, min_elements=min_elements)
        if not was_armed or min_elements is not None:
            armed_here.append(layer)
    events: list[tuple[int, str, str]] = []
    before = {id(layer): layer.resolution for _, layer in layers}
    collecting = _COLLECTOR.set(events)
    try:
        with torch.no_grad():
            module(*example_inputs, **example_kwargs)
    finally:
        _COLLECTOR.reset(collecting)
        for layer in armed_here:
            disarm(layer)
            if _bound(layer).trace.input.config.autotune:
                arm(layer)  # the config asked for tuning: keep waiting for a large call
    small = {key: detail for key, event, detail in events if event == "small"}
    decisions: list[Decision] = []
    for name, layer in layers:
        label = layer.layer_spec.name or name
        if layer.resolution is not before[id(layer)]:
            res = _bound(layer)
            decisions.append(Decision(res.component, res.layer, res.outcome, res.trace))
        elif id(layer) not in untuned:
            untuned[id(layer)] = (label, small.get(id(layer), "not called by the example inputs"))
    counts = {"measured": 0, "loaded": 0, "reused": 0}
    for _, event, _ in events:
        if event in counts:
            counts[event] += 1
    return AutotuneReport(
        tuple(decisions),
        counts["measured"],
        counts["loaded"],
        counts["reused"],
        tuple(untuned.values()),
    )


# =============================================================================
# Results files
# =============================================================================


@frozen
class LoadReport:
    """What :func:`load_results` found: entries usable on this platform, and the
    others with why (they are kept, and a layer that measures anyway notes them)."""

    path: str
    usable: int
    ignored: tuple[tuple[str, str], ...]


def save_results(path: str | os.PathLike[str]) -> Path:
    """Write the measurements taken in this process to ``path`` (JSON).

    Merges into an existing attnres results file (entries for other platforms
    and calls are kept); a file that is not one is never overwritten.
    """
    with _LOCK:
        entries = list(_MEASURED.values())
    return write_results(path, entries)


def load_results(path: str | os.PathLike[str], *, platform: Platform | None = None) -> LoadReport:
    """Load measurements from ``path`` for layers to use instead of timing.

    An entry applies to a layer when its platform facts (device, capability,
    torch version, kernel packages), its call, its incumbent and its candidates
    match the layer's; ``platform`` (default: this machine) is only used to
    report which entries look usable here. Entries that do not apply are
    ignored, and the tuning record of a layer that measures anyway says why.
    """
    source = os.fspath(path)
    entries = read_results(source)
    here = platform_facts(platform or Platform.detect())
    ignored = []
    usable = 0
    with _LOCK:
        for entry in entries:
            why = facts_mismatch(entry.platform, here)
            if why is None:
                usable += 1
            else:
                ignored.append((entry.call, why))
            bucket = _LOADED.setdefault(entry.call, [])
            bucket[:] = [(e, p) for e, p in bucket if e.platform_key != entry.platform_key]
            bucket.append((entry, source))
    return LoadReport(source, usable, tuple(ignored))
