"""attnres: decide which attention kernel every layer runs, and prove why.

The public surface is this module's ``__all__``; see ``docs/index.md``.
"""

import logging as _logging
from typing import TYPE_CHECKING, Any

# first, before anything imports torch: importing it refuses a torch older than
# attnres supports, naming the version found and the one required
from attnres._torch_floor import MIN_TORCH as _MIN_TORCH  # noqa: F401
from attnres._vocab import Role
from attnres.backends import Backend, BackendSpec, register_backend, unregister_backend
from attnres.errors import (
    AttnresError,
    BackendNotAppliedError,
    ConsensusError,
    EngineSupportError,
    KernelNotRegisteredError,
    KernelUnavailableError,
    RequestBackendError,
    ResolutionError,
    SequenceParallelError,
    TraceFormatError,
    UnknownBackendError,
)
from attnres.layer import LayerSpec, Requirements, SelectionConfig
from attnres.layout import SequenceLayout
from attnres.ledger import Decision, clear_decisions, decisions
from attnres.platform import Platform
from attnres.runtime import (
    Resolution,
    clear_cache,
    component_scope,
    force_backend,
    resolve,
    selection_config,
    set_selection_config,
)
from attnres.scope import register_component_kind
from attnres.trace import Trace, dump_trace, load_trace

#: The one source of the version (pyproject.toml reads it): the 0.3 development line.
__version__ = "0.4.0.dev0"

# A library never prints on its own: without this, Python's last-resort handler
# would write attnres WARNING events to stderr when the application configured
# no logging. An application that configures logging still sees every event.
_logging.getLogger("attnres").addHandler(_logging.NullHandler())

if TYPE_CHECKING:
    from attnres import distributed, kernels
    from attnres.autotuner import autotune
    from attnres.modules import Attention, bind
    from attnres.parallel import SequenceParallel
    from attnres.replayer import ReplayResult, replay
    from attnres.request import request_backend
    from attnres.schedules import schedule


def __getattr__(name: str) -> Any:
    # Lazy: the layer and the kernels import torch, the resolver does not, so
    # ``import attnres`` (and the CLI) stays fast until a layer is built.
    if name in ("Attention", "bind"):
        from attnres import modules

        return getattr(modules, name)
    if name == "schedule":  # issue 23: per-step schedules (imports torch)
        from attnres.schedules import schedule

        return schedule
    if name == "SequenceParallel":  # issue 24: imports torch.distributed
        from attnres import parallel

        return parallel.SequenceParallel
    if name == "request_backend":
        from attnres import request

        return getattr(request, name)
    if name == "autotune":  # measured selection: imports torch, like the layer
        from attnres.autotuner import autotune

        return autotune
    if name in ("replay", "ReplayResult"):
        from attnres import replayer

        return getattr(replayer, name)
    if name in ("distributed", "kernels"):
        import importlib

        return importlib.import_module(f"attnres.{name}")
    raise AttributeError(f"module 'attnres' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazily imported names too (they are in __all__), before first use
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Attention",
    "AttnresError",
    "Backend",
    "BackendNotAppliedError",
    "BackendSpec",
    "ConsensusError",
    "Decision",
    "EngineSupportError",
    "KernelNotRegisteredError",
    "KernelUnavailableError",
    "LayerSpec",
    "Platform",
    "ReplayResult",
    "RequestBackendError",
    "Requirements",
    "Resolution",
    "ResolutionError",
    "Role",
    "SelectionConfig",
    "SequenceLayout",
    "SequenceParallel",
    "SequenceParallelError",
    "Trace",
    "TraceFormatError",
    "UnknownBackendError",
    "__version__",
    "autotune",
    "bind",
    "clear_cache",
    "clear_decisions",
    "component_scope",
    "decisions",
    "distributed",
    "dump_trace",
    "force_backend",
    "kernels",
    "load_trace",
    "register_backend",
    "register_component_kind",
    "replay",
    "request_backend",
    "resolve",
    "schedule",
    "selection_config",
    "set_selection_config",
    "unregister_backend",
]
