"""SPEC 7: the resolver's own costs, as ratios measured side by side (and metrics).

(a) a cache hit -- ``attnres.resolve(layer, config=..., platform=...)`` on an input
    already resolved -- vs a plain dict lookup: a Python function that returns
    ``d[key]`` where ``key`` is the same 7-tuple ``(layer, config, scope,
    platform, backend, request, needs_kernel)`` the cache uses, so the tuple is
    hashed on every call (its items cache their own hashes, as in the real
    cache). Target: at most 10x.
(b) a cold resolution (``attnres.clear_cache()`` then ``attnres.resolve``) with
    structlog JSON audit logging at INFO written to a null stream, vs the same with
    logging off (structlog reset to unconfigured, the stdlib ``attnres`` logger at
    WARNING). Target: at most 1.5x.
(c) replaying the golden corpus (``attnres.replay`` over every ``traces/*.json``):
    files per second (target: at least 100 files/s).
(d) memory: bytes of canonical JSON per resolution (mean over the corpus), and
    the approximate memory of the resolution cache when full (``_CACHE_MAX``
    distinct entries, measured with ``tracemalloc``).

Every benchmark leaves structlog, the ``attnres`` stdlib logger, the resolution
cache and the decision ledger as it found them (the ``_quiet_and_restored``
fixture).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import structlog
from structlog.processors import JSONRenderer, TimeStamper, add_log_level
from structlog.testing import capture_logs

import attnres
from attnres import runtime
from attnres.ledger import record_decision
from attnres.trace import canonical_json, trace_to_dict

if TYPE_CHECKING:
    from conftest import PairedResult, RatioRegistry

    Paired = Callable[..., PairedResult]

ROOT = Path(__file__).resolve().parent.parent
TRACES = sorted((ROOT / "traces").glob("*.json"))
STDLIB_LOGGER = logging.getLogger("attnres")

# The seed incident's audio-VAE layer under `--attention-backend sage_attn`: the
# global flag falls back to the layer default (17 trace records).
PLATFORM = attnres.Platform.simulate("cuda:sm90+all")
CONFIG = attnres.SelectionConfig(global_backend="sage_attn")
LAYER = attnres.LayerSpec(
    head_size=128,
    dtype="bfloat16",
    supported={"fa", "torch_sdpa"},
    default="torch_sdpa",
    name="decoder.mid.attn",
)


def _resolve() -> attnres.Resolution:
    return attnres.resolve(LAYER, config=CONFIG, platform=PLATFORM)


def _logging_off() -> None:
    """structlog unconfigured (attnres then uses the stdlib logger) at WARNING."""
    structlog.reset_defaults()
    STDLIB_LOGGER.setLevel(logging.WARNING)


def _logging_on(stream: Any) -> None:
    """A production JSON audit log at INFO, written to ``stream``."""
    structlog.configure(
        processors=[add_log_level, TimeStamper(fmt="iso"), JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )


@pytest.fixture(autouse=True)
def _quiet_and_restored() -> Iterator[None]:
    """Logging off during the benchmark; structlog, logging, cache and ledger restored."""
    was_configured = structlog.is_configured()
    saved_config = structlog.get_config()
    saved_level = STDLIB_LOGGER.level
    saved_ledger = attnres.decisions()
    _logging_off()
    assert not structlog.is_configured(), "structlog.reset_defaults() left it configured"
    attnres.clear_cache()
    try:
        yield
    finally:
        if was_configured:
            structlog.configure(**saved_config)
        else:
            structlog.reset_defaults()
        STDLIB_LOGGER.setLevel(saved_level)
        attnres.clear_cache()
        attnres.clear_decisions()
        for decision in saved_ledger:  # put back what earlier code had recorded
            record_decision(decision)


def _record_pair(
    ratios: RatioRegistry, name: str, result: PairedResult, target: float | None, what: str
) -> None:
    ratios.record(
        name,
        result.ratio,
        target=target,
        note=(
            f"{what}; {result.describe()}; per-round median {result.round_ratio:.3f}x, "
            f"ratio of minima {result.min_ratio:.3f}x"
        ),
    )


def _chunked(
    paired: Paired,
    fn_a: Callable[[], object],
    fn_b: Callable[[], object],
    *,
    chunks: int,
    rounds: int,
    inner: int,
    between: Callable[[], None],
) -> PairedResult:
    """``paired`` run ``chunks`` times with ``between()`` outside the timed region;
    the samples of every chunk are pooled into one result."""
    results = []
    for chunk in range(chunks):
        between()
        results.append(paired(fn_a, fn_b, rounds=rounds, inner=inner, seed=chunk))
    between()
    a = tuple(s for r in results for s in r.samples_a_ns)
    b = tuple(s for r in results for s in r.samples_b_ns)
    return dataclasses.replace(
        results[0],
        median_a_ns=statistics.median(a),
        median_b_ns=statistics.median(b),
        samples_a_ns=a,
        samples_b_ns=b,
        rounds=len(a),
    )


# =============================================================================
# (a) a cache hit vs a plain dict lookup
# =============================================================================


def test_cache_hit_vs_dict_lookup(benchmark: Any, ratios: RatioRegistry, paired: Paired) -> None:
    first = _resolve()
    # resolve()'s cache key, outside a scope
    key = (LAYER, CONFIG, None, PLATFORM, None, None, False)
    assert key in runtime._CACHE, "the reference must use the key the cache uses"
    plain = {key: runtime._CACHE[key]}

    def dict_lookup() -> object:
        return plain[key]

    assert _resolve() is first  # a hit returns the cached Resolution
    inner = 500
    # The ledger gains one entry per hit; it is cleared between chunks, untimed.
    result = _chunked(
        paired,
        _resolve,
        dict_lookup,
        chunks=8,
        rounds=25,
        inner=inner,
        between=attnres.clear_decisions,
    )
    _record_pair(
        ratios,
        "cache hit: resolve() / plain dict lookup",
        result,
        10.0,
        "B = a function returning d[key], key the cache's 7-tuple (hashed per call)",
    )
    benchmark.extra_info["ratio_vs_dict_lookup"] = result.ratio
    benchmark.extra_info["target"] = 10.0
    benchmark.pedantic(_resolve, rounds=50, iterations=inner, warmup_rounds=2)
    attnres.clear_decisions()


# =============================================================================
# (b) a cold resolution with JSON audit logging at INFO vs logging off
# =============================================================================


def test_cold_resolution_logging_overhead(
    benchmark: Any, ratios: RatioRegistry, paired: Paired
) -> None:
    null = open(os.devnull, "w")  # noqa: SIM115 - closed in finally
    state = {"on": False}

    def ensure(on: bool) -> None:
        # Switched at most once per timed batch of `inner` calls (A and B alternate
        # per round); both sides pay one switch per batch.
        if state["on"] is not on:
            if on:
                _logging_on(null)
            else:
                _logging_off()
            state["on"] = on

    def cold_logged() -> None:
        ensure(True)
        attnres.clear_cache()
        _resolve()

    def cold_silent() -> None:
        ensure(False)
        attnres.clear_cache()
        _resolve()

    try:
        # sanity: logging on writes one INFO event per cold resolution
        ensure(True)
        with capture_logs() as events:
            cold_logged()
        assert [e["log_level"] for e in events] == ["info"], events
        ensure(False)
        assert not structlog.is_configured()

        inner = 20
        result = _chunked(
            paired,
            cold_logged,
            cold_silent,
            chunks=6,
            rounds=20,
            inner=inner,
            between=attnres.clear_decisions,
        )
        switch = _time_switch(null)
        _record_pair(
            ratios,
            "cold resolution: JSON audit log at INFO / logging off",
            result,
            1.5,
            f"clear_cache()+resolve() both sides; one config switch per {inner}-call batch "
            f"(~{switch / 1e3:.1f} µs each)",
        )
        benchmark.extra_info["ratio_vs_logging_off"] = result.ratio
        benchmark.extra_info["target"] = 1.5
        ensure(True)
        benchmark.pedantic(cold_logged, rounds=30, iterations=inner, warmup_rounds=2)
    finally:
        _logging_off()
        null.close()
        attnres.clear_decisions()


def _time_switch(stream: Any) -> float:
    """Nanoseconds one on/off switch of the configuration costs (for the note)."""
    n = 50
    start = time.perf_counter_ns()
    for _ in range(n):
        _logging_on(stream)
        _logging_off()
    return (time.perf_counter_ns() - start) / (2 * n)


# =============================================================================
# (c) replaying the golden corpus
# =============================================================================


def _replay_corpus() -> int:
    for path in TRACES:
        result = attnres.replay(path)
        if not result.ok:
            raise AssertionError(result.diff)
    return len(TRACES)


def test_replay_golden_corpus(benchmark: Any, ratios: RatioRegistry) -> None:
    assert TRACES, "traces/ holds no golden trace"
    _replay_corpus()  # warm-up (and every file must replay cleanly)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        _replay_corpus()
        times.append(time.perf_counter() - start)
    rate = len(TRACES) / statistics.median(times)
    ratios.record(
        "replay golden corpus (load + run_machine + compare)",
        rate,
        target=100,
        unit="files/s",
        higher_is_better=True,
        note=f"{len(TRACES)} files of traces/, median of {len(times)} passes",
    )
    benchmark.extra_info["files"] = len(TRACES)
    benchmark.extra_info["files_per_second"] = rate
    benchmark.pedantic(_replay_corpus, rounds=5, iterations=1, warmup_rounds=1)


# =============================================================================
# (d) memory: canonical JSON per resolution, and the cache when full
# =============================================================================


def test_trace_json_bytes_per_resolution(benchmark: Any, ratios: RatioRegistry) -> None:
    traces = [attnres.load_trace(path) for path in TRACES]
    sizes = []
    for path, trace in zip(TRACES, traces, strict=True):
        text = canonical_json(trace_to_dict(trace))
        assert text.encode("utf-8") == path.read_bytes(), path  # golden files are canonical
        sizes.append(len(text.encode("utf-8")))
    mean = statistics.fmean(sizes)
    ratios.record(
        "canonical JSON per resolution (mean over the corpus)",
        mean,
        unit="bytes",
        note=f"{len(sizes)} traces; min {min(sizes):,} B, max {max(sizes):,} B",
    )
    biggest = traces[sizes.index(max(sizes))]
    benchmark.extra_info["mean_bytes"] = mean
    benchmark.pedantic(biggest.to_json, rounds=20, iterations=10, warmup_rounds=2)


def _distinct_layer(i: int) -> attnres.LayerSpec:
    return attnres.LayerSpec(
        head_size=8 * (1 + i % 32),
        dtype=("bfloat16", "float16", "float32")[i % 3],
        supported={"fa", "torch_sdpa"},
        default="torch_sdpa",
        name=f"blocks.{i}.attn",
    )


def _fill_cache(count: int) -> None:
    for i in range(count):
        attnres.resolve(_distinct_layer(i), config=CONFIG, platform=PLATFORM)


def test_cache_memory_when_full(benchmark: Any, ratios: RatioRegistry) -> None:
    size = runtime._CACHE_MAX
    attnres.clear_cache()
    attnres.clear_decisions()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        _fill_cache(size)
        attnres.clear_decisions()  # the ledger's own list is not the cache
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert runtime.cache_info()["size"] == size
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    per_entry = grown / size
    ratios.record(
        f"resolution cache when full ({size:,} entries)",
        grown / 2**20,
        unit="MiB",
        note=f"tracemalloc; about {per_entry / 1024:.1f} KiB per entry (key, Resolution, "
        f"Decision, Trace with its records)",
    )
    ratios.record("resolution cache per entry", per_entry, unit="bytes")
    # bounded: more distinct inputs never grow it past _CACHE_MAX
    _fill_cache(size + size // 4)
    assert runtime.cache_info()["size"] <= size
    attnres.clear_decisions()
    benchmark.extra_info["cache_bytes_when_full"] = grown
    benchmark.extra_info["cache_max"] = size

    def refill() -> None:
        attnres.clear_cache()
        _fill_cache(256)
        attnres.clear_decisions()

    benchmark.pedantic(refill, rounds=3, iterations=1, warmup_rounds=1)
