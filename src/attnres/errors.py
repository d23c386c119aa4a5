"""Every exception attnres raises on purpose.

Every error about an input (a backend name, a layer, a trace file, a scope) is
a ``ValueError`` subclass; :class:`ConsensusError` is a ``RuntimeError``, since
it reports a disagreement between processes at run time, not a bad argument.
Each message says what was asked, what failed and what to do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnres._states import Code

if TYPE_CHECKING:
    from attnres.trace import Trace

__all__ = [
    "BackendNotAppliedError",
    "ConsensusError",
    "PluginError",
    "ResolutionError",
    "ResultsFileError",
    "TraceFormatError",
    "TraceWriteError",
    "UnknownBackendError",
]


class UnknownBackendError(ValueError):
    """A backend name that is not registered (the message lists the valid ones)."""

    def __init__(self, message: str, name: str, suggestion: str | None) -> None:
        super().__init__(message)
        self.name = name
        self.suggestion = suggestion


class PluginError(ValueError):
    """A backend registration that conflicts with another one."""


class ResolutionError(ValueError):
    """No backend could serve a layer; ``.trace`` holds every step that led here."""

    def __init__(self, message: str, trace: Trace, code: Code | str) -> None:
        super().__init__(message)
        self.trace = trace
        #: why (a :class:`~attnres.Code`, like the trace outcome's ``code``)
        self.code = Code(code)


class BackendNotAppliedError(ValueError):
    """An explicit component (or role) backend controlled none of its scope's layers."""


class TraceFormatError(ValueError):
    """A trace file that is malformed or of an unsupported schema version."""

    def __init__(self, message: str, path: str | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.where = where


class ResultsFileError(ValueError):
    """An autotune results file that cannot be read, or a target that is not one
    (attnres never overwrites a file it did not write)."""


class TraceWriteError(OSError):
    """Trace files that could not be written: the message says which file or
    step (the folder's manifest) failed, and the operating system's reason."""


class ConsensusError(RuntimeError):
    """Ranks of one job decided differently (or a rank never arrived)."""
