"""Per-request backend switching: ``attnres.request_backend(module, backend)``.

A server builds its model once; one request may ask for another attention
backend (SGLang's ``SamplingParams.attention_backend_override``). The switch is
two-phase and all-or-nothing: every attnres layer under the module is first
resolved for the requested backend (origin ``request``, strict, traced like any
resolution) and its kernel prepared; only when every layer can run it are they
switched, and they are restored when the block exits, also on error. Prepared
kernels are cached per layer, so a repeated request is a dictionary lookup per
layer. The ledger (:func:`attnres.decisions`) keeps the server's decisions: a
request's resolutions are not recorded there, and each switch and restore is an
audit event instead.

The switch follows the caller's context, not the layers: the request is a
context variable that the switched layers' ``forward`` reads, so each thread
and each asyncio task sees its own request (two requests on one shared model run
at once, each on its own backend), and a block that exits out of order cannot
leave another caller's layers switched. Layers no request ever switched keep
the plain forward (no context read). A cast inside the block re-resolves the
server's decision; the request then prepares its backend for the new dtype.

``request_backend`` refuses a module compiled with ``torch.compile`` (an
``OptimizedModule``, or ``Module.compile()`` anywhere in its tree): the
compiled graph keeps the kernel it was traced with. A layer compiled through
an enclosing wrapper the call cannot see raises when the graph is traced
inside a request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import MappingProxyType

import torch
from torch import nn

from attnres.audit import emit_request_switch
from attnres.backends import Backend
from attnres.errors import (
    ArgumentTypeError,
    CompiledGraphError,
    RequestBackendError,
    ResolutionError,
)
from attnres.kernels import KernelUnavailableError
from attnres.layer import optional_backend
from attnres.machine import request_refusal
from attnres.modules import _REQUESTS, Attention, KernelNotRegisteredError

__all__ = ["RequestBackendError", "request_backend"]


def _capturing() -> str | None:
    # is_dynamo_compiling: true only while dynamo traces this code (is_compiling is
    # a process-wide flag, true in every thread while another thread compiles)
    if torch.compiler.is_dynamo_compiling():
        return "inside torch.compile'd code"
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available() and cuda.is_current_stream_capturing():
        return "during CUDA graph capture"
    return None


def _compiled(module: nn.Module) -> str | None:
    """How ``module`` (or a module under it) was compiled with torch.compile, if so."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return f"{type(module).__name__} is a torch.compile wrapper"
    for path, sub in module.named_modules():
        if getattr(sub, "_compiled_call_impl", None) is not None:
            return f"module {path or '<the module itself>'!r} was compiled with Module.compile()"
    return None


def _label(path: str, layer: Attention) -> str:
    name = layer.layer_spec.name
    if not path:
        return name or "<the module itself>"
    return path if name in (None, path) else f"{path} ({name})"


def refuse_graphs(module: object, who: str) -> nn.Module:
    """What every switch (a request, a schedule) refuses before it looks at anything
    else: being called inside ``torch.compile``d code or during CUDA graph capture,
    a module that is not one, and a module compiled with ``torch.compile``."""
    where = _capturing()  # first: nothing else should be traced into a graph
    if where is not None:
        raise CompiledGraphError(
            f"{who} was called {where}: switching kernels would be baked into (or break) "
            f"the graph. Enter it outside the compiled or captured region, around the call"
        )
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"{who}: expected a torch.nn.Module, got {type(module).__name__}")
    compiled = _compiled(module)
    if compiled is not None:
        raise CompiledGraphError(
            f"{who}: {compiled}; a compiled graph keeps the kernel it was traced with, so "
            f"{who} cannot switch it. Compile the model for one backend (attnres.bind "
            f"first) and switch backends on an uncompiled copy"
        )
    return module


def prepare_switch(
    module: nn.Module, backends: Sequence[Backend], who: str, *, every_layer: bool
) -> tuple[list[tuple[str, Attention]], list[tuple[str, Attention, Backend]]]:
    """The first phase of every switch (a request, a schedule), after
    :func:`refuse_graphs`: bind pending layers, then resolve and prepare every
    (layer, backend) pair; raise :class:`RequestBackendError` naming each pair
    that cannot run, so nothing is switched. Returns the layers and the prepared
    (path, layer, backend) pairs; a layer already running a backend is skipped
    unless ``every_layer``."""
    layers = [(p, m) for p, m in module.named_modules() if isinstance(m, Attention)]
    if not layers:
        raise RequestBackendError(
            f"{who}: {type(module).__name__} holds no attnres.Attention layer, so there is "
            f"nothing to switch; pass the module that holds the model's attention layers "
            f"(the denoiser, say)",
            backends[0],
            (),
        )
    for _, layer in layers:
        if layer.pending:
            layer._bind_to()
    prepared: list[tuple[str, Attention, Backend]] = []
    failures: list[tuple[str, str]] = []
    several = len(backends) > 1
    for backend in backends:
        for path, layer in layers:
            current = layer.backend
            if current == backend and not every_layer:
                continue
            label = f"{_label(path, layer)} at {backend.name}" if several else _label(path, layer)
            refusal = None if current == backend else request_refusal(current)
            if refusal is not None:  # the machine's rules (REQUEST_RULES: a sparse layer)
                failures.append((label, refusal.message))
                continue
            try:
                layer._prepare(backend)
            except (ResolutionError, KernelNotRegisteredError, KernelUnavailableError) as exc:
                failures.append((label, str(exc)))
                continue
            prepared.append((path, layer, backend))
    if failures:
        shown = "; ".join(f"{label}: {why}" for label, why in failures[:8])
        more = f"; and {len(failures) - 8} more" if len(failures) > 8 else ""
        what = "layer/backend pair(s)" if several else f"of {len(layers)} attention layer(s)"
        raise RequestBackendError(
            f"{who}: {len(failures)} {what} cannot run it, so no layer was switched: {shown}{more}",
            backends[0],
            tuple(failures),
        )
    return layers, prepared


@contextmanager
def request_backend(module: nn.Module, backend: Backend | str) -> Iterator[Backend]:
    """Run every ``attnres.Attention`` under ``module`` on ``backend`` inside this block.

    Raises, before anything is switched: ``TypeError`` when ``module`` is not a
    ``torch.nn.Module``; :class:`~attnres.errors.CompiledGraphError` (a
    ``RuntimeError``) inside ``torch.compile``d code, during CUDA graph
    capture, or for a compiled module (a switch must happen outside the graph);
    and :class:`RequestBackendError` (a ``ValueError``) when ``module`` holds no
    attnres layer, when a layer runs a sparse backend (its kernel takes layout
    metadata a dense request cannot give), or when any layer cannot run
    ``backend`` -- naming every such layer and why. Layers still pending are
    bound first (the server's decision, recorded). Layers already running
    ``backend`` are left alone; when all are, the block is a no-op.
    """
    who = f"attnres.request_backend({backend!r})"
    module = refuse_graphs(module, who)
    parsed = optional_backend("backend")(backend)
    if parsed is None:
        raise RequestBackendError(
            "attnres.request_backend: backend must be a backend name, not None; pass one "
            "of attnres.Backend or its name",
            None,
            (),
        )
    who = f"attnres.request_backend({parsed.name!r})"
    _, prepared = prepare_switch(module, [parsed], who, every_layer=False)
    plan = [layer for _, layer, _ in prepared]
    if not plan:
        yield parsed
        return
    previous = sorted({layer.backend.name for layer in plan if layer.backend is not None})
    for layer in plan:
        layer._make_switchable()
    outer = _REQUESTS.get()
    token = _REQUESTS.set(MappingProxyType({**outer, **{id(layer): parsed for layer in plan}}))
    try:
        emit_request_switch("switch", parsed.name, len(plan), ", ".join(previous))
        yield parsed
    finally:
        try:
            _REQUESTS.reset(token)
        except ValueError:  # exited in another context than it was entered in
            _REQUESTS.set(outer)
        emit_request_switch("restore", parsed.name, len(plan), ", ".join(previous))
