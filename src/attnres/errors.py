"""Every exception attnres raises on purpose, under one base: :class:`AttnresError`.

``except attnres.AttnresError`` catches each of them. Each also keeps the
built-in base its kind of failure has: every error about an input (a backend
name, a layer, a trace file, a scope, a pipeline file, a request) is a
``ValueError`` (:class:`InvalidArgumentError` when no more specific error
names it), an argument of the wrong type an :class:`ArgumentTypeError` (a
``TypeError``); :class:`ConsensusError` and :class:`KernelNotRegisteredError`
are ``RuntimeError``s (the arguments are fine, the process or the job is not);
:class:`KernelUnavailableError` is an ``ImportError``; :class:`TraceWriteError`
an ``OSError``. The modules that raise them re-export them under their old
homes. Each message says what was asked, what failed and what to do.
"""

from __future__ import annotations

from typing import Any

from attrs import field, frozen

from attnres._states import Code, ScopeCode

# This module is the floor of attnres: it imports nothing of it but the state
# names, so every other module can raise these errors. What an error carries
# that is defined above it (a Backend, a Trace, a Resolution, an
# PlanResult) is annotated ``Any`` here and named in its docstring.

__all__ = [
    "AppliedModelPickleError",
    "ArgumentTypeError",
    "AttnresError",
    "BackendMismatchError",
    "BackendNotAppliedError",
    "BackendOptionError",
    "CompiledGraphError",
    "ConsensusError",
    "EngineSupportError",
    "FolderBuildError",
    "IntegrationError",
    "InvalidArgumentError",
    "InvalidStateError",
    "KernelNotRegisteredError",
    "KernelRefusedError",
    "KernelUnavailableError",
    "MaskKindError",
    "MaskShapeError",
    "PipelineError",
    "PluginError",
    "RequestBackendError",
    "ResolutionError",
    "ResultsFileError",
    "SequenceParallelArgumentError",
    "SequenceParallelError",
    "TraceFormatError",
    "TraceWriteError",
    "UnknownBackendError",
    "UnsupportedVersionError",
    "UsageError",
]


class AttnresError(Exception):
    """The base of every exception attnres raises on purpose."""


class InvalidArgumentError(AttnresError, ValueError):
    """A bad value no more specific error names: a head size, a dtype, a role, a
    requirement, a platform string, a scope name or kind, an ``Attention``
    argument, a ``forward`` input, a command-line value. The message says what
    was given, what is wrong and what is valid."""


class ArgumentTypeError(AttnresError, TypeError):
    """An argument of the wrong type: ``resolve()`` given something that is not a
    ``LayerSpec``, ``Backend.parse(3)``, ``dump_trace`` given a non-trace."""


class UnknownBackendError(AttnresError, ValueError):
    """A backend name that is not registered (the message lists the valid ones)."""

    def __init__(self, message: str, name: str, suggestion: str | None) -> None:
        super().__init__(message)
        self.name = name
        self.suggestion = suggestion


class BackendOptionError(AttnresError, ValueError):
    """A per-backend option that the backend's spec does not declare, or a bad value.

    (issue 23) ``.backend`` and ``.option`` name what was given; ``.suggestion``
    is the closest declared option name, if any.
    """

    def __init__(
        self, message: str, backend: str, option: str, suggestion: str | None = None
    ) -> None:
        super().__init__(message)
        self.backend = backend
        self.option = option
        self.suggestion = suggestion


class MaskKindError(AttnresError, ValueError):
    """A call brought a mask of a kind its layer's kernel cannot take (issue 22:
    a varlen kernel takes key padding only); ``.observed`` names the kind."""

    def __init__(self, message: str, observed: str) -> None:
        super().__init__(message)
        #: the observed kind in words ("boolean mask", "additive mask", ...)
        self.observed = observed


class MaskShapeError(AttnresError, ValueError, RuntimeError):
    """A call's attention mask does not broadcast to (batch, heads, query length,
    key length), as torch's ``scaled_dot_product_attention`` reads it. A
    ``RuntimeError`` too: what SDPA itself raises for the same mask."""


class PluginError(AttnresError, ValueError):
    """A backend registration that conflicts with another one."""


class ResolutionError(AttnresError, ValueError):
    """No backend could serve a layer; ``.trace`` holds every step that led here."""

    def __init__(self, message: str, trace: Any, code: Code | str) -> None:
        super().__init__(message)
        #: the :class:`attnres.Trace` of the rejected resolution
        self.trace: Any = trace
        #: why (a :class:`~attnres.Code`, like the trace outcome's ``code``)
        self.code = Code(code)


@frozen
class ScopeProblem:
    """One failed scope check (SPEC 3.6, ``attnres.machine.SCOPE_CHECKS``): its
    code and what it says. A scope is no one resolution, so its problems are not
    in a trace: they are raised (``BackendNotAppliedError.problems``) and written
    to the audit log (event ``attention scope check failed``, with the code).
    Defined here, beside the error that carries it; :mod:`attnres.records` and
    :mod:`attnres.machine` re-export it."""

    code: ScopeCode = field(converter=ScopeCode)
    message: str


class BackendNotAppliedError(AttnresError, ValueError):
    """A component scope's overrides do not explain its layers (SPEC 3.6).

    ``.problems`` holds one :class:`ScopeProblem` (a
    :class:`~attnres._states.ScopeCode` and its message) per failed check.
    """

    def __init__(self, message: str, problems: tuple[ScopeProblem, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class TraceFormatError(AttnresError, ValueError):
    """A trace file that is malformed or of an unsupported schema version."""

    def __init__(self, message: str, path: str | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.where = where


class ResultsFileError(AttnresError, ValueError):
    """An autotune (or precision calibration) results file that cannot be read, or
    a target that is not one (attnres never overwrites a file it did not write)."""


class TraceWriteError(AttnresError, OSError):
    """Trace files that could not be written: the message says which file or
    step (the folder's manifest) failed, and the operating system's reason."""


class ConsensusError(AttnresError, RuntimeError):
    """Ranks of one job decided differently (or a rank never arrived)."""


class CompiledGraphError(AttnresError, RuntimeError):
    """Kernels were to be decided or switched where a graph would keep them: inside
    ``torch.compile``d code, during CUDA graph capture, or on a module compiled
    with ``torch.compile`` (``request_backend``, ``schedule``, a pending layer's
    first call). Decide (``attnres.bind``) and switch outside the compiled or
    captured region. A ``RuntimeError``, as it was before it had a type."""


class InvalidStateError(AttnresError, RuntimeError):
    """A call made when attnres's objects are not in the state it needs: a schedule
    stepper used after its ``with`` block exited, a module whose config names
    attnres's attention function but on which attnres installed nothing, a layer
    that lost its binding. The message says what to do. A ``RuntimeError``, as
    it was before it had a type."""


class SequenceParallelError(AttnresError, RuntimeError):
    """A sequence-parallel collective failed or timed out (a peer died, hangs, or
    took another code path; issue 24, :mod:`attnres.parallel`). The group is out
    of step: restart the job."""


class PipelineError(AttnresError, ValueError):
    """A pipeline file that cannot be read or does not follow the format.

    The message names the file, and where it applies the component, the layer
    and the line (``path``, ``component``, ``layer`` and ``line`` hold them).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str,
        component: str | None = None,
        layer: str | None = None,
        line: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.component = component
        self.layer = layer
        self.line = line


class FolderBuildError(AttnresError, ValueError):
    """A model folder's component cannot be planned (``attnres plan DIR``): a file
    that cannot be read, a key that is not a name, a config value out of bounds,
    or a model diffusers/transformers cannot build from it (issue 20).

    The message is in the one format of every loader (``FILE: WHERE: MESSAGE``,
    issue 21); ``path`` holds the file (or folder) and ``where`` the place in it
    (a component, a config key, a tensor), ``None`` when the file is the place.
    """

    def __init__(self, message: str, path: str | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.where = where


class IntegrationError(AttnresError, ValueError):
    """``apply`` could not install every decision; nothing was changed.

    ``.plan`` is the :class:`~attnres.plan.PlanResult` that says, site by site
    (its ``sites``), why.
    """

    def __init__(self, message: str, plan: Any) -> None:
        super().__init__(message)
        #: the :class:`attnres.plan.PlanResult` that says why
        self.plan: Any = plan


class KernelUnavailableError(AttnresError, ImportError):
    """The package a kernel adapter needs cannot be imported (or is the wrong one).

    An ``ImportError`` so that ``except ImportError`` keeps working; the message
    names the backend, the package and how to install it.
    """


class EngineSupportError(AttnresError, ImportError):
    """A serving engine's attnres plugin cannot be put in place (issues 32, 36).

    The engine (SGLang, vLLM-Omni) is not importable here, is a release the
    plugin was not written for, or lacks a hook the plugin needs; nothing was
    changed. An ``ImportError`` so that ``except ImportError`` around an
    optional integration keeps working. ``.engine`` names the engine,
    ``.version`` is the installed release (``None`` when it is not importable),
    ``.supported`` the range the plugin was written for.
    """

    def __init__(self, message: str, engine: str, version: str | None, supported: str) -> None:
        super().__init__(message)
        self.engine = engine
        self.version = version
        self.supported = supported


class AppliedModelPickleError(AttnresError, TypeError):
    """``pickle`` or ``torch.save`` of a model with attnres's routes installed
    (issue 30): a route is code installed in this process (a processor class of
    its own, a kernel bound to this machine), which a file cannot carry. A
    ``TypeError``, as pickle's own refusal is. ``copy.deepcopy`` works; to
    save, call the integration's ``remove()`` first and ``apply`` again after
    loading."""


class UnsupportedVersionError(AttnresError, ImportError):
    """An integration's library is installed at a version outside the range
    attnres declares for it (the ``diffusers`` and ``transformers`` extras):
    ``apply`` refuses it rather than half-work against code it was not written
    for; or torch is older than attnres's floor (``import attnres`` refuses it,
    :mod:`attnres._torch_floor`). An ``ImportError``, as for a kernel package of
    the wrong build.
    ``.package``, ``.installed`` and ``.supported`` (the range, as the extra
    declares it) are attached."""

    def __init__(self, message: str, package: str, installed: str, supported: str) -> None:
        super().__init__(message, name=package)
        self.package = package
        self.installed = installed
        self.supported = supported


class KernelNotRegisteredError(AttnresError, RuntimeError):
    """The resolver selected a backend for which no kernel is registered.

    Sparse backends (``sliding_tile_attn``, ``video_sparse_attn``, ...) need
    layout metadata the dense calling convention does not carry, so attnres
    ships no adapter for them; a third-party backend added with
    :func:`attnres.register_backend` needs its kernel too. Register one with
    :func:`attnres.kernels.register_kernel`. ``.backend`` names the backend and
    ``.resolution`` holds the decision (already in :func:`attnres.decisions`).
    """

    def __init__(self, message: str, backend: Any, resolution: Any) -> None:
        super().__init__(message)
        #: the selected :class:`attnres.Backend`
        self.backend: Any = backend
        #: the decision, an :class:`attnres.Resolution`
        self.resolution: Any = resolution


class RequestBackendError(AttnresError, ValueError):
    """A request asked for a backend that some layer cannot run (nothing was switched).

    ``.backend`` is the requested backend; ``.failures`` holds ``(layer, why)``
    pairs, one per layer that cannot run it.
    """

    def __init__(self, message: str, backend: Any, failures: tuple[tuple[str, str], ...]) -> None:
        super().__init__(message)
        #: the requested :class:`attnres.Backend` (``None`` when none was named)
        self.backend: Any = backend
        self.failures = failures


class UsageError(AttnresError, ValueError):
    """A command-line mistake the parser cannot see (the CLI exits 2)."""


class BackendMismatchError(ConsensusError):
    """Sequence-parallel ranks run different attention backends for one layer at
    one forward: a rank switched its backend (``request_backend``, a schedule
    step, ``force_backend``) while the others did not (issue 32 item 17). Raised
    on every rank before any data moves; ``.backends`` maps each group rank to
    its backend's name."""

    def __init__(self, message: str, backends: dict[int, str]) -> None:
        super().__init__(message)
        self.backends = backends


class SequenceParallelArgumentError(AttnresError, ValueError):
    """A sequence-parallel argument out of bounds (issue 32 items 11, 16): a
    degree or head count of :class:`~attnres.SequenceLayout` or
    :class:`~attnres.SequenceParallel` (1 to 65536), a timeout of
    ``SequenceParallel`` or ``verify_consensus`` (positive, at most a week), or
    degrees whose product is not the group's size; issue 35's arguments (``layout``,
    ``interconnect``, ``text_tokens``, ``seq_len``, ``kv_budget``, ``allgather`` with
    ``ring``, ``pad_heads``). ``.argument`` names what was given, ``.bound`` the
    limit it broke (a number, or the values it may take). A ``ValueError``, as it was before it
    had a type."""

    def __init__(self, message: str, argument: str, bound: float | str) -> None:
        super().__init__(message)
        self.argument = argument
        self.bound = bound


class KernelRefusedError(AttnresError, RuntimeError):
    """Issue 31: the selected backend's kernel refuses this call, for a reason no
    layer fact decided when the backend was chosen (a key length, a global torch
    mode, gradients its release has no working backward for): the adapter says
    so before the kernel's own error (torch's "No available kernel", autograd's
    "incorrect number of gradients"). ``.backend`` names the backend and
    ``.because`` cites the kernel's own check. A ``RuntimeError`` too: what the
    kernel itself raised before.
    """

    def __init__(self, message: str, backend: str, because: str) -> None:
        super().__init__(message)
        self.backend = backend
        self.because = because
