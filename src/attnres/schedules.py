"""Per-step backend schedules: ``attnres.schedule(module, {0: "sage_attn", 40: "fa"})``.

Diffusion samplers run the same model for every denoising step, and some
runtimes (xDiT, vLLM-Omni) switch attention kernels between steps: a fast,
approximate kernel for the early steps, an exact one for the last. A schedule
maps a first step to the backend that runs from that step on.

It is prepared in two phases, like :func:`attnres.request_backend`: every
attnres layer under the module is resolved for every backend of the schedule
(origin ``request``, strict, traced) and its kernel prepared; only when every
layer can run every step's backend does the block start, and the layers are
restored when it exits, also on error. A layer pinned with ``required`` keeps
its backend (its resolution says so). Switching happens in
:meth:`Stepper.step` only, through the request mechanism (a context variable
the layers' forward reads, so a schedule is per thread or task); prepared
kernels are cached per layer. The whole schedule has one record
(:class:`ScheduleRecord`: its steps and, per layer and step backend, the digest
of the resolution that prepared it); every switch is an audit event.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType

from attrs import frozen
from torch import nn

from attnres._schedule_plan import schedule_steps
from attnres.audit import emit_schedule_switch
from attnres.backends import Backend
from attnres.errors import RequestBackendError, ResolutionError
from attnres.kernels import KernelUnavailableError
from attnres.machine import request_refusal
from attnres.modules import _REQUESTS, Attention, KernelNotRegisteredError
from attnres.request import _label

__all__ = ["ScheduleRecord", "Stepper", "schedule"]


@frozen
class ScheduleRecord:
    """The schedule's one record: what runs from which step, and why per layer."""

    #: (first step, backend), ascending; the first step is 0
    steps: tuple[tuple[int, Backend], ...]
    #: (layer, step backend, backend the layer runs, digest of its resolution trace)
    layers: tuple[tuple[str, str, str, str], ...]


class Stepper:
    """What ``with attnres.schedule(...) as stepper`` gives: call :meth:`step`
    before each denoising step."""

    def __init__(self, record: ScheduleRecord, layers: list[Attention]) -> None:
        self.record = record
        self._firsts = [first for first, _ in record.steps]
        self._layers = layers
        self._outer = _REQUESTS.get()
        self.current: Backend | None = None
        self.switches = 0

    def backend_at(self, step: int) -> Backend:
        """The backend the schedule runs at ``step``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"schedule step: expected an integer >= 0, got {step!r}")
        return self.record.steps[bisect.bisect_right(self._firsts, step) - 1][1]

    def step(self, step: int) -> Backend:
        """Enter denoising step ``step``: switch the layers when its backend differs.

        The switch is the request mechanism's (a context variable the layers'
        forward reads), so it applies to this thread or task only."""
        backend = self.backend_at(step)
        if backend != self.current:
            previous = "" if self.current is None else self.current.name
            _REQUESTS.set(
                MappingProxyType({**self._outer, **{id(layer): backend for layer in self._layers}})
            )
            emit_schedule_switch(step, backend.name, len(self._layers), previous)
            self.current = backend
            self.switches += 1
        return backend

    def _restore(self) -> None:
        _REQUESTS.set(self._outer)
        if self.current is not None:
            emit_schedule_switch(-1, "", len(self._layers), self.current.name)


@contextmanager
def schedule(module: nn.Module, steps: Mapping[int, Backend | str]) -> Iterator[Stepper]:
    """Run ``module``'s attnres layers on a per-step backend schedule inside the block.

    Raises :class:`~attnres.errors.RequestBackendError` (nothing switched)
    when a layer cannot run one of the schedule's backends.
    """
    plan = schedule_steps(steps)
    layers = [(p, m) for p, m in module.named_modules() if isinstance(m, Attention)]
    if not layers:
        raise RequestBackendError(
            f"attnres.schedule: {type(module).__name__} holds no attnres.Attention layer",
            plan[0][1],
            (),
        )
    for _, layer in layers:
        if layer.pending:
            layer._bind_to()
    rows: list[tuple[str, str, str, str]] = []
    failures: list[tuple[str, str]] = []
    for backend in dict.fromkeys(b for _, b in plan):
        for path, layer in layers:
            current = layer.backend
            refusal = None if current == backend else request_refusal(current)
            if refusal is not None:  # the machine's request rules (a sparse layer)
                failures.append((f"{_label(path, layer)} at {backend.name}", refusal.message))
                continue
            try:
                bound = layer._prepare(backend)
            except (ResolutionError, KernelNotRegisteredError, KernelUnavailableError) as exc:
                failures.append((f"{_label(path, layer)} at {backend.name}", str(exc)))
                continue
            resolution = bound.resolution
            assert resolution is not None
            rows.append((path, backend.name, resolution.backend.name, resolution.trace.digest))
    if failures:
        shown = "; ".join(f"{label}: {why}" for label, why in failures[:8])
        raise RequestBackendError(
            f"attnres.schedule: {len(failures)} layer/backend pair(s) cannot run, so no layer "
            f"was switched: {shown}",
            plan[0][1],
            tuple(failures),
        )
    attention = [layer for _, layer in layers]
    for layer in attention:
        layer._make_switchable()
    stepper = Stepper(ScheduleRecord(plan, tuple(rows)), attention)
    try:
        stepper.step(0)
        yield stepper
    finally:
        stepper._restore()
