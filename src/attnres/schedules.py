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
from attnres.errors import InvalidArgumentError, InvalidStateError
from attnres.modules import _REQUESTS, Attention
from attnres.request import prepare_switch, refuse_graphs

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
        self._closed = False

    def backend_at(self, step: int) -> Backend:
        """The backend the schedule runs at ``step``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"schedule step: expected an integer >= 0, got {step!r}")
        return self.record.steps[bisect.bisect_right(self._firsts, step) - 1][1]

    def step(self, step: int) -> Backend:
        """Enter denoising step ``step``: switch the layers when its backend differs.

        The switch is the request mechanism's (a context variable the layers'
        forward reads), so it applies to this thread or task only. Raises
        :class:`~attnres.errors.InvalidStateError` once the ``with`` block has
        exited: the layers are back on their own backends and stay there."""
        if self._closed:
            raise InvalidStateError(
                f"attnres.schedule: step({step!r}) was called after the schedule's with "
                f"block exited; the layers run their own backends again and are not switched. "
                f"Call stepper.step inside the block (enter attnres.schedule again to resume)"
            )
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
        self._closed = True
        _REQUESTS.set(self._outer)
        if self.current is not None:
            emit_schedule_switch(-1, "", len(self._layers), self.current.name)


@contextmanager
def schedule(module: nn.Module, steps: Mapping[int, Backend | str]) -> Iterator[Stepper]:
    """Run ``module``'s attnres layers on a per-step backend schedule inside the block.

    Refuses what :func:`attnres.request_backend` refuses, with the same types
    (one two-phase switch serves both): ``TypeError`` for a module that is not
    one; :class:`~attnres.errors.CompiledGraphError` inside ``torch.compile``d
    code, during CUDA graph capture, or for a compiled module; and
    :class:`~attnres.errors.RequestBackendError` (nothing switched) when a
    layer cannot run one of the schedule's backends.
    """
    who = "attnres.schedule"
    module = refuse_graphs(module, who)
    plan = schedule_steps(steps)
    backends = list(dict.fromkeys(b for _, b in plan))
    layers, prepared = prepare_switch(module, backends, who, every_layer=True)
    rows: list[tuple[str, str, str, str]] = []
    for path, layer, backend in prepared:
        resolution = layer._prepare(backend).resolution  # cached: the pair prepared above
        assert resolution is not None
        rows.append((path, backend.name, resolution.backend.name, resolution.trace.digest))
    attention = [layer for _, layer in layers]
    for layer in attention:
        layer._make_switchable()
    stepper = Stepper(ScheduleRecord(plan, tuple(rows)), attention)
    try:
        stepper.step(0)
        yield stepper
    finally:
        stepper._restore()
