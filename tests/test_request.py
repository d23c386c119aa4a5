"""Selection contract v2, section 2: ``attnres.request_backend(module, backend)``."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import structlog
import torch
from torch import Tensor, nn

import attnres
from attnres import Attention, Platform, RequestBackendError, request_backend
from attnres import runtime as runtime_mod
from attnres.kernels import get_kernel, register_kernel, unregister_kernel

CPU = Platform.simulate("cpu")


class Denoiser(nn.Module):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Attention(4, 16, platform=CPU, name=f"blocks.{i}.attn1", **kwargs) for i in range(3)
        )

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, x, x)
        return x


def _x() -> Tensor:
    return torch.randn(1, 5, 4, 16)


def test_rule_request_backend_switches_every_layer_and_restores_them() -> None:
    model = Denoiser()
    attnres.bind(model)
    server = [layer.resolution for layer in model.blocks]
    ledger = attnres.decisions()
    x = _x()
    expected = model(x)
    with request_backend(model, "eager") as backend:
        assert backend.name == "eager"
        assert {layer.backend.name for layer in model.blocks} == {"eager"}  # type: ignore[union-attr]
        assert all(layer.kernel is get_kernel("eager") for layer in model.blocks)
        resolution = model.blocks[0].resolution
        assert resolution is not None and resolution.origin == "request"
        assert resolution.trace.input.request is not None  # traced like any resolution
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
    assert [layer.resolution for layer in model.blocks] == server
    assert all(layer.kernel is get_kernel("torch_sdpa") for layer in model.blocks)
    assert attnres.decisions() == ledger  # the ledger keeps the server's decisions


def test_rule_request_backend_restores_on_error() -> None:
    model = Denoiser()
    with pytest.raises(KeyError), request_backend(model, "eager"):
        raise KeyError("the request failed")
    assert {layer.backend.name for layer in model.blocks} == {"torch_sdpa"}  # type: ignore[union-attr]


def test_rule_request_backend_is_all_or_nothing() -> None:
    model = Denoiser()
    model.blocks[1] = Attention(4, 16, platform=CPU, name="pinned", supported={"torch_sdpa"})
    attnres.bind(model)
    with pytest.raises(RequestBackendError) as info, request_backend(model, "eager"):
        pytest.fail("the block must not run")
    error = info.value
    assert isinstance(error, ValueError)
    assert [label for label, _ in error.failures] == ["blocks.1 (pinned)"]
    assert "1 of 3 attention layer(s) cannot run it, so no layer was switched" in str(error)
    assert "not supported by this attention layer" in str(error)
    assert {layer.backend.name for layer in model.blocks} == {"torch_sdpa"}  # type: ignore[union-attr]


def test_rule_request_backend_caches_prepared_kernels_per_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = Denoiser()
    with request_backend(model, "eager"):
        pass
    lookups: list[object] = []
    real = runtime_mod.lookup

    def counting(*args: Any, **kwargs: Any) -> Any:
        lookups.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr("attnres.modules.lookup", counting)
    for _ in range(3):
        with request_backend(model, "eager"):
            model(_x())
    assert lookups == []  # the fast path: no resolution, no kernel lookup


def test_rule_request_backend_for_the_bound_backend_is_a_no_op() -> None:
    model = Denoiser()
    attnres.bind(model)
    before = [(layer.resolution, layer._run) for layer in model.blocks]
    with structlog.testing.capture_logs() as logs, request_backend(model, "torch_sdpa"):
        assert [(layer.resolution, layer._run) for layer in model.blocks] == before
    assert [e for e in logs if e.get("request")] == []
    structlog.reset_defaults()


def test_rule_request_backend_switch_and_restore_are_audit_events() -> None:
    model = Denoiser()
    attnres.bind(model)
    with structlog.testing.capture_logs() as logs, request_backend(model, "eager"):
        pass
    structlog.reset_defaults()
    events = [
        (e["event"], e["backend"], e["layers"], e["previous"]) for e in logs if e.get("request")
    ]
    assert events == [
        ("attention backend switched for request", "eager", 3, "torch_sdpa"),
        ("attention backend restored after request", "eager", 3, "torch_sdpa"),
    ]


def test_rule_request_backend_refused_without_an_attnres_layer() -> None:
    with (
        pytest.raises(RequestBackendError, match=r"holds no attnres\.Attention layer"),
        request_backend(nn.Linear(2, 2), "eager"),
    ):
        pass
    with (
        pytest.raises(TypeError, match=r"torch\.nn\.Module"),
        request_backend("model", "eager"),  # type: ignore[arg-type]
    ):
        pass


def test_rule_request_backend_refused_for_a_sparse_bound_backend() -> None:
    def tile(
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None
    ) -> Tensor:
        return q

    register_kernel("sliding_tile_attn", tile)
    try:
        layer = Attention(
            8,
            128,
            dtype="bf16",
            backend="sliding_tile_attn",
            platform=Platform.simulate("cuda:sm90+all"),
            name="attn1",
        )
        with (
            pytest.raises(RequestBackendError, match="runs the sparse backend"),
            request_backend(layer, "torch_sdpa"),
        ):
            pass
        assert layer.backend is not None and layer.backend.name == "sliding_tile_attn"
    finally:
        unregister_kernel("sliding_tile_attn")


def test_rule_request_backend_refused_inside_torch_compile() -> None:
    model = Denoiser()
    attnres.bind(model)

    def step(x: Tensor) -> Tensor:
        with request_backend(model, "eager"):
            out: Tensor = model(x)
        return out

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    # where dynamo traces into a contextlib context manager (torch 2.13), attnres's
    # check sees the trace and refuses; where it cannot (torch 2.6), dynamo refuses
    # request_backend itself, before any of it runs: refused either way, never baked in
    refusal = (
        r"inside torch\.compile'd code"
        if _dynamo_traces_context_managers()
        else r"skip function request_backend"
    )
    with pytest.raises(Exception, match=refusal):
        compiled(_x())
    torch._dynamo.reset()
    assert {layer.backend.name for layer in model.blocks} == {"torch_sdpa"}  # type: ignore[union-attr]


def _dynamo_traces_context_managers() -> bool:
    """Whether this torch's dynamo traces into a ``@contextmanager`` function
    under ``fullgraph=True`` (observed, not read from the version)."""
    from contextlib import contextmanager

    @contextmanager
    def nothing() -> Any:
        yield

    def add_one(x: Tensor) -> Tensor:
        with nothing():
            return x + 1

    try:
        torch.compile(add_one, backend="eager", fullgraph=True)(torch.ones(2))
    except Exception:
        return False
    finally:
        torch._dynamo.reset()
    return True


def test_rule_request_backend_binds_pending_layers_first() -> None:
    model = Denoiser()
    assert all(layer.pending for layer in model.blocks)
    with request_backend(model, "eager"):
        pass
    assert not any(layer.pending for layer in model.blocks)
    assert [d.backend for d in attnres.decisions()] == ["torch_sdpa"] * 3


def test_rule_request_backend_follows_the_thread_each_thread_sees_its_own() -> None:
    model = Denoiser()
    attnres.bind(model)
    entered, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def other() -> None:
        with request_backend(model, "flex_attention"):
            entered.set()
            release.wait(10)
            seen.append(model.blocks[0].backend.name)  # type: ignore[union-attr]
            model(_x())

    with request_backend(model, "eager"):
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(10)
        assert model.blocks[0].backend.name == "eager"  # type: ignore[union-attr]
        with request_backend(model, "flex_attention"):  # nesting in one thread is fine
            assert model.blocks[0].backend.name == "flex_attention"  # type: ignore[union-attr]
        assert model.blocks[0].backend.name == "eager"  # type: ignore[union-attr]
    release.set()
    thread.join()
    assert seen == ["flex_attention"]
    assert {layer.backend.name for layer in model.blocks} == {"torch_sdpa"}  # type: ignore[union-attr]


def test_rule_request_backend_second_thread_same_backend_survives_the_first_exit() -> None:
    """Issue 20 item 12: a second request for the backend the first already switched
    to was a silent no-op, undone when the first exited."""
    model = Denoiser()
    attnres.bind(model)
    first_in, first_out = threading.Event(), threading.Event()
    seen: list[str] = []

    def second() -> None:
        assert first_in.wait(10)
        with request_backend(model, "eager"):
            assert first_out.wait(10)  # the first request has exited meanwhile
            seen.append(model.blocks[0].backend.name)  # type: ignore[union-attr]
            seen.append(str(model.blocks[0].kernel is get_kernel("eager")))

    thread = threading.Thread(target=second)
    thread.start()
    with request_backend(model, "eager"):
        first_in.set()
        time_limit = threading.Event()
        time_limit.wait(0.2)  # let the second thread enter its block
    first_out.set()
    thread.join()
    assert seen == ["eager", "True"]


def test_rule_request_backend_asyncio_tasks_exiting_out_of_order_leak_nothing() -> None:
    model = Denoiser()
    attnres.bind(model)
    x = _x()

    async def serve(
        backend: str, enter: asyncio.Event, leave: asyncio.Event, entered: asyncio.Event
    ) -> str:
        await enter.wait()
        with request_backend(model, backend):
            entered.set()
            await leave.wait()
            model(x)
            return model.blocks[0].backend.name  # type: ignore[union-attr]

    async def main() -> list[str]:
        a_enter, a_leave, a_in = asyncio.Event(), asyncio.Event(), asyncio.Event()
        b_enter, b_leave, b_in = asyncio.Event(), asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(serve("eager", a_enter, a_leave, a_in))
        b = asyncio.create_task(serve("flex_attention", b_enter, b_leave, b_in))
        a_enter.set()
        await a_in.wait()
        b_enter.set()
        await b_in.wait()
        a_leave.set()  # a entered first and exits first: out of order for a stack
        first = await a
        b_leave.set()
        return [first, await b]

    assert asyncio.run(main()) == ["eager", "flex_attention"]
    assert {layer.backend.name for layer in model.blocks} == {"torch_sdpa"}  # type: ignore[union-attr]
    torch.testing.assert_close(
        model(x), model.blocks[2](*(3 * [model.blocks[1](*(3 * [model.blocks[0](x, x, x)]))]))
    )


def test_rule_request_backend_cast_inside_the_block_keeps_the_request_and_no_stale_decision() -> (
    None
):
    """Issue 20 item 12: a cast inside the block lost the request, and the exit
    bound the stale (pre-cast) decision again."""
    model = Denoiser(dtype="float32")
    with request_backend(model, "eager"):
        model.double()
        assert {layer.backend.name for layer in model.blocks} == {"eager"}  # type: ignore[union-attr]
        out = model(_x().double())
        assert out.dtype == torch.float64
        resolution = model.blocks[0].resolution
        assert resolution is not None and resolution.trace.input.layer.dtype == "float64"
    for layer in model.blocks:
        assert layer.backend.name == "torch_sdpa"  # type: ignore[union-attr]
        assert layer.resolution.trace.input.layer.dtype == "float64"  # type: ignore[union-attr]
    ledger = [d for d in attnres.decisions() if d.layer and d.layer.startswith("blocks.")]
    assert [d.trace.input.layer.dtype for d in ledger] == ["float64"] * 3
    assert model(_x().double()).dtype == torch.float64


def test_rule_request_backend_refused_on_a_torch_compiled_module() -> None:
    """Issue 23 item 4: the compiled graph would keep the kernel it was traced with."""
    model = Denoiser()
    attnres.bind(model)
    compiled = torch.compile(model, backend="eager")
    with (
        pytest.raises(RuntimeError, match=r"torch\.compile wrapper.*cannot switch it"),
        request_backend(compiled, "eager"),
    ):
        pytest.fail("the block must not run")
    model.blocks[1].compile(backend="eager")
    with (
        pytest.raises(RuntimeError, match=r"'blocks\.1' was compiled with Module\.compile"),
        request_backend(model, "eager"),
    ):
        pytest.fail("the block must not run")
    torch._dynamo.reset()
    assert {layer.backend.name for layer in model.blocks} == {"torch_sdpa"}  # type: ignore[union-attr]


def test_rule_request_backend_sparse_refusal_is_the_machines_rule() -> None:
    from attnres.backends import Backend
    from attnres.machine import REQUEST_RULES, request_refusal

    refusal = request_refusal(Backend("sliding_tile_attn"))
    assert refusal is not None and refusal.code == REQUEST_RULES[0][0] == "sparse_layer"
    assert "never switches a sparse layer" in refusal.message
    assert request_refusal(Backend("torch_sdpa")) is None
    assert request_refusal(None) is None


def test_rule_request_backend_many_threads_and_tasks_each_run_their_own_backend() -> None:
    model = Denoiser()
    attnres.bind(model)
    x = _x()
    expected = model(x)
    backends = ("eager", "flex_attention", "torch_sdpa")
    problems: list[str] = []
    barrier = threading.Barrier(6)

    def serve(i: int) -> None:
        backend = backends[i % 3]
        barrier.wait(10)
        for _ in range(10):
            with request_backend(model, backend):
                seen = {layer.backend.name for layer in model.blocks}  # type: ignore[union-attr]
                if seen != {backend}:
                    problems.append(f"thread {i} asked {backend}, saw {seen}")
                out = model(x)
                if not torch.allclose(out, expected, rtol=1e-4, atol=1e-5):
                    problems.append(f"thread {i}: wrong output on {backend}")

    async def task(backend: str) -> set[str]:
        with request_backend(model, backend):
            await asyncio.sleep(0)
            model(x)
            return {layer.backend.name for layer in model.blocks}  # type: ignore[union-attr]

    async def tasks() -> list[set[str]]:
        return list(await asyncio.gather(*(task(backends[i % 3]) for i in range(30))))

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    seen_by_tasks = asyncio.run(tasks())
    for thread in threads:
        thread.join()
    assert problems == []
    assert seen_by_tasks == [{backends[i % 3]} for i in range(30)]
    assert {layer.backend.name for layer in model.blocks} == {"torch_sdpa"}  # type: ignore[union-attr]
