"""Measured selection, the pure part: the tolerances and the results file. The
rules of the measuring stage (which decisions are tuned, its checks, the
verdict rule, the tuned trace and its replay) are the machine's
(:mod:`attnres.machine`, re-exported here). Nothing here imports torch or times
anything: :mod:`attnres.autotuner` measures on real tensors and hands the facts
to the machine.

Theory of operation
-------------------
A decision whose origin is in :data:`attnres.machine.TUNABLE_ORIGINS` (an
automatic one) may be tuned. The tuned trace keeps the machine's records up to
its ``accepted`` transition, then records::

    selected --measure--> measuring           (candidate: the incumbent)
    tuning                                    (the call, the rule's parameters)
    check ... / skip ...                      (every considered backend, stage measuring)
    measurement ...                           (the incumbent first, then each candidate)
    measuring --measured_faster--> selected   (reason "measured faster"), or
    measuring --incumbent_kept--> selected    (no reason)
    selected                                  (the terminal record)

The candidates are the considered backends that pass every check at the
``measuring`` stage (the machine's own checks), minus those without a kernel in
the recording process (a ``skip`` record says so). A measurement's verdict is a
function of its facts (times, deviation, error) and the tuning record's margin
and tolerance (:func:`verdicts`); :func:`replay_tuned` recomputes every verdict
and the outcome from the recorded facts, so replay needs no device.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from attrs import frozen

from attnres._files import exclusive_lock, read_json
from attnres._states import PackageStatus
from attnres.backends import Backend
from attnres.errors import ResultsFileError
from attnres.layer import SelectionConfig

# the measuring stage is the machine's (attnres.machine); re-exported here
from attnres.machine import (
    NO_KERNEL,
    Measured,
    is_tunable,
    is_tuned,
    measuring_checks,
    replay_tuned,
    tuned_trace,
    verdicts,
)
from attnres.platform import Platform
from attnres.trace import (
    atomic_write_text,
    canonical_json,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "NO_KERNEL",
    "Measured",
    "is_tunable",
    "is_tuned",
    "measuring_checks",
    "replay_tuned",
    "tolerance_for",
    "tuned_trace",
    "verdicts",
]

#: Relative tolerance per dtype: how far a candidate's output may deviate from
#: the incumbent's (max |candidate - incumbent| / max |incumbent|) and still be
#: "the same attention". Two correct kernels differ by rounding: about 1e-7 in
#: float64 and 1e-6 in float32 on CPU (TF32 on GPUs makes it 1e-3), 1e-3 in
#: half precision; the bounds leave room above that, below a real bug.
#: ``SelectionConfig(autotune_tolerance={"bf16": 0.02})`` overrides one.
DEFAULT_TOLERANCES: Final[Mapping[str, float]] = {
    "float64": 1e-6,
    "float32": 5e-3,
    "float16": 2e-2,
    "bfloat16": 5e-2,
    "float8_e4m3fn": 0.25,
    "float8_e5m2": 0.25,
}


def tolerance_for(config: SelectionConfig, dtype: str) -> float:
    """The relative tolerance for outputs of ``dtype`` under ``config``."""
    for name, tolerance in config.autotune_tolerance:
        if name == dtype:
            return tolerance
    return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float32"])


# =============================================================================
# The results file: measurements keyed by platform facts and call
# =============================================================================

RESULTS_FORMAT: Final = "attnres-autotune-results"
RESULTS_VERSION: Final = 1
#: A results file larger than this is refused unread.
MAX_RESULTS_BYTES: Final = 4 << 20
#: At most this many entries are read from (and kept in) a results file.
MAX_RESULTS_ENTRIES: Final = 4096
#: The largest count or nanosecond figure a results file may hold (~292 years in ns).
MAX_RESULTS_COUNT: Final = 2**63 - 1


def platform_facts(platform: Platform) -> dict[str, Any]:
    """The facts that must match for a measurement to apply on another machine."""
    return {
        "kind": platform.kind,
        "device_name": platform.device_name,
        "capability": None if platform.capability is None else list(platform.capability),
        "arch": platform.arch,
        "torch_version": platform.torch_version,
        "packages": {
            p.name: p.version for p in platform.packages if p.status == PackageStatus.PRESENT
        },
    }


_FACT_NAMES: Final = {
    "torch_version": "torch version",
    "kind": "device kind",
    "device_name": "device",
    "capability": "compute capability",
    "arch": "architecture",
    "packages": "kernel packages",
}


def facts_mismatch(recorded: Mapping[str, Any], here: Mapping[str, Any]) -> str | None:
    """Why results recorded under ``recorded`` facts do not apply ``here`` (or None)."""
    for key in ("torch_version", "kind", "device_name", "capability", "arch", "packages"):
        if recorded.get(key) != here.get(key):
            return (
                f"recorded with {_FACT_NAMES[key]} {json.dumps(recorded.get(key))}, this "
                f"process has {json.dumps(here.get(key))}"
            )
    return None


@frozen
class ResultEntry:
    """One shared measurement: platform facts, the call, the incumbent, the facts."""

    platform: Mapping[str, Any] = attrs.field(eq=False)
    call: str
    incumbent: Backend
    measured: tuple[Measured, ...]
    no_kernel: tuple[tuple[Backend, str], ...]
    warmup: int
    repeats: int
    #: a key for comparing platforms (the canonical JSON of ``platform``)
    platform_key: str = attrs.field(init=False)

    @platform_key.default
    def _platform_key(self) -> str:
        return canonical_json(dict(self.platform))

    def to_json(self) -> dict[str, Any]:
        return {
            "platform": dict(self.platform),
            "call": self.call,
            "incumbent": self.incumbent.name,
            "no_kernel": {b.name: why for b, why in self.no_kernel},
            "warmup": self.warmup,
            "repeats": self.repeats,
            "measurements": [
                {
                    "candidate": m.candidate.name,
                    "median_ns": m.median_ns,
                    "spread_ns": m.spread_ns,
                    "deviation": m.deviation,
                    "error": m.error,
                    # issue 34: the error against float64, under a numeric budget only
                    **({} if m.rel_l2 is None else {"rel_l2": m.rel_l2}),
                }
                for m in self.measured
            ],
        }


def _entry_from_json(doc: Any, where: str) -> ResultEntry:
    def need(obj: Any, key: str, kinds: tuple[type, ...], optional: bool = False) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise ResultsFileError(f"{where}: missing field {key!r}")
        value = obj[key]
        if value is None and optional:
            return None
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ResultsFileError(f"{where}.{key}: unexpected value {value!r}"[:300])
        return value

    def count(obj: Any, key: str, low: int, optional: bool = False, at: str = "") -> Any:
        # issue 20, 14: impossible numbers are refused, not measured against
        value = need(obj, key, (int,), optional)
        if value is not None and not low <= value <= MAX_RESULTS_COUNT:
            raise ResultsFileError(
                f"{where}{at}.{key}: {value} is impossible (expected {low} to {MAX_RESULTS_COUNT})"
            )
        return value

    platform = need(doc, "platform", (dict,))
    measured = []
    for i, m in enumerate(need(doc, "measurements", (list,))):
        at = f".measurements[{i}]"
        deviation = need(m, "deviation", (int, float), optional=True)
        if deviation is not None and not (
            isinstance(deviation, float | int)
            and abs(deviation) <= 1e300
            and math.isfinite(deviation)
            and deviation >= 0
        ):
            raise ResultsFileError(
                f"{where}{at}.deviation: {str(deviation)[:40]} is impossible (a relative "
                f"deviation is a finite number, at least 0)"
            )
        rel_l2 = None
        if isinstance(m, dict) and m.get("rel_l2") is not None:  # issue 34
            rel_l2 = need(m, "rel_l2", (int, float))
            if not (math.isfinite(rel_l2) and rel_l2 >= 0):
                raise ResultsFileError(
                    f"{where}{at}.rel_l2: {str(rel_l2)[:40]} is impossible (a relative L2 "
                    f"error is a finite number, at least 0)"
                )
        measured.append(
            Measured(
                Backend.parse(need(m, "candidate", (str,))),
                count(m, "median_ns", 0, optional=True, at=at),
                count(m, "spread_ns", 0, optional=True, at=at),
                None if deviation is None else float(deviation),
                need(m, "error", (str,), optional=True),
                None if rel_l2 is None else float(rel_l2),
            )
        )
    if not measured:
        raise ResultsFileError(f"{where}.measurements: empty (the incumbent comes first)")
    incumbent = Backend.parse(need(doc, "incumbent", (str,)))
    if measured[0].candidate != incumbent:
        raise ResultsFileError(
            f"{where}.measurements[0]: {measured[0].candidate.name!r} is not the incumbent "
            f"{incumbent.name!r} (the incumbent is measured first)"
        )
    no_kernel = need(doc, "no_kernel", (dict,))
    named = [m.candidate.name for m in measured] + [Backend.parse(k).name for k in no_kernel]
    twice = sorted({n for n in named if named.count(n) > 1})
    if twice:
        raise ResultsFileError(
            f"{where}: candidate {twice[0]!r} appears twice (in measurements or no_kernel); "
            f"each backend is measured once"
        )
    return ResultEntry(
        platform=platform,
        call=need(doc, "call", (str,)),
        incumbent=incumbent,
        measured=tuple(measured),
        # sorted by name: Backend values do not order (two no_kernel entries failed to sort)
        no_kernel=tuple(
            sorted(
                ((Backend.parse(k), str(v)) for k, v in no_kernel.items()),
                key=lambda item: item[0].name,
            )
        ),
        warmup=count(doc, "warmup", 0),
        repeats=count(doc, "repeats", 1),
    )


def read_results(path: str | os.PathLike[str]) -> tuple[ResultEntry, ...]:
    """Read a results file (bounded); :class:`ResultsFileError` says what is wrong."""
    source = os.fspath(path)
    try:
        doc = read_json(source, what="results file", limit=MAX_RESULTS_BYTES)
    except OSError as exc:
        raise ResultsFileError(
            f"{source}: cannot read the autotune results: {exc.strerror or exc}"
        ) from None
    except ValueError as exc:
        raise ResultsFileError(f"{source}: not an attnres autotune results file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != RESULTS_FORMAT:
        raise ResultsFileError(
            f'{source}: not an attnres autotune results file (no "format": "{RESULTS_FORMAT}")'
        )
    version = doc.get("version")
    if version != RESULTS_VERSION:
        raise ResultsFileError(
            f"{source}: autotune results version {version!r}; this attnres reads version "
            f"{RESULTS_VERSION}"
        )
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise ResultsFileError(f"{source}: $.entries: expected a list")
    if len(entries) > MAX_RESULTS_ENTRIES:
        raise ResultsFileError(
            f"{source}: {len(entries)} entries, more than the {MAX_RESULTS_ENTRIES} attnres reads"
        )
    out = []
    for i, item in enumerate(entries):
        try:
            out.append(_entry_from_json(item, f"{source}: $.entries[{i}]"))
        except ValueError as exc:  # an unknown backend name, a bad field
            raise ResultsFileError(str(exc) if source in str(exc) else f"{source}: {exc}") from None
    return tuple(out)


def write_results(path: str | os.PathLike[str], entries: Iterable[ResultEntry]) -> Path:
    """Write ``entries``, merged into an existing results file at ``path``.

    Entries of the file for other platforms or calls are kept; an entry for the
    same platform and call is replaced. A file at ``path`` that is not an
    attnres results file is never overwritten (:class:`ResultsFileError`).
    """
    target = Path(path)
    new = list(entries)
    # issue 20, 6: processes sharing one file take turns, so none loses another's entries
    with exclusive_lock(target):
        merged: dict[tuple[str, str], ResultEntry] = {}
        if os.path.lexists(target):
            for old in read_results(target):  # refuses what is not ours
                merged[(old.platform_key, old.call)] = old
        for entry in new:
            merged[(entry.platform_key, entry.call)] = entry
        kept = list(merged.values())[-MAX_RESULTS_ENTRIES:]
        doc = {
            "format": RESULTS_FORMAT,
            "version": RESULTS_VERSION,
            "entries": [e.to_json() for e in sorted(kept, key=lambda e: (e.platform_key, e.call))],
        }
        atomic_write_text(target, canonical_json(doc))
    return target


def entry_applies(
    entry: ResultEntry, incumbent: Backend, candidates: Sequence[Backend], here: Mapping[str, Any]
) -> str | None:
    """Why a stored measurement does not apply to this decision (``None``: it does)."""
    mismatch = facts_mismatch(entry.platform, here)
    if mismatch is not None:
        return mismatch
    if entry.incumbent != incumbent:
        return (
            f"measured against incumbent {entry.incumbent.name!r}, this decision's is "
            f"{incumbent.name!r}"
        )
    stored = [m.candidate for m in entry.measured[1:]] + [b for b, _ in entry.no_kernel]
    if sorted(b.name for b in stored) != sorted(b.name for b in candidates):
        return (
            "measured candidates "
            + (", ".join(sorted(b.name for b in stored)) or "none")
            + ", this decision's are "
            + (", ".join(sorted(b.name for b in candidates)) or "none")
        )
    return None
