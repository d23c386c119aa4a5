"""Coverage-guided fuzz targets for every loader of a file attnres reads (issue 20).

One target per loader; each writes the fuzzer's bytes to a file and hands it to
the loader, the way a user's file reaches it. Issue 32 adds one target per
parser of 0.3's surface: the command line (``cli``: every trace it writes must
read back and replay), backend options, schedule specs, layouts and degrees,
``--platform`` and ``--dtype`` forms. Each entry point may refuse its input
only with the error type its documentation names (:data:`ERRORS`: a
``TraceFormatError`` from the trace loader, not any ``ValueError``); anything
else -- another exception, a hang, runaway memory -- is a crash, and atheris
writes the input that caused it to ``fuzz/crashes/TARGET-crash-*``. Every crash
found goes into the bad-input catalogue (``tests/test_bad_inputs.py``: a row
with the error it must give) and into ``fuzz/corpus/TARGET/`` (which
``tests/test_fuzz_corpus.py`` replays in every test run).

    python fuzz/fuzz_attnres.py TARGET [libFuzzer options] [CORPUS_DIR ...]

Targets: trace, replay, pipeline, folder, config (structure-aware: hostile
values for a config's own keys), header, results, cli (``explain``, or ``plan``
of an example pipeline), option, schedule,
layout, platform, dtype. ``make fuzz`` runs
each for ``FUZZ_SECONDS`` (default 10) on its seed corpus ``fuzz/corpus/TARGET``
(``fuzz/make_corpus.py`` writes the seeds from the repository's own traces,
pipelines and example folders).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

try:
    import atheris
except ImportError:  # tests/test_fuzz_corpus.py replays the corpus without it
    atheris = None

with atheris.instrument_imports(include=["attnres"]) if atheris else contextlib.nullcontext():
    from attnres._schedule_plan import parse_schedule
    from attnres._vocab import normalize_dtype
    from attnres.backends import parse_backend_option
    from attnres.cli import main as cli_main
    from attnres.errors import (
        AttnresError,
        BackendOptionError,
        FolderBuildError,
        InvalidArgumentError,
        PipelineError,
        ResultsFileError,
        SequenceParallelArgumentError,
        TraceFormatError,
        UnknownBackendError,
    )
    from attnres.integrations import plan_folder
    from attnres.integrations._folder import parse_dtype_args
    from attnres.integrations._untrusted import dtype_from_weights
    from attnres.layout import SequenceLayout
    from attnres.plan import load_pipeline
    from attnres.platform import Platform
    from attnres.replayer import replay
    from attnres.trace import load_trace
    from attnres.tuning import read_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_folders import tiny_folder

CPU = Platform.simulate("cpu")
_TMP = Path(tempfile.mkdtemp(prefix="attnres-fuzz-"))
#: the folder target edits one of these files of the tiny pipeline folder
FOLDER_FILES = (
    "model_index.json",
    "vae/config.json",
    "text_encoder/config.json",
    "vae/diffusion_pytorch_model.safetensors",
)


def _file(data: bytes, name: str) -> Path:
    path = _TMP / name
    path.write_bytes(data)
    return path


def trace(data: bytes) -> None:
    load_trace(_file(data, "input.json"))


def replay_target(data: bytes) -> None:
    replay(_file(data, "input.json"))


def pipeline(data: bytes) -> None:
    load_pipeline(_file(data, "input.toml"))


def results(data: bytes) -> None:
    read_results(_file(data, "results.json"))


def header(data: bytes) -> None:
    folder = _TMP / "weights"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(data)
    dtype_from_weights(folder)


def folder(data: bytes) -> None:
    """The first byte picks the file of the tiny pipeline folder; the rest is its content."""
    if not data:
        return
    root = _TMP / "pipe"
    if not root.exists():
        tiny_folder(root)
    name = FOLDER_FILES[data[0] % len(FOLDER_FILES)]
    saved = {n: (root / n).read_bytes() if (root / n).exists() else None for n in FOLDER_FILES}
    try:
        (root / name).write_bytes(data[1:])
        plan_folder(root, platform=CPU)
    finally:
        for n, content in saved.items():
            if content is None:
                if (root / n).exists():
                    os.unlink(root / n)
            else:
                (root / n).write_bytes(content)


#: values a hostile config gives a key (the config target)
HOSTILE = (
    0,
    -1,
    1,
    3,
    2**31 - 1,
    2**31,
    1024,
    1025,
    16385,
    0.5,
    -0.0,
    1e300,
    "",
    "x",
    "float8_e4m3fn",
    None,
    True,
    [],
    [0],
    [-1],
    [1, 2, 3],
    {},
    {"a": 1},
)


def config(data: bytes) -> None:
    """Structure-aware: a few keys of a tiny component's config set to hostile values
    (a key of the class's own config, so the build reads it)."""
    fdp = atheris.FuzzedDataProvider(data) if atheris else _Provider(data)
    root = _TMP / "cfg"
    component = ("vae", "text_encoder")[fdp.ConsumeIntInRange(0, 1)]
    keys = _config_keys(component)
    edits = {}
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        key = keys[fdp.ConsumeIntInRange(0, len(keys) - 1)]
        edits[key] = HOSTILE[fdp.ConsumeIntInRange(0, len(HOSTILE) - 1)]
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    tiny_folder(root, **{component: lambda d: d.update(edits)})
    plan_folder(root, platform=CPU)


class _Provider:
    """What the config target uses of atheris.FuzzedDataProvider, for replays without it."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def ConsumeIntInRange(self, low: int, high: int) -> int:  # atheris spells it so
        byte, self.data = (self.data[0], self.data[1:]) if self.data else (0, b"")
        return low + byte % (high - low + 1)


_KEYS: dict[str, list[str]] = {}


def _config_keys(component: str) -> list[str]:
    if component not in _KEYS:
        from tiny_folders import CONFIGS

        if component == "vae":
            import inspect

            from diffusers import AutoencoderKL

            names = inspect.signature(AutoencoderKL.__init__).parameters
            keys = [k for k in names if k != "self"]
        else:
            from transformers import T5Config

            keys = [k for k in T5Config().to_dict() if not k.startswith("_")]
        _KEYS[component] = sorted(set(keys) | set(CONFIGS[component]))
    return _KEYS[component]


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def option(data: bytes) -> None:
    """``--backend-option BACKEND.OPTION=VALUE``, as the CLI parses it."""
    parse_backend_option(_text(data))


def schedule(data: bytes) -> None:
    """``--schedule STEP:BACKEND,...``."""
    parse_schedule(_text(data))


def platform(data: bytes) -> None:
    """``--platform KIND[:ARCH][+PACKAGE...]``."""
    Platform.simulate(_text(data))


def dtype(data: bytes) -> None:
    """``--dtype D`` and ``--dtype COMPONENT=D`` (repeatable: one per line)."""
    values = _text(data).split("\n")
    normalize_dtype(values[0])
    parse_dtype_args(values)


def layout(data: bytes) -> None:
    """Degrees and head counts (any size, any sign), as the API takes them."""
    numbers = [int.from_bytes(chunk, "little", signed=True) for chunk in _chunks(data, 4)]
    ulysses, ring, heads, kv = ([*numbers, 1, 1, 0, 0])[:4]
    shape = SequenceLayout(ulysses, ring, heads or None, kv or None)
    shape.per_rank("fa")
    shape.describe()


def _chunks(data: bytes, n: int) -> list[bytes]:
    # a chunk's first byte says how long it is (1 to 600 bytes: huge numbers too)
    out = []
    while data and len(out) < n:
        size = 1 + data[0] % 600 if data[0] >= 0xF0 else 1 + data[0] % 4
        out.append(data[1 : 1 + size] or b"\0")
        data = data[1 + size :]
    return out


#: the subcommands and flags the cli target builds a command line from
_CLI_FLAGS = (
    "--head-size", "--dtype", "--platform", "--ulysses-degree", "--ring-degree", "--heads",
    "--kv-heads", "--schedule", "--backend-option", "--attention-backend", "--supported",
    "--default", "--requires", "--role", "--layer-name", "--component", "--autotune", "--json",
)  # fmt: skip


#: the flags of ``attnres plan`` (a command line whose first word is ``plan``)
_PLAN_FLAGS = (
    "--dtype", "--component", "--attention-backend", "--autotune", "--autotune-min-elements",
    "--platform", "--json", "--ulysses-degree", "--ring-degree", "--backend-option",
)  # fmt: skip
#: the pipeline file a ``plan`` command line plans (the smallest example)
_PLAN_PIPELINE = Path(__file__).resolve().parents[1] / "examples" / "audio-video.toml"


def cli(data: bytes) -> None:
    """``attnres explain`` with a command line from the fuzzer's bytes (NUL-separated
    words; a word of one byte below 32 is a flag): exit 0, 1 or 2 with a message,
    never an exception; a trace it writes reads back and replays. A first word
    ``plan`` makes it ``attnres plan`` of an example pipeline, ``--trace-out DIR``:
    every trace in DIR reads back and replays."""
    import shutil

    words = [_text(w) for w in data.split(b"\0")]
    if words[0] == "plan":
        argv = ["plan", str(_PLAN_PIPELINE), "--platform", "cpu"]
        flags, words = _PLAN_FLAGS, words[1:]
        out = _TMP / "cli-traces"
        shutil.rmtree(out, ignore_errors=True)
    else:
        argv = ["explain", "--head-size", "64", "--dtype", "bf16", "--platform", "cpu"]
        flags = _CLI_FLAGS
        out = _TMP / "cli-trace.json"
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
    for word in words:
        if len(word) == 1 and ord(word) < 32:
            argv.append(flags[ord(word) % len(flags)])
        else:
            argv.append(word)
    argv += ["--trace-out", str(out)]
    import io

    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            code = cli_main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code if isinstance(exc.code, int) else 2
    if code not in (0, 1, 2):
        raise AssertionError(f"exit {code}: {sink.getvalue()[-500:]}")
    # every trace attnres writes reads back and replays
    written = sorted(out.glob("*.json")) if out.is_dir() else [out] if out.exists() else []
    for path in written:
        result = replay(load_trace(path))
        if not result.ok:
            raise AssertionError(f"a written trace ({path.name}) does not replay: {result.diff}")


TARGETS: dict[str, Callable[[bytes], None]] = {
    "trace": trace,
    "replay": replay_target,
    "pipeline": pipeline,
    "folder": folder,
    "config": config,
    "header": header,
    "results": results,
    "cli": cli,
    "option": option,
    "schedule": schedule,
    "layout": layout,
    "platform": platform,
    "dtype": dtype,
}

#: the error each entry point's documentation names for a refused input
#: (docs/errors.md): ``InvalidArgumentError`` where the docs say "any other bad
#: value" (a platform string, a dtype, a schedule's steps; a schedule's unknown
#: backend is ``UnknownBackendError``), never a plain ``ValueError``; a layout's
#: degrees and head counts: ``SequenceParallelArgumentError`` (issue 32)
ERRORS: dict[str, tuple[type[BaseException], ...]] = {
    "trace": (TraceFormatError,),
    "replay": (TraceFormatError,),
    "pipeline": (PipelineError,),
    "folder": (FolderBuildError,),
    "config": (FolderBuildError,),
    "header": (FolderBuildError,),
    "results": (ResultsFileError,),
    "cli": (),
    "option": (BackendOptionError, UnknownBackendError),
    "schedule": (InvalidArgumentError, UnknownBackendError),
    "layout": (SequenceParallelArgumentError,),
    "platform": (InvalidArgumentError,),
    "dtype": (InvalidArgumentError,),
}


def run_one(target: Callable[[bytes], None], data: bytes) -> None:
    """One input: the entry point's documented error is an answer, anything else
    (another type, Python's own message) a crash."""
    name = next(n for n, t in TARGETS.items() if t is target)
    allowed = ERRORS[name]
    try:
        target(data)
    except allowed as exc:
        if not isinstance(exc, AttnresError):
            raise  # every documented error is attnres's own: anything else escaped
        if "Exceeds the limit" in str(exc) or "invalid literal" in str(exc):
            raise  # Python's own int() message, escaped through a ValueError


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer options] [CORPUS...]")
    target = TARGETS[sys.argv[1]]
    sys.setrecursionlimit(3000)
    atheris.Setup([sys.argv[0], *sys.argv[2:]], lambda data: run_one(target, data))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
