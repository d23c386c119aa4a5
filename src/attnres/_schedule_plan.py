"""Schedules without torch: parsing and planning one layer's per-step backends (issue 23).

:func:`attnres.schedule` (``attnres.schedules``, which imports torch) runs a
schedule on built layers; this module holds what the CLI and the library share:
parsing a schedule (a mapping, or the flag's ``STEP:BACKEND,...`` text) and
resolving one layer for each of its steps, as the layer would be prepared.
"""

from __future__ import annotations

from collections.abc import Mapping

from attnres.backends import Backend
from attnres.errors import InvalidArgumentError
from attnres.layer import LayerSpec, SelectionConfig, optional_backend
from attnres.platform import Platform
from attnres.runtime import lookup
from attnres.scope import ScopeState
from attnres.trace import Trace

__all__ = ["Steps", "parse_schedule", "plan_schedule", "schedule_steps"]

#: (first step, backend), ascending from step 0
Steps = tuple[tuple[int, Backend], ...]

#: The largest first step a schedule takes (samplers run tens to thousands of steps)
MAX_STEP = 10**9


def schedule_steps(value: Mapping[int, Backend | str], what: str = "attnres.schedule") -> Steps:
    """The steps of a schedule, validated: first steps are integers >= 0, one is 0."""
    if not isinstance(value, Mapping) or not value:
        raise InvalidArgumentError(
            f"{what}: steps must be a non-empty mapping of first step to backend, "
            "e.g. {0: 'sage_attn', 40: 'fa'}"
        )
    out: list[tuple[int, Backend]] = []
    for first, backend in value.items():
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= MAX_STEP:
            shown = repr(first) if not isinstance(first, int) or first < 10**30 else "a huge number"
            raise InvalidArgumentError(
                f"{what}: a first step must be an integer >= 0 and at most {MAX_STEP}, got {shown}"
            )
        parsed = optional_backend(f"{what}: step {first}")(backend)
        if parsed is None:
            raise InvalidArgumentError(f"{what}: step {first}: backend must not be None")
        out.append((first, parsed))
    out.sort(key=lambda item: item[0])
    if out[0][0] != 0:
        raise InvalidArgumentError(
            f"{what}: the schedule must say what runs from step 0 (its first step is {out[0][0]})"
        )
    return tuple(out)


def parse_schedule(text: str) -> Steps:
    """``"0:sage_attn,40:fa"`` (the ``--schedule`` flag) as validated steps."""
    steps: dict[int, str] = {}
    for part in (p.strip() for p in text.split(",")):
        first, colon, backend = part.partition(":")
        first = first.strip()
        # ASCII digits only: str.isdigit() accepts "²", which int() refuses
        if not colon or not (first.isascii() and first.isdigit()) or not backend.strip():
            raise InvalidArgumentError(
                f"--schedule: expected STEP:BACKEND[,STEP:BACKEND...] such as "
                f"0:sage_attn,40:fa, got {part!r}"
            )
        if len(first) > len(str(MAX_STEP)):
            raise InvalidArgumentError(
                f"--schedule: a first step is at most {MAX_STEP}, got {first[:40]}"
            )
        if int(first) in steps:
            raise InvalidArgumentError(f"--schedule: step {int(first)} is given twice")
        steps[int(first)] = backend.strip()
    return schedule_steps(steps, "--schedule")


def plan_schedule(
    layer: LayerSpec,
    steps: Steps,
    config: SelectionConfig,
    platform: Platform,
    scope: ScopeState | None = None,
) -> tuple[tuple[int, Backend, Trace], ...]:
    """Each step's resolution of ``layer``, as a schedule prepares it (origin
    ``request``; a layer's ``required`` backend wins). Records nothing."""
    return tuple(
        (first, backend, lookup(layer, config, scope, platform, None, backend)[2])
        for first, backend in steps
    )
