"""Shared infrastructure for ``make bench``.

Collection
    Benchmark files are named ``bench_*.py``; :func:`pytest_collect_file` below
    collects them (pyproject's ``testpaths = ["tests"]`` keeps them out of
    ``make test``). Inside a file, functions named ``test_*`` are benchmarks.
    ``make bench`` runs with ``--benchmark-only``, which skips every test that
    does not use pytest-benchmark's ``benchmark`` fixture: every benchmark test
    must request it (and should register its main measurement with it, so the
    numbers land in ``benchmarks/results/latest.json``).

Ratios and metrics: the ``ratios`` fixture
    SPEC 7 states performance as ratios measured side by side in one run (absolute
    times on shared machines are noise). Each benchmark records its rows::

        def test_something(benchmark, ratios, paired):
            r = paired(lambda: mine(x), lambda: reference(x), rounds=60, inner=50)
            ratios.record("mine vs reference", r.ratio, target=1.05, note=r.describe())
            ratios.record("scan rate", 1234.5, unit="files/s", target=1000,
                          higher_is_better=True)
            ratios.record("peer dispatcher", None, note="diffusers not installed")

    ``target`` is an upper bound by default (a ratio must not exceed it);
    ``higher_is_better=True`` makes it a lower bound (throughput). No target: the
    row is informational. ``None`` as the value: the measurement was skipped and
    ``note`` says why. One table of every row is printed at the end of the run,
    and the rows are added to the benchmark JSON under ``"attnres_ratios"``.
    A missed target does not fail the run unless ``--bench-enforce`` is given
    (shared machines are noisy; CI on a quiet runner can enforce).

Paired timing: :func:`paired` (also the ``paired`` fixture)
    Alternates A and B (in a per-round random order, seeded), times each with
    ``time.perf_counter_ns`` over ``inner`` calls, discards warm-up rounds, and
    returns the ratio of the medians (A / B) with both medians. Garbage
    collection is off while timing, as in ``timeit``.

Threads: the session sets ``torch.set_num_threads(1)`` (SPEC 7 measures the layer
on one CPU thread) when torch is importable, and restores it afterwards.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CLOCKS: dict[str, Callable[[], int]] = {
    "wall": time.perf_counter_ns,
    "thread": time.thread_time_ns,
}


# =============================================================================
# Collection: bench_*.py
# =============================================================================


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    # A file named on the command line is collected by pytest itself already.
    if parent.session.isinitpath(file_path):
        return None
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        module: pytest.Module = pytest.Module.from_parent(parent, path=file_path)
        return module
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench-clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="the clock of the paired fixture: wall (time.perf_counter_ns, the default) or "
        "thread (time.thread_time_ns: steadier on a loaded machine, single-threaded code only)",
    )
    parser.addoption(
        "--bench-enforce",
        action="store_true",
        default=False,
        help="fail a benchmark whose recorded metric misses its target (default: report only)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # --benchmark-json / --benchmark-storage point into benchmarks/results/, which is
    # git-ignored: make sure it exists before pytest-benchmark writes there.
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for option in ("benchmark_json", "benchmark_storage"):
        value = config.getoption(option, default=None)
        if isinstance(value, (str, Path)):
            text = str(value)
            path = Path(text.removeprefix("file://"))
            target = path.parent if option == "benchmark_json" else path
            if "://" not in text or text.startswith("file://"):
                target.mkdir(parents=True, exist_ok=True)
    config.stash[_REGISTRY_KEY] = RatioRegistry(enforce=bool(config.getoption("bench_enforce")))


# =============================================================================
# The ratio registry
# =============================================================================


@dataclass(frozen=True)
class Row:
    """One recorded metric: a ratio (unit ``x``) or any other measured value."""

    name: str
    value: float | None
    target: float | None = None
    unit: str = "x"
    higher_is_better: bool = False
    note: str = ""
    test: str = ""

    @property
    def status(self) -> str:
        if self.value is None:
            return "skipped"
        if self.target is None:
            return "info"
        if self.higher_is_better:
            return "pass" if self.value >= self.target else "FAIL"
        return "pass" if self.value <= self.target else "FAIL"

    @property
    def passed(self) -> bool | None:
        status = self.status
        return None if status in ("skipped", "info") else status == "pass"

    def describe_value(self) -> str:
        return "-" if self.value is None else _fmt(self.value, self.unit)

    def describe_target(self) -> str:
        if self.target is None:
            return "-"
        return ("≥ " if self.higher_is_better else "≤ ") + _fmt(self.target, self.unit)


def _fmt(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.3f}x"
    if math.isfinite(value) and abs(value) >= 1000:
        return f"{value:,.0f} {unit}"
    return f"{value:.4g} {unit}"


class RatioRegistry:
    """Session-wide rows; the ``ratios`` fixture hands it to every benchmark."""

    def __init__(self, *, enforce: bool = False) -> None:
        self.rows: list[Row] = []
        self.enforce = enforce
        self._current_test = ""

    def record(
        self,
        name: str,
        value: float | None,
        target: float | None = None,
        note: str = "",
        *,
        unit: str = "x",
        higher_is_better: bool = False,
    ) -> Row:
        """Record one row; returns it. ``value=None`` records a skipped measurement."""
        if value is not None:
            value = float(value)
        row = Row(
            name=name,
            value=value,
            target=None if target is None else float(target),
            unit=unit,
            higher_is_better=higher_is_better,
            note=note,
            test=self._current_test,
        )
        self.rows.append(row)
        if self.enforce and row.passed is False:
            pytest.fail(
                f"{name}: {row.describe_value()} misses its target {row.describe_target()}"
                + (f" ({note})" if note else ""),
                pytrace=False,
            )
        return row

    def skip(self, name: str, note: str) -> Row:
        """Record that a measurement was not made, and why."""
        return self.record(name, None, note=note)

    def as_json(self) -> list[dict[str, Any]]:
        return [{**asdict(row), "status": row.status} for row in self.rows]

    def table(self) -> list[str]:
        headers = ("metric", "measured", "target", "status", "note")
        body = [
            (r.name, r.describe_value(), r.describe_target(), r.status, r.note) for r in self.rows
        ]
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers[:-1])]

        def line(cells: tuple[str, ...]) -> str:
            fixed = "  ".join(c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True))
            return f"{fixed}  {cells[-1]}".rstrip()

        rule = "  ".join("-" * w for w in widths) + "  ----"
        return [line(headers), rule, *(line(row) for row in body)]


_REGISTRY_KEY = pytest.StashKey[RatioRegistry]()


@pytest.fixture
def ratios(request: pytest.FixtureRequest) -> Iterator[RatioRegistry]:
    """The session's :class:`RatioRegistry` (rows are tagged with the test's id)."""
    registry = request.config.stash[_REGISTRY_KEY]
    registry._current_test = request.node.nodeid
    try:
        yield registry
    finally:
        registry._current_test = ""


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    registry = config.stash.get(_REGISTRY_KEY, None)
    if registry is None or not registry.rows:
        return
    clock = config.getoption("bench_clock")
    terminalreporter.write_sep(
        "=", f"attnres benchmark summary (ratios: lower is better; paired clock: {clock})"
    )
    for text in registry.table():
        terminalreporter.write_line(text)
    failed = [r for r in registry.rows if r.passed is False]
    if failed:
        terminalreporter.write_line(
            f"{len(failed)} metric(s) missed their target"
            + ("" if registry.enforce else " (report only; --bench-enforce makes them fail)")
        )


def pytest_benchmark_update_json(
    config: pytest.Config, benchmarks: Any, output_json: dict[str, Any]
) -> None:
    registry = config.stash.get(_REGISTRY_KEY, None)
    if registry is not None:
        output_json["attnres_ratios"] = registry.as_json()


# =============================================================================
# Paired, interleaved timing
# =============================================================================


@dataclass(frozen=True)
class PairedResult:
    """A / B timed side by side: per-call nanoseconds of every kept round."""

    median_a_ns: float
    median_b_ns: float
    samples_a_ns: tuple[float, ...] = field(repr=False)
    samples_b_ns: tuple[float, ...] = field(repr=False)
    rounds: int
    inner: int

    @property
    def ratio(self) -> float:
        """median(A) / median(B): how much A costs relative to B."""
        return self.median_a_ns / self.median_b_ns

    @property
    def min_ratio(self) -> float:
        """min(A) / min(B): a cross-check that load on the machine can only inflate."""
        return min(self.samples_a_ns) / min(self.samples_b_ns)

    @property
    def round_ratio(self) -> float:
        """The median of the per-round ratios (a cross-check, robust to drift)."""
        return statistics.median(
            a / b for a, b in zip(self.samples_a_ns, self.samples_b_ns, strict=True)
        )

    def describe(self) -> str:
        return (
            f"A {_human_ns(self.median_a_ns)} vs B {_human_ns(self.median_b_ns)} per call "
            f"(medians of {self.rounds} rounds x {self.inner})"
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "ratio": self.ratio,
                "round_ratio": self.round_ratio,
                "min_ratio": self.min_ratio,
                "median_a_ns": self.median_a_ns,
                "median_b_ns": self.median_b_ns,
                "rounds": self.rounds,
                "inner": self.inner,
            }
        )


def _human_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.3g} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.3g} µs"
    return f"{ns:.3g} ns"


def _time_once(fn: Callable[[], object], inner: int, counter: Callable[[], int]) -> float:
    start = counter()
    for _ in range(inner):
        fn()
    return (counter() - start) / inner


def paired(
    fn_a: Callable[[], object],
    fn_b: Callable[[], object],
    *,
    rounds: int,
    inner: int,
    warmup: int | None = None,
    seed: int = 0,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> PairedResult:
    """Time ``fn_a`` and ``fn_b`` interleaved; ``.ratio`` is median(A) / median(B).

    Every round times A and B once each (``inner`` calls), in a random order drawn
    from ``seed``, so drift (frequency scaling, a noisy neighbour) hits both
    sides alike. ``warmup`` rounds (default: a tenth, at least 2) run first and
    are discarded. Garbage collection is disabled while timing.

    ``clock`` is ``time.perf_counter_ns`` (wall time). On a shared, loaded
    machine ``time.thread_time_ns`` (this thread's CPU time, which leaves out the
    time the thread was descheduled) gives steadier ratios for single-threaded
    code; it is only meaningful when A and B run on the calling thread.
    """
    if rounds < 1 or inner < 1:
        raise ValueError("rounds and inner must be at least 1")
    warm = max(2, rounds // 10) if warmup is None else warmup
    order = random.Random(seed)
    a: list[float] = []
    b: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for index in range(warm + rounds):
            if order.random() < 0.5:
                ta = _time_once(fn_a, inner, clock)
                tb = _time_once(fn_b, inner, clock)
            else:
                tb = _time_once(fn_b, inner, clock)
                ta = _time_once(fn_a, inner, clock)
            if index >= warm:
                a.append(ta)
                b.append(tb)
    finally:
        if gc_was_enabled:
            gc.enable()
    return PairedResult(
        median_a_ns=statistics.median(a),
        median_b_ns=statistics.median(b),
        samples_a_ns=tuple(a),
        samples_b_ns=tuple(b),
        rounds=rounds,
        inner=inner,
    )


@pytest.fixture(name="paired")
def _paired_fixture(request: pytest.FixtureRequest) -> Callable[..., PairedResult]:
    """:func:`paired` with the clock chosen by ``--bench-clock`` (no conftest import needed)."""
    clock = CLOCKS[request.config.getoption("bench_clock")]
    return functools.partial(paired, clock=clock)


# =============================================================================
# Threads
# =============================================================================


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """SPEC 7 measures on one CPU thread; restored after the session."""
    try:
        import torch
    except ImportError:  # a benchmark that needs no torch still runs
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
