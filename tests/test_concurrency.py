"""Concurrency (SPEC 3.6, 7): 16 threads and 100 asyncio tasks resolving in
different component scopes at once, with one shared resolution cache (never
cleared in between) and one decision ledger.

Checked: no cross-talk (every resolution's component is its own scope's, and its
backend the one that scope's override asks for), no lost decisions (exact total
and per-component counts in ``attnres.decisions()``), no scope leaking across
threads, tasks or raised exceptions, and a ledger and a cache that agree with
the machine. A ``threading.Barrier`` releases every thread at once.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import attnres
from attnres import LayerSpec, Platform, Role, component_scope, resolve
from attnres import machine as M
from attnres.scope import current_scope
from attnres.trace import TraceInput

CPU = Platform.simulate("cpu")
LAYERS = (
    LayerSpec(64, "float32", name="attn1"),
    LayerSpec(64, "float32", role=Role.CROSS, name="attn2"),
    LayerSpec(128, "float16", name="attn3"),
    LayerSpec(80, "bfloat16", role=Role.CROSS, name="attn4"),
)
THREADS = 16
ROUNDS = 40  # resolutions per thread in its own scope
INNER_EVERY = 8  # every 8th round also resolves in a nested scope that raises
TASKS = 100
TASK_ROUNDS = 6


def _override(index: int) -> dict[str, Any]:
    """component_scope keyword arguments for the index-th component."""
    backend = (None, "torch_sdpa", "eager")[index % 3]
    roles = {"cross": "eager"} if index % 4 == 0 else None
    return {"backend": backend, "role_backends": roles}


def _expected(index: int, layer: LayerSpec) -> str:
    args = _override(index)
    if layer.role is Role.CROSS and args["role_backends"]:
        return str(args["role_backends"]["cross"])
    return str(args["backend"] or "torch_sdpa")  # cpu's chain: torch_sdpa


class _Boom(Exception):
    pass


class _Log:
    """What the workers did: per-component counts and the (scope, layer) inputs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.inputs: set[tuple[Any, LayerSpec]] = set()
        self.errors: list[BaseException] = []

    def add(self, scope: Any, layer: LayerSpec) -> None:
        with self.lock:
            self.counts[scope.component] += 1
            self.inputs.add((scope, layer))


def _resolve_here(name: str, index: int, layer: LayerSpec, log: _Log) -> None:
    res = resolve(layer, platform=CPU)
    scope = current_scope()
    assert scope is not None and scope.component == name, (name, scope)
    assert res.component == name, (name, res.component)
    assert res.layer == layer.name
    assert res.backend.name == _expected(index, layer), (name, layer, res)
    assert res.trace.input.scope == scope
    log.add(scope, layer)


def _inner_raises(name: str, log: _Log, j: int) -> None:
    inner = f"{name}.inner"
    try:
        with component_scope(inner, kind="vae"):
            layer = LAYERS[j % len(LAYERS)]
            res = resolve(layer, platform=CPU)
            scope = current_scope()
            assert scope is not None and scope.component == inner
            assert res.component == inner and res.backend.name == "torch_sdpa"
            log.add(scope, layer)
            raise _Boom(inner)
    except _Boom as exc:
        assert str(exc) == inner
    # the enclosing scope is back
    assert current_scope() is not None
    assert current_scope().component == name  # type: ignore[union-attr]


def _thread_component(i: int) -> tuple[str, int]:
    index = i % (THREADS // 2)  # two threads per component: shared cache keys
    return f"text_encoder_{index}", index


def _thread_work(i: int, barrier: threading.Barrier, log: _Log) -> None:
    name, index = _thread_component(i)
    try:
        assert current_scope() is None  # a new thread starts outside every scope
        with component_scope(name, **_override(index)):
            barrier.wait(timeout=60)  # every thread is inside its scope: go
            for j in range(ROUNDS):
                _resolve_here(name, index, LAYERS[(i + j) % len(LAYERS)], log)
                if j % INNER_EVERY == 0:
                    _inner_raises(name, log, j)
        assert current_scope() is None
    except BaseException as exc:  # pragma: no cover - reported by the test
        with log.lock:
            log.errors.append(exc)
        barrier.abort()


async def _task_work(i: int, log: _Log) -> str:
    index = 100 + i % 20  # five tasks per component
    name = f"vae_{index}"
    outer = current_scope()
    with component_scope(name, **_override(index)):
        for j in range(TASK_ROUNDS):
            await asyncio.sleep(0)  # let every other task run in between
            _resolve_here(name, index, LAYERS[(i + j) % len(LAYERS)], log)

        # a child task inherits this scope; its own scope does not come back
        async def child() -> None:
            assert current_scope().component == name  # type: ignore[union-attr]
            with component_scope(f"{name}.child", kind="vae"):
                await asyncio.sleep(0)
                assert current_scope().component == f"{name}.child"  # type: ignore[union-attr]

        await asyncio.create_task(child())
        assert current_scope().component == name  # type: ignore[union-attr]
        if i % 10 == 0:
            _inner_raises(name, log, i)
    assert current_scope() is outer
    return name


async def _all_tasks(log: _Log) -> list[str]:
    with component_scope("pipeline", require_selection=False) as outer:
        names = await asyncio.gather(*(_task_work(i, log) for i in range(TASKS)))
        assert current_scope() is outer.state  # no task's scope leaked into the parent
    assert current_scope() is None
    return list(names)


def _check_ledger_and_cache(log: _Log) -> None:
    assert not log.errors, log.errors
    decisions = attnres.decisions()
    # no lost decisions: exact total, exact per component
    assert len(decisions) == sum(log.counts.values())
    assert Counter(d.component for d in decisions) == log.counts
    # the ledger agrees with the traces it holds
    for d in decisions:
        outcome = d.trace.outcome
        assert d.trace.input.scope is not None
        assert d.component == d.trace.input.scope.component
        assert d.backend == outcome.backend.name  # type: ignore[union-attr]
        assert d.origin == str(outcome.origin)
        assert d.reason == outcome.reason
    # the cache holds exactly one entry per distinct input, each the machine's answer
    config = M.selection_config()
    assert set(M._CACHE) == {
        (layer, config, scope, CPU, None, None) for scope, layer in log.inputs
    }
    assert M.cache_info()["size"] <= M.cache_info()["max_size"]
    for key, (resolution, decision, trace) in M._CACHE.items():
        assert trace == M.run_machine(TraceInput(*key))
        assert resolution is not None and resolution.trace is trace
        assert decision.trace is trace
        assert decision.component == key[2].component  # type: ignore[union-attr]


@pytest.fixture(autouse=True)
def _no_leak_into_the_test() -> Iterator[None]:
    assert current_scope() is None
    # switch threads every few microseconds instead of every 5 ms: far more
    # interleavings inside resolve(), the cache and the ledger
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
    assert current_scope() is None


def _start_threads(log: _Log, parties: int) -> tuple[list[threading.Thread], threading.Barrier]:
    barrier = threading.Barrier(parties)
    threads = [
        threading.Thread(target=_thread_work, args=(i, barrier, log), name=f"resolver-{i}")
        for i in range(THREADS)
    ]
    for t in threads:
        t.start()
    return threads, barrier


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), t.name


def test_16_threads_resolve_in_their_own_scopes() -> None:
    log = _Log()
    threads, barrier = _start_threads(log, THREADS + 1)
    with component_scope("main_thread", require_selection=False) as mine:
        barrier.wait(timeout=60)
        assert current_scope() is mine.state  # the main thread sees only its own scope
    _join(threads)
    _check_ledger_and_cache(log)
    assert len(log.counts) == THREADS // 2 * 2  # 8 components and their inner scopes
    per_thread = ROUNDS + len(range(0, ROUNDS, INNER_EVERY))
    assert sum(log.counts.values()) == THREADS * per_thread


def test_100_asyncio_tasks_resolve_in_their_own_scopes() -> None:
    log = _Log()
    names = asyncio.run(_all_tasks(log))
    assert len(names) == TASKS
    _check_ledger_and_cache(log)
    inner = sum(1 for i in range(TASKS) if i % 10 == 0)
    assert sum(log.counts.values()) == TASKS * TASK_ROUNDS + inner


def test_threads_and_tasks_at_once_with_a_warm_shared_cache() -> None:
    """Both at once, twice over the same inputs: the second pass runs on cache hits
    made by other threads and tasks (the cache is never cleared in between)."""
    log = _Log()
    for _ in range(2):
        threads, barrier = _start_threads(log, THREADS + 1)
        barrier.wait(timeout=60)  # the threads start; the event loop runs beside them
        asyncio.run(_all_tasks(log))
        _join(threads)
    _check_ledger_and_cache(log)
    per_thread = ROUNDS + len(range(0, ROUNDS, INNER_EVERY))
    inner = sum(1 for i in range(TASKS) if i % 10 == 0)
    assert sum(log.counts.values()) == 2 * (THREADS * per_thread + TASKS * TASK_ROUNDS + inner)
