"""The ``attnres`` command line (SPEC 6), thin over the library.

Commands: ``explain`` (one layer, every check of every candidate), ``plan`` (a
pipeline file), ``replay`` (golden traces), ``doctor`` (this machine) and
``backends`` (the catalogue). No selection rule lives here: every decision
comes from :func:`attnres.runtime.resolve` and is rendered from its trace.

Conventions (``docs/cli.md``):

- stdout carries only the requested output (one JSON document with ``--json``);
  logs and errors go to stderr.
- Exit codes: 0 success, 1 a resolution was rejected (or a replay diverged),
  2 bad usage or bad input -- one paragraph on stderr, no traceback. An
  unexpected failure inside attnres is exit 70 with a one-line message (the
  traceback is logged at ERROR, so ``--log-level error`` or lower shows it).
- ``--log-format console|json`` and ``--log-level LEVEL`` configure structlog
  for this process only, writing to stderr. Without ``--log-level`` nothing is
  logged: the command's own output already reports every decision.

Embedding in another program's command line::

    parser = argparse.ArgumentParser()
    attnres.cli.add_selection_arguments(parser, default="fa")
    args = parser.parse_args()
    attnres.set_selection_config(attnres.SelectionConfig.from_args(args))

``--attention-backend BACKEND`` sets the global backend (typed by the operator:
origin ``global_cli``; left at the program's ``default``: ``global_preference``),
and ``--attention-backend COMPONENT=BACKEND`` (repeatable) overrides one
component.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import attrs

from attnres._precision_view import describe_precision
from attnres._schedule_plan import parse_schedule, plan_schedule
from attnres._states import PackageStatus, ReplayStatus, Status  # issue 20, 19
from attnres._varlen import check_layer_options
from attnres._vocab import DTYPES, PLATFORM_KINDS, REQUIREMENT_PHRASES, MaskRoute, Requirement
from attnres.backends import (
    ENTRY_POINT_GROUP,
    Backend,
    BackendSpec,
    lookup_spec,
    parse_backend_option,
    plugin_failures,
    registered_backends,
)
from attnres.documents import (
    environment_document,
    platform_document,
    spec_document,
    vocabulary_sorted,
)
from attnres.errors import UsageError
from attnres.explain import autotune_plan, describe_layer, explain, resolution_trace
from attnres.layer import (
    DEST_ATTENTION_ERROR,
    DEST_AUTOTUNE,
    DEST_AUTOTUNE_MIN,
    DEST_BACKEND,
    DEST_COMPONENTS,
    DEST_EXPLICIT,
    ENV_VAR,
    LayerSpec,
    Requirements,
    SelectionConfig,
    split_component_key,
)
from attnres.layout import LAYOUT_KINDS, MAX_DEGREE, MAX_HEADS, SequenceLayout
from attnres.machine import AutoLayout
from attnres.platform import Platform
from attnres.render import (
    _field,
    _opt,
    _platform_text,
    _plural,
    _table,
    _width,
    _wrap,
    request_text,
)
from attnres.replayer import ReplayRun, replay_paths
from attnres.runtime import component_scope
from attnres.trace import (
    Trace,
    dump_trace,
    trace_to_dict,
)
from attnres.tuning import is_tunable

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_USAGE",
    "add_selection_arguments",
    "build_parser",
    "main",
    "selection_config_from_args",
]

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 70

#: Namespace attributes that :func:`add_selection_arguments` fills.
# (the namespace contract lives with SelectionConfig.from_args)

_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _Terminated(BaseException):
    """SIGTERM arrived: unwound like ``KeyboardInterrupt`` (temporary files removed)."""


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While a command runs, SIGTERM raises :class:`_Terminated` (as SIGINT raises
    ``KeyboardInterrupt``), so a write in progress removes its temporary file."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# =============================================================================
# Selection arguments, for attnres and for the programs that embed it
# =============================================================================


def _canonical_backend(action: argparse.Action, text: str) -> str:
    try:
        return Backend.parse(text).name
    except ValueError as exc:
        raise argparse.ArgumentError(action, str(exc)) from None


class _AttentionBackendAction(argparse.Action):
    """``--attention-backend [COMPONENT[.ROLE]=]BACKEND[,...]``; records that the
    operator typed it. Component names are normalised (``Text-Encoder`` ->
    ``text_encoder``); ``transformer.cross=X`` is a role override."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        text = str(values).strip()
        items = [item.strip() for item in text.split(",")]
        if not text or any(not item for item in items):
            raise argparse.ArgumentError(
                self,
                f"expected BACKEND, COMPONENT=BACKEND or COMPONENT.ROLE=BACKEND, comma-separated, "
                f"got {text!r}",
            )
        for item in items:
            self._one(namespace, item)

    def _one(self, namespace: argparse.Namespace, text: str) -> None:
        if "=" in text:
            component, _, backend = (part.strip() for part in text.partition("="))
            if not component or not backend:
                raise argparse.ArgumentError(
                    self, f"expected BACKEND or COMPONENT=BACKEND, got {text!r}"
                )
            try:
                name, role = split_component_key(component, strict=True)
            except ValueError as exc:
                raise argparse.ArgumentError(self, str(exc)) from None
            key = name if role is None else f"{name}.{role.value}"
            components = dict(getattr(namespace, DEST_COMPONENTS, None) or {})
            chosen = _canonical_backend(self, backend)
            previous = components.get(key)
            if previous is not None and previous != chosen:
                raise argparse.ArgumentError(
                    self,
                    f"component {key!r} was given two backends ({key}={previous} "
                    f"and {key}={chosen}); give it once",
                )
            components[key] = chosen
            setattr(namespace, DEST_COMPONENTS, components)
            return
        name = _canonical_backend(self, text)
        previous = getattr(namespace, self.dest, None)
        if getattr(namespace, DEST_EXPLICIT, False) and previous not in (None, name):
            raise argparse.ArgumentError(
                self,
                f"the global backend was given twice ({previous!r} and {name!r}); give it "
                f"once, and COMPONENT=BACKEND for a single component",
            )
        setattr(namespace, self.dest, name)
        setattr(namespace, DEST_EXPLICIT, True)


def add_selection_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default: Backend | str | None = None,
) -> argparse.Action:
    """Add ``--attention-backend [COMPONENT[.ROLE]=]BACKEND[,...]`` (repeatable) to ``parser``.

    ``default`` is the program's own preference: used when the operator does not
    type the flag, and recorded as *not explicit* (origin ``global_preference``,
    relaxed everywhere). A typed value is explicit (origin ``global_cli``);
    without it, ``ATTNRES_ATTENTION_BACKEND`` in the environment is (origin
    ``global_env``). ``COMPONENT=BACKEND`` overrides one component (origin
    ``component_override``), ``COMPONENT.ROLE=BACKEND`` one role of it (origin
    ``role_override``); items may be comma-separated
    (``vae=torch_sdpa,text_encoder=fa``).
    Unknown backend names are parse errors that suggest the closest name.
    Read the result with :func:`selection_config_from_args`.
    """
    default_name = None if default is None else Backend.parse(default).name
    action = parser.add_argument(
        "--attention-backend",
        dest=DEST_BACKEND,
        action=_AttentionBackendAction,
        metavar="[COMPONENT[.ROLE]=]BACKEND[,...]",
        default=default_name,
        help=(
            "attention backend for every layer (relaxed for auxiliary components), "
            "COMPONENT=BACKEND for one component, COMPONENT.ROLE=BACKEND for its self- or "
            f"cross-attention layers; comma-separated or repeated (default: ${ENV_VAR})"
            + (f"; default: {default_name} (a preference, not explicit)" if default_name else "")
        ),
    )
    parser.set_defaults(**{DEST_EXPLICIT: False, DEST_COMPONENTS: None})
    parser.add_argument(
        "--autotune",
        dest=DEST_AUTOTUNE,
        action="store_true",
        help="measure automatic decisions (origins none, layer_default, global_preference) "
        "on their first large forward and keep the fastest agreeing kernel",
    )
    parser.add_argument(
        "--autotune-min-elements",
        dest=DEST_AUTOTUNE_MIN,
        type=_non_negative,
        metavar="N",
        default=None,
        help="with --autotune: smallest query (elements) worth measuring; default 4194304",
    )
    # issue 34: the attention error budget (docs/precision.md)
    parser.add_argument(
        "--attention-error",
        dest=DEST_ATTENTION_ERROR,
        action="append",
        metavar="[COMPONENT[.ROLE]=]exact|REL_L2[,...]",
        default=None,
        help="the error a lossy kernel may add, per component (vae=exact,transformer=2e-2) "
        "or for every component (2e-2): 'exact' refuses lossy kernels, a number admits one "
        "whose relative L2 error (measured by calibrate/autotune) stays within it",
    )
    return action


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def selection_config_from_args(namespace: argparse.Namespace | Any) -> SelectionConfig:
    """Build the :class:`SelectionConfig` from a namespace that
    :func:`add_selection_arguments` filled.

    ``global_backend_explicit`` is true only when the operator typed the flag;
    a program default left in place is a preference (false). Without a typed
    flag, ``ATTNRES_ATTENTION_BACKEND`` sets the global backend (origin
    ``global_env``): the flag beats the variable, the variable beats a
    program default.
    """
    try:
        return SelectionConfig.from_args(namespace)
    except UsageError:
        raise
    except ValueError as exc:  # a flag combination the config refuses: a usage error
        raise UsageError(str(exc)) from None


# =============================================================================
# Logging: structlog for this process only, to stderr
# =============================================================================


@contextmanager
def _cli_logging(log_format: str, level: str | None, stream: TextIO) -> Iterator[None]:
    import structlog

    saved = structlog.get_config() if structlog.is_configured() else None
    # structlog filters on the standard levels only: "off" is CRITICAL plus a
    # processor that drops what is left (attnres itself never logs CRITICAL).
    threshold = _LOG_LEVELS[level] if level else logging.CRITICAL
    processors: list[Any] = [] if level else [_drop_everything]
    processors += [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if log_format == "json":
        processors += [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=True, default=str),
        ]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=_isatty(stream)))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    try:
        yield
    finally:
        if saved is None:
            structlog.reset_defaults()
        else:
            structlog.configure(**saved)


def _drop_everything(logger: Any, method: str, event: Any) -> Any:
    import structlog

    raise structlog.DropEvent


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _log() -> Any:
    import structlog

    return structlog.get_logger("attnres.cli")


# =============================================================================
# Text helpers: 100 columns, wrapped
# =============================================================================


def _emit(stream: TextIO, lines: Sequence[str]) -> None:
    stream.write("\n".join(lines) + "\n")


def _emit_json(stream: TextIO, doc: Any) -> None:
    stream.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def _error(stream: TextIO, message: str, prog: str = "attnres") -> None:
    text = " ".join(message.split()) if "\n" not in message else message
    lines: list[str] = []
    for i, paragraph in enumerate(text.split("\n")):
        prefix = f"{prog}: error: " if i == 0 else "  "
        lines += _wrap(paragraph, _width(), prefix, "  ")
    _emit(stream, lines)


# =============================================================================
# Shared arguments
# =============================================================================


def _platform(spec: str | None) -> Platform:
    if spec is None:
        platform = Platform.detect()
        _log().debug("platform detected", platform=platform.describe())
        return platform
    return Platform.simulate(spec)


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [part.strip() for part in text.split(",") if part.strip()]


# =============================================================================
# explain
# =============================================================================


def _bounded_int(limit: int) -> Callable[[str], int]:
    """An argparse type: a positive integer up to ``limit`` (issue 32 item 15: a
    value a trace could not hold must not get as far as one)."""

    def parse(text: str) -> int:
        digits = text.strip().removeprefix("+")
        if not (digits.isascii() and digits.isdigit()) or not digits.strip("0"):
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text[:40]!r}")
        if len(digits.lstrip("0")) > len(str(limit)) or int(digits) > limit:
            raise argparse.ArgumentTypeError(f"at most {limit}, got {text[:40]}")
        return int(digits)

    return parse


_degree = _bounded_int(MAX_DEGREE)
_head_count = _bounded_int(MAX_HEADS)


#: Issue 24 (and 35): the sequence-parallel layout's arguments: flag, type,
#: metavar, help; the head counts only where the command takes them.
_LAYOUT_ARGUMENTS: tuple[tuple[str, Callable[[str], int], str, str], ...] = (
    ("--ulysses-degree", _degree, "U",
     "sequence-parallel layout: Ulysses all-to-all over U ranks (default 1)"),
    ("--ring-degree", _degree, "R",
     "sequence-parallel layout: a ring of R ranks, merged by log-sum-exp (default 1)"),
    ("--allgather-degree", _degree, "A",
     "sequence-parallel layout: AllGather-KV over A ranks (issue 35; default 1)"),
)  # fmt: skip
_HEAD_ARGUMENTS = (
    ("--heads", _head_count, "N", "the layer's heads (Ulysses divides them)"),
    ("--kv-heads", _head_count, "N", "its key/value heads, dividing --heads (default: --heads)"),
)


def _layout_arguments(parser: Any, *, heads: bool) -> None:
    """Issue 24: ``--ulysses-degree`` / ``--ring-degree`` (and the head counts)."""
    for flag, kind, metavar, text in _LAYOUT_ARGUMENTS:
        parser.add_argument(flag, type=kind, metavar=metavar, help=text)
    parser.add_argument(
        "--pad-heads", action="store_true",
        help="with --ulysses-degree: zero-pad the heads to a multiple of it (issue 35)",
    )  # fmt: skip
    for flag, kind, metavar, text in _HEAD_ARGUMENTS if heads else ():
        parser.add_argument(flag, type=kind, metavar=metavar, help=text)


def _auto_layout_arguments(parser: Any) -> None:
    """Issue 35: ``--sp-degree N`` (the layout ``SequenceParallel(layout="auto")``
    would choose per site), with the facts its rules read."""
    parser.add_argument(
        "--sp-degree", type=_degree, metavar="N",
        help="show the layout attnres would choose for each denoiser site of a model folder "
        "over N ranks (SequenceParallel(layout='auto'))",
    )  # fmt: skip
    parser.add_argument(
        "--interconnect", choices=("nvlink", "pcie"),
        help="with --sp-degree: the link between the ranks (default: not declared)",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=_degree, metavar="L",
        help="with --sp-degree: the full sequence length (the AllGather-KV memory rule)",
    )  # fmt: skip


def _auto_layout(args: argparse.Namespace) -> Any:
    """Issue 35: the ``--sp-degree`` choice, or ``None``."""
    degree = args.sp_degree
    if degree is None:
        if args.interconnect or args.seq_len:
            raise UsageError("--interconnect and --seq-len are facts for --sp-degree: give it too")
        return None
    if args.ulysses_degree or args.ring_degree or args.allgather_degree:
        raise UsageError(
            "--sp-degree lets attnres choose the layout; --ulysses-degree / --ring-degree fix "
            "one: give one or the other"
        )
    if not Path(args.pipeline).is_dir():
        raise UsageError(
            "--sp-degree chooses from each site's head counts, which a model folder gives "
            "(attnres plan DIR); a pipeline file gives none: use --ulysses-degree / "
            "--ring-degree"
        )
    return AutoLayout(degree, args.interconnect or "unknown", args.seq_len)


def _layout(args: argparse.Namespace) -> SequenceLayout | None:
    """The layout the flags give, or ``None`` (no flag, or both degrees 1)."""
    ulysses, ring = args.ulysses_degree or 1, args.ring_degree or 1
    allgather, pad = args.allgather_degree or 1, args.pad_heads
    # explain takes the head counts, plan does not
    heads, kv = getattr(args, "heads", None), getattr(args, "kv_heads", None)
    if pad and ulysses == 1:
        raise UsageError("--pad-heads pads the heads Ulysses splits: give --ulysses-degree too")
    if allgather > 1 and ring > 1:
        raise UsageError(
            "--allgather-degree and --ring-degree both split the query rows; give one of them "
            "(Ulysses composes with either)"
        )
    if ulysses * ring * allgather == 1:
        if heads is not None or kv is not None:
            raise UsageError(
                "--heads and --kv-heads describe the layer for a sequence-parallel layout: "
                "give --ulysses-degree or --ring-degree too"
            )
        return None
    if kv is not None and heads is None:
        raise UsageError("--kv-heads needs --heads")
    if kv is not None and heads is not None and (kv > heads or heads % kv):
        raise UsageError(
            f"--kv-heads {kv} --heads {heads}: each key/value head serves a whole group of "
            f"query heads, so --kv-heads must divide --heads (swapped?)"
        )
    return SequenceLayout(ulysses, ring, heads, kv, allgather=allgather, pad_heads=pad)


def _cmd_explain(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    config = selection_config_from_args(args)
    if args.implicit:
        if config.global_backend is None:
            raise UsageError(
                "--implicit marks --attention-backend as derived or defaulted (origin "
                "global_preference); give --attention-backend BACKEND as well"
            )
        config = attrs.evolve(config, global_backend_explicit=False, global_backend_env=None)
    if args.component_backend is not None and args.component is None:
        raise UsageError(
            "--component-backend is the override of one component: give --component NAME too"
        )
    _check_explain_overrides(args, config)
    layer = LayerSpec(
        head_size=args.head_size,
        dtype=args.dtype,
        supported=_split(args.supported),
        default=args.default,
        role=args.role,
        requirements=Requirements.of(args.requires or (), field="--requires"),
        name=args.layer_name,
        backend_options=_backend_options(args.backend_option),  # issue 23
        layout=_layout(args),
    )
    platform = _platform(args.platform)
    scope = (
        component_scope(args.component, backend=args.component_backend, require_selection=False)
        if args.component is not None
        else nullcontext()
    )
    with scope:
        trace = resolution_trace(layer, config, platform)
    outcome = trace.outcome
    if outcome.backend is not None and layer.backend_options:
        # issue 23: the function the backend runs on this platform takes the options
        check_layer_options(lookup_spec(outcome.backend), layer, trace.input.platform)
    if args.trace_out is not None:
        _write_trace(trace, _trace_out(args.trace_out, "a file name"))
    scheduled = _explain_schedule(args.schedule, trace, config)
    plan = autotune_plan(trace, config)
    if args.json:
        precision = describe_precision(trace)
        _emit_json(
            out,
            {
                "status": outcome.status,
                "backend": None if outcome.backend is None else outcome.backend.name,
                "reason": outcome.reason,
                "origin": str(outcome.origin),
                "error": outcome.error,
                "code": outcome.code,
                "autotune": plan,
                "trace": trace_to_dict(trace),
                "explanation": explain(trace).to_dict(),
                # issue 23: present with --schedule only
                **({} if scheduled is None else {"schedule": scheduled}),
                # issue 34: present for a layer with an error budget only
                **({"precision": precision} if precision else {}),
            },
        )
    else:
        lines = _render_explain(trace)
        if plan is not None:
            lines += _field("autotune:", plan["detail"], _width())
        for row in scheduled or ():
            runs = row["backend"] or f"rejected ({row['code']}): {row['error']}"
            lines += _field(f"step {row['from_step']}+:", f"{row['requested']} -> {runs}", _width())
        _emit(out, lines)
    # a schedule with a step the layer cannot run would refuse to start (all or nothing)
    schedule_ok = all(row["backend"] is not None for row in scheduled or ())
    return EXIT_OK if outcome.status == Status.SELECTED and schedule_ok else EXIT_REJECTED


def _backend_option_argument(group: Any, scope: str) -> None:
    """``--backend-option`` (issue 23), as ``explain`` and ``plan`` take it."""
    group.add_argument(
        "--backend-option",
        action="append",
        metavar="X.OPTION=VALUE",
        help=f"a typed kernel option of backend X{scope}, e.g. fa.deterministic=true "
        "(repeatable; docs/backends.md#per-backend-options)",
    )


def _backend_options(given: list[str] | None) -> dict[str, dict[str, object]] | None:
    """``--backend-option BACKEND.OPTION=VALUE`` (repeatable; issue 23) as a mapping."""
    if not given:
        return None
    options: dict[str, dict[str, object]] = {}
    for text in given:
        try:
            backend, name, value = parse_backend_option(text)
        except ValueError as exc:
            raise UsageError(f"--backend-option: {exc}") from None
        given_for = options.setdefault(backend, {})
        if name in given_for and (type(given_for[name]), given_for[name]) != (type(value), value):
            # issue 32 item 17: a repeated option that contradicts itself never
            # takes the last value silently
            raise UsageError(
                f"--backend-option: {backend}.{name} is given twice with different values "
                f"({given_for[name]!r} and {value!r}); give it once"
            )
        given_for[name] = value
    return options


def _explain_schedule(
    schedule: str | None, trace: Trace, config: SelectionConfig
) -> list[dict[str, Any]] | None:
    """``--schedule``: each step's backend for the layer ``trace`` resolved, in the
    same component scope and on the same platform (issue 23), or ``None``. A bad
    ``--schedule`` is an ``InvalidArgumentError``, which :func:`main` reports (exit 2)."""
    if schedule is None:
        return None
    inp = trace.input
    return [
        {
            "from_step": first,
            "requested": backend.name,
            "backend": None if t.outcome.backend is None else t.outcome.backend.name,
            "code": None if t.outcome.code is None else str(t.outcome.code),
            "error": t.outcome.error,
            "digest": t.digest,
        }
        for first, backend, t in plan_schedule(
            inp.layer, parse_schedule(schedule), config, inp.platform, inp.scope
        )
    ]


def _check_explain_overrides(args: argparse.Namespace, config: SelectionConfig) -> None:
    """``--attention-backend COMPONENT[.ROLE]=X`` in explain must name the component
    explained, and agree with ``--component-backend`` when both name its backend."""
    import difflib

    for key, backend in config.component_backends:
        component, role = split_component_key(key)
        if component != args.component:
            if args.component is None:
                raise UsageError(
                    f"--attention-backend {key}={backend.name}: explain resolves this "
                    f"layer outside any component; give --component {component} to explain "
                    f"it inside that component"
                )
            close = difflib.get_close_matches(component, [args.component], n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(
                f"--attention-backend {key}={backend.name}: the component explained is "
                f"{args.component!r}, not {component!r}{hint}"
            )
        if args.component_backend is not None and role is None:
            flag = Backend.parse(args.component_backend).name
            if flag != backend.name:
                raise UsageError(
                    f"component {component!r} was given two backends: --component-backend "
                    f"{flag} and --attention-backend {key}={backend.name}; give one"
                )


def _trace_out(text: str, what: str) -> Path:
    if not text.strip():
        raise UsageError(f"--trace-out needs {what}, got an empty string")
    return Path(text)


def _write_trace(trace: Trace, path: Path) -> None:
    try:
        dump_trace(trace, path)
    except OSError as exc:
        raise UsageError(f"cannot write trace file {str(path)!r}: {exc.strerror or exc}") from None


def _render_explain(trace: Trace) -> list[str]:
    width = _width()
    inp, outcome = trace.input, trace.outcome
    why = explain(trace)
    lines: list[str] = []
    if outcome.status == Status.SELECTED:
        assert outcome.backend is not None
        lines.append(f"Decision:  selected {outcome.backend.name}")
    else:
        lines.append(f"Decision:  rejected ({outcome.code})")
    detail = f" - {why.origin_detail}" if why.origin_detail is not None else ""
    lines += _field("Origin:", f"{outcome.origin}{detail}", width)
    lines += _field("Reason:", _opt(outcome.reason), width)
    lines.append("")
    lines += _field("Layer:", describe_layer(inp.layer), width)
    if inp.layer.layout is not None:  # issue 24: the per-rank decision
        backend = None if outcome.backend is None else outcome.backend.name
        lines += _field("Per rank:", inp.layer.layout.per_rank(backend), width)
    scope = inp.scope
    if scope is None:
        lines += _field("Component:", "none (no component scope)", width)
    else:
        policy = "allows" if scope.allow_global_fallback else "does not allow"
        override = f"; override {scope.backend.name}" if scope.backend else ""
        lines += _field(
            "Component:",
            f"{scope.component} (kind {scope.kind}, {scope.loader}: {policy} global fallback"
            f"{override})",
            width,
        )
    lines += _field("Platform:", _platform_text(inp.platform), width)
    lines += _field("Request:", request_text(inp.config, "implicit preference"), width)
    precision = describe_precision(trace)  # issue 34: only for a layer with a budget
    if precision:
        lines += _field("Precision:", precision, width)
    lines.append("")
    lines += _wrap(
        "Candidates (every check in order; '->' rows are the machine's transitions):", width
    )
    rows: list[list[str]] = []
    last: tuple[str, str] | None = None
    for row in why.rows:
        if row.kind == "check":
            assert row.stage is not None and row.candidate is not None and row.check is not None
            key = (row.stage.value, row.candidate.name)
            stage, cand = key if key != last else ("", "")
            last = key
            rows.append([stage, cand, row.check.value, "pass" if row.passed else "FAIL",
                         row.detail])  # fmt: skip
        elif row.kind == "skip":
            assert row.stage is not None and row.candidate is not None
            last = None
            rows.append([row.stage.value, row.candidate.name, "(skipped)", "", row.detail])
        else:
            last = None
            rows.append(["", "", "", "->", row.detail])
    lines += _table(
        ["stage", "candidate", "check", "verdict", "reason"],
        rows,
        width=width,
        wrap=[4],
    )
    lines.append("")
    lines += _wrap(why.why, width, "Why: ", "     ")
    return lines


# =============================================================================
# plan
# =============================================================================


def _cmd_plan(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Plan a pipeline file or a model folder: two loaders of one plan model
    (:class:`~attnres.plan.PlanResult`), rendered, serialised and written by one path."""
    from attnres.plan import load_pipeline, plan_pipeline, render_plan, with_layout

    layout = _layout(args)  # issue 24: --ulysses-degree / --ring-degree
    auto = _auto_layout(args)  # issue 35: --sp-degree
    config = selection_config_from_args(args)
    options = _backend_options(args.backend_option)  # issue 23: under each layer's own
    if options is not None:
        config = attrs.evolve(config, backend_options=options)
    if Path(args.pipeline).is_dir():
        if layout is not None:
            raise UsageError(
                "--ulysses-degree and --ring-degree apply to a pipeline file (attnres plan "
                "PIPELINE.toml) for now; a model folder's layout is not read yet: plan the "
                "folder without them, and check its denoiser's layers under a layout with "
                "attnres explain --heads N (docs/sequence-parallel.md#which-layers-take-a-layout)"
            )
        from attnres.integrations._folder import parse_dtype_args, plan_folder

        platform = _platform(args.platform)
        dtypes = parse_dtype_args(args.dtype or [])
        result = plan_folder(
            Path(args.pipeline), config, platform, dtypes, component=args.component, sp=auto
        )
        _check_component_overrides(
            config, [c.name for c in result.components], f"the folder {args.pipeline}"
        )
    else:
        if args.dtype:
            raise UsageError(
                "--dtype applies to a model folder (attnres plan DIR); a pipeline file gives "
                "each layer's dtype itself"
            )
        if args.component is not None:
            raise UsageError(
                "--component names the component of a single model folder (attnres plan DIR); "
                "a pipeline file names its components itself"
            )
        pipeline = with_layout(load_pipeline(args.pipeline), layout)
        _check_component_overrides(
            config,
            [c.name for c in pipeline.components],
            f"the pipeline {pipeline.name!r} ({pipeline.path})",
        )
        platform = _platform(args.platform)
        result = plan_pipeline(pipeline, config, platform)
    pipeline = result.pipeline
    doc = result.to_dict()
    written: list[Path] = []
    if args.trace_out is not None:
        # a TraceWriteError (an OSError) is reported by main(), exit 2
        written = result.dump_traces(_trace_out(args.trace_out, "a folder name"))
        layer_docs = [la for c in doc["components"] for la in c["layers"]]
        for layer_doc, path in zip(layer_docs, written, strict=True):
            layer_doc["trace_file"] = str(path)
    _log().info(
        "plan finished",
        pipeline=pipeline.name,
        status=result.status,
        layers=len(result.layers),
    )
    tunable = 0
    if config.autotune:
        for component_doc, planned in zip(doc["components"], result.components, strict=True):
            for layer_doc, layer in zip(component_doc["layers"], planned.layers, strict=True):
                layer_doc["autotune"] = is_tunable(layer.trace)
                tunable += layer.count if layer_doc["autotune"] else 0
    if layout is not None:  # issue 24: which components run under the layout
        doc["layout"] = {
            "ulysses": layout.ulysses,
            "ring": layout.ring,
            **({"allgather": layout.allgather} if layout.allgather > 1 else {}),
            **({"pad_heads": True} if layout.pad_heads else {}),
            "components": [c.name for c in pipeline.components if c.resolved_kind in LAYOUT_KINDS],
        }
    choices = _layout_choices(result) if auto is not None else []
    if auto is not None:  # issue 35: the layout chosen per site
        doc["layout_choice"] = {"sp_degree": auto.degree, "sites": choices}
    if args.json:
        _emit_json(out, doc)
    else:
        lines = render_plan(result)
        if layout is not None:
            lines += _plan_layout_lines(pipeline, layout)
        if auto is not None:
            lines += _layout_choice_lines(auto, choices)
        if config.autotune:
            total = sum(layer.count for layer in result.layers)
            lines += _field(
                "Autotune:",
                f"{tunable} of {total} layers would be measured on their first forward of at "
                f"least {config.autotune_min_elements} query elements (automatic decisions: "
                f"origins none, layer_default, global_preference); the others are explicit "
                f"choices and keep their backend",
                _width(),
            )
        if written:
            lines += _wrap(
                f"Traces: {_plural(len(written), 'file')} written to {args.trace_out}",
                _width(),
                "",
                "  ",
            )
        _emit(out, lines)
    return EXIT_OK if result.ok else EXIT_REJECTED


def _check_component_overrides(config: SelectionConfig, names: Sequence[str], where: str) -> None:
    """Every ``--attention-backend COMPONENT[.ROLE]=X`` names a component of the plan."""
    known = {split_component_key(n)[0] for n in names}
    for component, backend in config.component_backends:
        if split_component_key(component)[0] not in known:
            raise UsageError(
                f"--attention-backend {component}={backend.name}: {where} has no "
                f"component {split_component_key(component)[0]!r}; its components: "
                f"{', '.join(names)}"
            )


def _layout_choices(result: Any) -> list[dict[str, Any]]:
    """Issue 35: each planned layer's chosen layout (``--sp-degree``), in plan order."""
    out: list[dict[str, Any]] = []
    for component in result.components:
        for layer in component.layers:
            chosen = layer.trace.input.layer.layout
            if chosen is None or chosen.rule is None:
                continue
            out.append(
                {
                    "component": component.name,
                    "layer": layer.name,
                    "count": layer.count,
                    "layout": chosen.ulysses_ring(),
                    "rule": chosen.rule,
                    "why": chosen.why,
                    "backend": None if layer.backend is None else layer.backend.name,
                }
            )
    return out


def _layout_choice_lines(auto: Any, choices: list[dict[str, Any]]) -> list[str]:
    """Issue 35: the ``--sp-degree`` choice per site, as plan lines."""
    width = _width()
    if not choices:
        return [
            "",
            *_field(
                "Layout:",
                f"--sp-degree {auto.degree}: no denoiser site with head facts to lay out "
                f"(sites decided at their first call run without a layout)",
                width,
            ),
        ]
    lines = [
        "",
        *_field("Layout:", f"chosen for {auto.degree} ranks (layout='auto'), per site", width),
    ]
    for choice in choices:
        lines += _wrap(
            f"{choice['component']} {choice['layer']} (x{choice['count']}): "
            f"{choice['layout']} on {choice['backend'] or 'no backend'}, rule {choice['rule']}",
            width,
            "  ",
            "    ",
        )
    why = {c["rule"]: c["why"] for c in choices}
    for rule, text in why.items():
        lines += _wrap(f"{rule}: {text}", width, "  ", "    ")
    return lines


def _plan_layout_lines(pipeline: Any, layout: SequenceLayout) -> list[str]:
    """Issue 24: the plan's layout, per component (the layers above carry its checks)."""
    taking = [c.name for c in pipeline.components if c.resolved_kind in LAYOUT_KINDS]
    others = [c.name for c in pipeline.components if c.resolved_kind not in LAYOUT_KINDS]
    text = (
        f"{layout.ulysses_ring()} over {layout.degree} ranks on "
        f"{', '.join(taking) or 'no component'} (kinds: {', '.join(sorted(LAYOUT_KINDS))}); "
        f"each rank runs the decision above on 1/{layout.degree} of the sequence"
    )
    if layout.ulysses > 1:
        text += f" and 1/{layout.ulysses} of the heads (a pipeline file gives no head counts)"
    if others:
        text += f"; {', '.join(others)} run replicated, without a layout"
    return ["", *_field("Layout:", text, _width())]


# =============================================================================
# replay
# =============================================================================


def _cmd_replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    run = replay_paths(list(args.paths), update=args.update)
    return render_replay(run, args.update, out, err)


def render_replay(run: ReplayRun, update: bool, out: TextIO, err: TextIO) -> int:
    """Print a :class:`~attnres.replayer.ReplayRun`: ``ok   PATH`` / ``DIFF PATH`` (+ diff).

    Exit code: 0 when everything matches (or was updated), 1 when a replay
    diverged (without ``--update``), 2 when a path names nothing or a file is not
    a valid trace (its message goes to ``err``, no traceback).
    """
    for path in run.flagged:
        print(f"ERR  {path}", file=out)
    for problem in run.path_problems:
        print(f"attnres replay: error: {problem}", file=err)
    for entry in run.entries:
        if entry.status == ReplayStatus.INVALID:
            print(f"ERR  {entry.path}", file=out)
            print(f"attnres replay: error: {entry.error}", file=err)
        elif entry.status == ReplayStatus.OK:
            print(f"ok   {entry.path}", file=out)
        else:
            diff = "" if entry.result is None else entry.result.diff
            print(f"DIFF {entry.path}", file=out)
            print("\n".join("    " + line for line in diff.splitlines()), file=out)
            if entry.error is not None:
                print(f"attnres replay: error: {entry.error}", file=err)
            elif entry.updated:
                print(f"    updated {entry.path} from the replay", file=out)
    if len(run.entries) > 1:
        ok, diverged, invalid = run.count("ok"), run.count("diff"), run.invalid_count
        parts = [f"{ok} ok", f"{diverged} {'updated' if update else 'differ'}"]
        if invalid:
            parts.append(f"{invalid} invalid")
        if run.path_problems:
            parts.append(_plural(len(run.path_problems), "other error"))
        print(f"replayed {_plural(len(run.entries), 'trace')}: {', '.join(parts)}", file=out)
    if run.invalid:
        return EXIT_USAGE
    if run.diverged:
        return EXIT_REJECTED
    return EXIT_OK


# =============================================================================
# doctor
# =============================================================================


def _cmd_doctor(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import attnres

    platform = Platform.detect()
    failures = plugin_failures()
    chain = [b.name for b in platform.default_chain()]
    users: dict[str, list[str]] = {}  # package -> the backends that need it
    for spec in registered_backends():
        for package in spec.packages:
            users.setdefault(package, []).append(spec.name)
    doc: dict[str, Any] = {
        "attnres_version": attnres.__version__,
        "python": sys.version.split()[0],
        "platform": platform_document(platform),
        "default_chain": chain,
        "packages": [
            {
                "name": fact.name,
                "backends": users.get(fact.name, []),
                "status": fact.status,
                "version": fact.version,
                "distribution": fact.distribution,
                "detail": fact.detail,
            }
            for fact in platform.packages
        ],
        "kernels": _installed_kernels(platform),
        "plugin_failures": [attrs.asdict(f) for f in failures],
        "notes": list(platform.notes),
        "environment": environment_document(),
    }
    if args.json:
        _emit_json(out, doc)
        return EXIT_OK
    width = _width()
    cap = platform.capability
    lines = [f"attnres {attnres.__version__} (python {doc['python']})", "", "Platform"]
    for label, value in (
        ("kind", platform.kind),
        ("device", _opt(platform.device_name)),
        ("capability", f"sm{cap[0]}{cap[1]}" if cap else _opt(platform.arch)),
        ("torch", _opt(platform.torch_version)),
        ("default chain", " -> ".join(chain) or "-"),
    ):
        lines += _field(f"  {label}:", value, width, 18)
    lines += ["", "Optional kernel packages"]
    rows = [
        [
            fact.name,
            ", ".join(users.get(fact.name, [])) or "-",
            fact.status,
            fact.describe() if fact.status == PackageStatus.PRESENT else _opt(fact.detail),
        ]
        for fact in platform.packages
    ]
    lines += _table(
        ["package", "backends", "status", "version / why unusable"],
        rows,
        width=width,
        wrap=[3, 1],
    )
    lines += ["", "Kernels installed here (facts for their version and GPU)"]
    if doc["kernels"]:
        for kernel in doc["kernels"]:
            lines += _wrap(
                f"{kernel['backend']}: {kernel['kernel']} ({kernel['installed']}); head sizes "
                f"{kernel['head_sizes']}; dtypes {', '.join(kernel['dtypes'])}; "
                f"{kernel['masks']}; options: {', '.join(kernel['options']) or 'none'}",
                width,
                "  - ",
                "    ",
            )
    else:
        lines.append("  no optional kernel package is installed")
    lines += ["", f"Plugins (entry-point group {ENTRY_POINT_GROUP})"]
    if failures:
        lines += _table(
            ["entry point", "error"],
            [[f.entry_point, f.error] for f in failures],
            width=width,
            wrap=[0, 1],
        )
    else:
        lines.append("  no plugin failed to load")
    env = doc["environment"]
    lines += ["", "Environment"]
    lines += _wrap(f"{ENV_VAR}: {env['summary']}", width, "  ", "    ")
    lines += ["", "Platform notes"]
    if platform.notes:
        for note in platform.notes:
            lines += _wrap(note, width, "  - ", "    ")
    else:
        lines.append("  none")
    _emit(out, lines)
    return EXIT_OK


def _installed_kernels(platform: Platform) -> list[dict[str, Any]]:
    """Issue 31: per backend whose package is present here, which kernel the
    catalogue takes it for (its version's and this GPU's facts) and what they say."""
    out: list[dict[str, Any]] = []
    for base in registered_backends():
        fact = None if base.package is None else platform.package(base.package)
        if fact is None or not fact.usable:
            continue
        spec, applied = platform.installed(base)
        masks = [f"{m.kind.value.replace('_', ' ')} {m.route.value}" for m in spec.masks]
        out.append(
            {
                "backend": spec.name,
                "package": base.package,
                "installed": fact.describe(),
                "kernel": "; ".join(v.kernel for v in applied) or spec.release or spec.description,
                "facts": [
                    {"kernel": v.kernel, "applies": v.describe(), "source": v.source}
                    for v in applied
                ],
                "head_sizes": spec.head_sizes.describe(),
                "dtypes": [d for d in DTYPES if d in spec.dtypes],
                "masks": "masks: " + (", ".join(masks) or "none"),
                "lse": spec.lse is not None,
                "options": [o.name for o in spec.options],
            }
        )
    return out


# =============================================================================
# backends
# =============================================================================

_DTYPE_SHORT = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "fp8e4m3",
    "float8_e5m2": "fp8e5m2",
}
_REQ_SHORT = {
    Requirement.CAUSAL: "causal",
    Requirement.ATTN_MASK: "mask",
    Requirement.PACKED_VARLEN: "varlen",
    Requirement.GQA: "gqa",
    Requirement.DROPOUT: "dropout",
    Requirement.BACKWARD: "backward",
    Requirement.CUSTOM_SCALE: "scale",
    Requirement.SOFTCAP: "softcap",
    Requirement.SLIDING_WINDOW: "window",
    Requirement.SINKS: "sinks",
    Requirement.WEIGHTS: "weights",
}


def _runs_on(spec: BackendSpec) -> str:
    if len(spec.platforms) == len(PLATFORM_KINDS) and not spec.capabilities:
        return "all"
    parts = []
    for kind in vocabulary_sorted(spec.platforms):
        rule = spec.capabilities.get(kind)
        parts.append(kind if rule is None else f"{kind} {rule.describe()}")
    return ", ".join(parts)


def _backend_note(spec: BackendSpec) -> str:
    implements = ", ".join(_REQ_SHORT[r] for r in Requirement if r in spec.implements)
    parts = [f"implements: {implements or 'none of the requirements'}"]
    unpads = [m.kind.value.replace("_", " ") for m in spec.masks if m.route is MaskRoute.UNPAD]
    if unpads:  # issue 22: mask kinds taken through the varlen entry point
        parts.append(f"{', '.join(unpads)} by unpadding")
    if spec.limits:
        parts.append("not: " + "; ".join(limit.describe() for limit in spec.limits))
    for dtype, rule in sorted(spec.dtype_capabilities.items()):
        parts.append(f"{_DTYPE_SHORT.get(dtype, dtype)} only on {rule.describe()}")
    package = spec.package or "torch"
    if spec.package_alternatives:
        package += " (or " + " or ".join(spec.package_alternatives) + ")"
    if spec.extra_packages:
        package += " and " + " and ".join(spec.extra_packages)
    parts.append(f"package: {package}")
    if spec.min_torch:
        parts.append(
            "needs "
            + ", ".join(
                f"torch >= {major}.{minor} on {kind}"
                for kind, (major, minor) in sorted(spec.min_torch.items())
            )
        )
    if spec.satisfies:
        parts.append(
            "counts as "
            + " or ".join("+".join(sorted(group)) for group in spec.satisfies)
            + " in a supported set"
        )
    if spec.aliases:
        parts.append(f"aliases: {', '.join(spec.aliases)}")
    # issue 31: which kernel version the facts describe, and where others differ
    if spec.release:
        parts.append(f"facts for: {spec.release}")
    for variant in spec.variants:
        changed = ", ".join(sorted(variant.changes))
        parts.append(f"{variant.describe()}: {variant.kernel} (other {changed})")
    for option_limit in spec.option_limits:
        parts.append(f"refuses option {option_limit.describe()}")
    for refusal in spec.refuses:
        parts.append(f"refuses at call time: {refusal}")
    # issue 34: exact to its dtype, or lossy and how (per version range and GPU)
    for fact in spec.precision:
        where = fact.applies.describe()
        where = "" if where == "always" else f" {where}"
        parts.append(f"precision{where}: {fact.describe()}")
    return "; ".join(parts)


def _cmd_backends(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    specs = registered_backends()
    failures = plugin_failures()
    if args.json:
        _emit_json(
            out,
            {
                "backends": [spec_document(s) for s in specs],
                "plugin_failures": [attrs.asdict(f) for f in failures],
            },
        )
        return EXIT_OK
    width = _width()
    rows = [
        [
            spec.name,
            spec.kind,
            _runs_on(spec),
            " ".join(_DTYPE_SHORT.get(d, d) for d in vocabulary_sorted(spec.dtypes)),
            spec.head_sizes.describe(),
        ]
        for spec in specs
    ]
    lines = [f"{len(specs)} registered attention backends"]
    lines += _table(
        ["name", "kind", "runs on", "dtypes", "head size"],
        rows,
        width=width,
        wrap=[2, 3, 4],
        indent=0,
        min_width=10,
        notes=[_backend_note(spec) for spec in specs],
    )
    lines.append("")
    lines += _wrap(
        "requirements: "
        + ", ".join(f"{_REQ_SHORT[r]} ({REQUIREMENT_PHRASES[r]})" for r in Requirement),
        width,
        "",
        "  ",
    )
    if failures:
        lines += ["", f"Plugins that failed to load (entry-point group {ENTRY_POINT_GROUP}):"]
        for f in failures:
            lines += _wrap(f"{f.entry_point}: {f.error}", width, "  - ", "    ")
    _emit(out, lines)
    return EXIT_OK


# =============================================================================
# calibrate (issue 34)
# =============================================================================


def _cmd_calibrate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from attnres.plan import load_pipeline, plan_pipeline
    from attnres.precision import calibrate_plan, load_calibration, save_calibration

    if args.tokens < 1 or args.heads < 1:
        raise UsageError("--tokens and --heads must be at least 1")
    config = selection_config_from_args(args)
    pipeline = load_pipeline(args.pipeline)
    platform = _platform(args.platform)
    result = plan_pipeline(pipeline, config, platform)
    results = None if args.load is None else load_calibration(args.load)
    report = calibrate_plan(
        result, tokens=args.tokens, heads=args.heads, seed=args.seed, results=results
    )
    if args.save is not None:
        save_calibration(report, args.save)
    if args.trace_out is not None:
        directory = _trace_out(args.trace_out, "a folder name")
        directory.mkdir(parents=True, exist_ok=True)
        for site in report.sites:
            if site.trace is not None:
                name = f"{site.component}--{site.site}".replace("/", "_") + ".json"
                _write_trace(site.trace, directory / name)
    if args.json:
        _emit_json(out, {"status": "ok" if report.ok else "rejected", **report.to_dict()})
    else:
        lines: list[str] = []
        for line in report.render():
            lines += _wrap(line.strip(), _width(), "  " if line.startswith("  ") else "", "      ")
        if args.save is not None:
            lines.append(f"Saved: {args.save}")
        _emit(out, lines)
    return EXIT_OK if report.ok else EXIT_REJECTED


# =============================================================================
# The parser and main()
# =============================================================================


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=_width(), max_help_position=32)


def _logging_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    default: Any = None if top else argparse.SUPPRESS
    parser.add_argument(
        "--log-format",
        choices=("console", "json"),
        default="console" if top else argparse.SUPPRESS,
        help="how log events are rendered on stderr (default: console)",
    )
    parser.add_argument(
        "--log-level",
        choices=tuple(_LOG_LEVELS),
        default=default,
        help="log attnres events at this level and above to stderr (default: no logging)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``attnres`` argument parser."""
    import attnres

    parser = argparse.ArgumentParser(
        prog="attnres",
        description=("Decide which attention kernel every layer of a pipeline runs, and show why."),
        epilog=(
            "exit codes: 0 success, 1 a resolution was rejected or a replay diverged, "
            "2 bad usage or bad input, 70 an internal error (a bug in attnres), "
            "130 interrupted, 143 terminated (SIGTERM)"
        ),
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"attnres {attnres.__version__}")
    _logging_options(parser, top=True)
    common = argparse.ArgumentParser(add_help=False)
    _logging_options(common, top=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str, handler: Callable[..., int]) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            parents=[common],
            formatter_class=_Formatter,
        )
        sub.set_defaults(handler=handler)
        return sub

    explain = command(
        "explain", "resolve one layer and show every check of every candidate", _cmd_explain
    )
    layer = explain.add_argument_group("the layer")
    layer.add_argument("--head-size", type=int, required=True, metavar="N", help="size of one head")
    layer.add_argument(
        "--dtype", required=True, metavar="D", help=f"one of {', '.join(DTYPES)} or bf16, fp16..."
    )
    layer.add_argument("--role", default="self", metavar="self|cross", help="default: self")
    layer.add_argument("--supported", metavar="A,B", help="the backends the layer supports")
    layer.add_argument("--default", metavar="X", help="the layer's declared default backend")
    layer.add_argument(
        "--requires",
        metavar="R,...",
        help="requirements: " + ", ".join(r.value for r in Requirement),
    )
    layer.add_argument("--layer-name", metavar="NAME", help="a name for the layer (in traces)")
    _layout_arguments(layer, heads=True)
    where = explain.add_argument_group("where and how it is resolved")
    where.add_argument("--component", metavar="NAME", help="resolve inside this component's scope")
    where.add_argument(
        "--component-backend", metavar="X", help="the component's override (needs --component)"
    )
    add_selection_arguments(where)
    where.add_argument(
        "--implicit",
        action="store_true",
        help="treat --attention-backend as derived or defaulted, not typed (origin "
        "global_preference)",
    )
    where.add_argument(
        "--platform",
        metavar="SPEC",
        help="simulate a platform, e.g. cuda:sm90+flash_attn (default: detect this machine)",
    )
    where.add_argument(
        "--schedule",
        metavar="STEP:X,...",
        help="also show what the layer runs on a per-step schedule, e.g. 0:sage_attn,40:fa "
        "(attnres.schedule)",
    )
    _backend_option_argument(where, "")
    output = explain.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument("--trace-out", metavar="FILE", help="write the replayable trace here")

    plan = command(
        "plan", "plan every layer of a pipeline file (TOML) or a model folder", _cmd_plan
    )
    plan.add_argument("pipeline", metavar="PIPELINE.toml|DIR")
    plan.add_argument(
        "--dtype",
        action="append",
        metavar="[COMPONENT=]DTYPE",
        help="a model folder's compute dtype, for all components or one (repeatable)",
    )
    plan.add_argument(
        "--component",
        metavar="NAME",
        help="the component a single model folder is (default: read from its config)",
    )
    add_selection_arguments(plan)
    plan.add_argument(
        "--platform", metavar="SPEC", help="simulate a platform (default: detect this machine)"
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument(
        "--trace-out", metavar="DIR", help="write one trace per distinct layer into DIR"
    )
    _layout_arguments(plan, heads=False)
    _auto_layout_arguments(plan)
    _backend_option_argument(
        plan, " for every layer (or site of a model folder), under a layer's own backend_options"
    )

    # issue 34: measured error against a float64 reference (docs/precision.md)
    calibrate = command(
        "calibrate",
        "plan a pipeline file, then measure each lossy layer's error (emulated where the "
        "kernel cannot run) and resolve it again with the measurement",
        _cmd_calibrate,
    )
    calibrate.add_argument("pipeline", metavar="PIPELINE.toml")
    add_selection_arguments(calibrate)
    calibrate.add_argument(
        "--platform", metavar="SPEC", help="simulate a platform (default: detect this machine)"
    )
    calibrate.add_argument(
        "--tokens", type=int, default=1024, metavar="N", help="tokens per synthetic input"
    )
    calibrate.add_argument(
        "--heads", type=int, default=8, metavar="N", help="heads per synthetic input"
    )
    calibrate.add_argument("--seed", type=int, default=0, metavar="S", help="input seed")
    calibrate.add_argument("--save", metavar="FILE", help="write the measurements here")
    calibrate.add_argument(
        "--load", metavar="FILE", help="take the measurements from this results file"
    )
    calibrate.add_argument("--json", action="store_true", help="print one JSON object")
    calibrate.add_argument(
        "--trace-out", metavar="DIR", help="write each layer's trace, with its measurement"
    )

    replay = command(
        "replay", "replay golden trace files and compare (--update rewrites them)", _cmd_replay
    )
    replay.add_argument("paths", nargs="+", metavar="PATH")
    replay.add_argument("--update", action="store_true", help="rewrite traces that diverge")

    doctor = command(
        "doctor", "show this machine's platform, kernel packages and plugins", _cmd_doctor
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")

    backends = command("backends", "show the registered backend catalogue", _cmd_backends)
    backends.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``attnres``; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    out, err = sys.stdout, sys.stderr
    prog = f"attnres {args.command}"
    with _cli_logging(args.log_format, args.log_level, err), _sigterm_unwinds():
        try:
            handler: Callable[[argparse.Namespace, TextIO, TextIO], int] = args.handler
            code = handler(args, out, err)
            out.flush()
            return code
        except ValueError as exc:  # UsageError and every attnres input error
            _error(err, str(exc), prog)
            return EXIT_USAGE
        except OSError as exc:
            if isinstance(exc, BrokenPipeError):
                _silence_stdout()
                return EXIT_OK
            where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
            _error(err, f"{where}{exc.strerror or exc}", prog)
            return EXIT_USAGE
        except KeyboardInterrupt:
            _error(err, "interrupted", prog)
            return 130
        except _Terminated:
            _error(err, "terminated (SIGTERM)", prog)
            return 143
        except Exception as exc:
            _log().error("internal error", command=args.command, exc_info=True)
            _error(
                err,
                f"internal error: {type(exc).__name__}: {exc} (this is a bug in attnres; "
                f"run again with --log-level error to see the traceback)",
                prog,
            )
            return EXIT_INTERNAL


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
