"""attnres: decide which attention kernel every layer runs, and prove why.

The public surface is this module's ``__all__``; see ``docs/index.md``.
"""

from attnres._vocab import Role
from attnres.backends import Backend, BackendSpec, register_backend, unregister_backend
from attnres.errors import (
    BackendNotAppliedError,
    ConsensusError,
    ResolutionError,
    TraceFormatError,
    UnknownBackendError,
)
from attnres.layer import LayerSpec, Requirements, SelectionConfig
from attnres.ledger import Decision, clear_decisions, decisions
from attnres.machine import (
    Resolution,
    clear_cache,
    force_backend,
    resolve,
    selection_config,
    set_selection_config,
)
from attnres.platform import Platform
from attnres.scope import component_scope, register_component_kind
from attnres.trace import Trace, dump_trace, load_trace

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendNotAppliedError",
    "BackendSpec",
    "ConsensusError",
    "Decision",
    "LayerSpec",
    "Platform",
    "Requirements",
    "Resolution",
    "ResolutionError",
    "Role",
    "SelectionConfig",
    "Trace",
    "TraceFormatError",
    "UnknownBackendError",
    "__version__",
    "clear_cache",
    "clear_decisions",
    "component_scope",
    "decisions",
    "dump_trace",
    "force_backend",
    "load_trace",
    "register_backend",
    "register_component_kind",
    "resolve",
    "selection_config",
    "set_selection_config",
    "unregister_backend",
]
