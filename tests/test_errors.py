"""Every exception attnres raises on purpose lives in ``attnres.errors`` under one base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import attnres
from attnres import errors


def _attnres_modules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(attnres.__path__, "attnres.")
        if info.name != "attnres.__main__"
    ]


def test_every_public_exception_class_is_defined_in_attnres_errors() -> None:
    elsewhere = []
    for name in _attnres_modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("attnres")
                and not attr.startswith("_")
                and obj.__module__ != "attnres.errors"
            ):
                elsewhere.append(f"{obj.__module__}.{attr}")
    assert elsewhere == []


def test_every_exception_in_attnres_errors_has_the_one_base() -> None:
    exceptions = [getattr(errors, name) for name in errors.__all__]
    assert all(issubclass(e, errors.AttnresError) for e in exceptions)
    # each keeps the built-in base of its kind, so existing except clauses hold
    assert issubclass(errors.ResolutionError, ValueError)
    assert issubclass(errors.KernelUnavailableError, ImportError)
    assert issubclass(errors.KernelNotRegisteredError, RuntimeError)
    assert issubclass(errors.TraceWriteError, OSError)


def test_old_homes_re_export_the_same_classes() -> None:
    from attnres.integrations._plan import IntegrationError
    from attnres.kernels import KernelUnavailableError
    from attnres.modules import KernelNotRegisteredError
    from attnres.plan import PipelineError
    from attnres.request import RequestBackendError

    assert IntegrationError is errors.IntegrationError
    assert KernelUnavailableError is errors.KernelUnavailableError
    assert KernelNotRegisteredError is errors.KernelNotRegisteredError
    assert PipelineError is errors.PipelineError
    assert RequestBackendError is errors.RequestBackendError


def test_all_and_dir_list_the_lazy_names_and_each_resolves() -> None:
    for name in (
        "kernels",
        "distributed",
        "Attention",
        "bind",
        "request_backend",
        "autotune",
        "replay",
        "ReplayResult",
        "AttnresError",
    ):
        assert name in attnres.__all__
    assert set(attnres.__all__) <= set(dir(attnres))
    for name in attnres.__all__:
        assert getattr(attnres, name) is not None


def test_no_bare_runtime_error_is_raised_in_attnres() -> None:
    """Issue 32 item 18: every ``raise RuntimeError`` became an AttnresError subclass
    that keeps RuntimeError as a base (callers that catch it keep working)."""
    import ast
    from pathlib import Path

    bare = []
    for path in sorted(Path(attnres.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "RuntimeError":
                    bare.append(f"{path.name}:{node.lineno}")
    assert bare == []
    for cls in (errors.CompiledGraphError, errors.InvalidStateError):
        assert issubclass(cls, errors.AttnresError) and issubclass(cls, RuntimeError)


#: Built-in exceptions attnres still raises itself, and why none is a user's mistake.
_BUILTIN_RAISES: dict[str, str] = {
    "AssertionError": "an internal invariant (a table that ends with a row that always holds)",
    "AttributeError": "the protocol of a module's __getattr__ (attnres/__init__.py)",
    "LookupError": "raised and caught on the spot, its message collected",
    "SystemExit": "the command line's exit status (python -m attnres)",
}
#: The file layer's own refusals (an OSError with the reason in strerror): each
#: reader turns them into its error (TraceFormatError, PipelineError, ...).
_FILE_LAYER = ("_files.py", ("OSError", "IsADirectoryError", "NotADirectoryError"))


def test_every_error_attnres_raises_is_an_attnres_error() -> None:
    """Issue 33 item 5: a bad value is an InvalidArgumentError (a ValueError), a
    bad type an ArgumentTypeError (a TypeError); no user mistake raises a bare
    built-in exception (the ones left are listed above, each with its reason)."""
    import ast
    import builtins
    from pathlib import Path

    root = Path(attnres.__file__).parent
    bare = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # raised, or made to be raised elsewhere (a helper that returns the error)
            if isinstance(node, ast.Call):
                exc = node.func
            elif isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc
            else:
                continue
            if not isinstance(exc, ast.Name):
                continue
            cls = getattr(builtins, exc.id, None)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                continue
            if exc.id in _BUILTIN_RAISES:
                continue
            if name == _FILE_LAYER[0] and exc.id in _FILE_LAYER[1]:
                continue
            bare.append(f"{name}:{node.lineno} makes a {exc.id}")
    assert bare == []
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.ArgumentTypeError, TypeError)


def test_runtime_errors_that_were_bare_are_typed() -> None:
    import pytest
    import torch.distributed as dist

    from attnres.distributed import verify_consensus
    from attnres.parallel import SequenceParallel

    assert not dist.is_initialized()
    with pytest.raises(errors.SequenceParallelError, match="init_process_group first"):
        SequenceParallel(ulysses=1, ring=1)
    with pytest.raises(errors.ConsensusError, match="init_process_group first"):
        verify_consensus(group=object())  # type: ignore[arg-type]


def test_every_error_class_has_a_row_in_the_docs_error_types_table() -> None:
    """Issue 32 ("the docs say what each new error means"): every class of
    attnres.errors, AttnresError's subclasses, has its own row in docs/errors.md's
    "Error types" table, naming its built-in base (MaskKindError, MaskShapeError,
    TraceWriteError and UsageError had none)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "errors.md").read_text(encoding="utf-8")
    table = text.split("## Error types", 1)[1].split("\n## ", 1)[0]
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.MULTILINE)
    }
    for name in errors.__all__:
        cls = getattr(errors, name)
        if cls is errors.AttnresError:
            assert "`attnres.AttnresError`" in text
            continue
        assert name in rows, f"{name} has no row in docs/errors.md's Error types table"
        bases = [b for b in cls.__mro__[1:] if b is not errors.AttnresError]
        named = bases[0].__name__  # its first built-in (or attnres) base
        assert f"`{named}`" in rows[name], (name, named, rows[name])
