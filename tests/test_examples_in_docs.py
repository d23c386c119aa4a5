"""Every Python example in the narrative docs runs, as written.

Which blocks run
    Every fenced block opened with exactly ```` ```python ```` (indented blocks
    inside lists included) in ``README.md``, ``docs/index.md``,
    ``docs/selection-contract.md``, ``docs/plugins.md``, ``docs/logging.md`` and
    ``docs/integrations.md`` and ``docs/sequence-parallel.md`` (its worked example
    forks two gloo ranks).
    A block that is not meant to run (it needs a GPU, a cluster, a package that
    is not installed, or is a fragment) is fenced ```` ```py-norun ```` (Python,
    not run) or ```` ```text ````; shell sessions are ```` ```console ```` or
    ```` ```sh ````, configuration ```` ```toml ````.

How a block runs
    Each block alone, in a fresh namespace (its own imports), with the current
    directory a temporary folder in which ``traces/`` and ``examples/`` link to
    the repository's, so a block can name repository files as if run from the
    repository root and write files without touching the checkout. A block passes
    when it raises nothing; blocks check their own outcomes with ``assert``.

What is restored after each block
    The resolution cache, the decision ledger, the process-wide selection
    config, the registered component kinds, the kernel registry, structlog's
    configuration, and the level and handlers of the root and ``attnres`` stdlib
    loggers. A block that registers a backend must unregister it itself (the
    test fails otherwise, so a plugin example can never leak into another test).
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

import attnres
from attnres import kernels as K
from attnres import scope as S
from attnres.backends import registered_backends
from attnres.runtime import set_selection_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    ROOT / "docs" / "index.md",
    ROOT / "docs" / "selection-contract.md",
    ROOT / "docs" / "plugins.md",
    ROOT / "docs" / "logging.md",
    ROOT / "docs" / "integrations.md",
    ROOT / "docs" / "sequence-parallel.md",
]
LINKED = ("traces", "examples")

#: an opening fence of exactly ``python`` (any indentation), its body, and the
#: closing fence at the same indentation
BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


def _blocks() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for doc in DOCS:
        if not doc.exists():
            continue
        text = doc.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            body = textwrap.dedent(match.group("body"))
            out.append((f"{doc.relative_to(ROOT)}:{line}", body))
    return out


BLOCKS = _blocks()


def test_the_docs_have_examples() -> None:
    """The extraction itself works: every listed page that exists has a python block."""
    found = {where.split(":", 1)[0] for where, _ in BLOCKS}
    for doc in DOCS:
        if doc.exists():
            assert str(doc.relative_to(ROOT)) in found, f"{doc.name}: no ```python block found"


@pytest.fixture
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    backends = {spec.name for spec in registered_backends()}
    loaders, aliases = dict(S._LOADERS), dict(S._NAME_ALIASES)
    entries, built = dict(K._entries), dict(K._built)
    was_configured = structlog.is_configured()
    structlog_config = structlog.get_config()
    loggers = [logging.getLogger(), logging.getLogger("attnres")]
    saved_loggers = [(lg.level, list(lg.handlers)) for lg in loggers]
    previous = set_selection_config(attnres.SelectionConfig())
    try:
        yield
        leaked = {spec.name for spec in registered_backends()} - backends
        assert not leaked, f"the example left backends registered: {sorted(leaked)}"
    finally:
        for name in {spec.name for spec in registered_backends()} - backends:
            attnres.unregister_backend(name)
        set_selection_config(previous)
        S._LOADERS.clear()
        S._LOADERS.update(loaders)
        S._NAME_ALIASES.clear()
        S._NAME_ALIASES.update(aliases)
        with K._lock:
            K._entries.clear()
            K._entries.update(entries)
            K._built.clear()
            K._built.update(built)
        if was_configured:
            structlog.configure(**structlog_config)
        else:
            structlog.reset_defaults()
        for lg, (level, handlers) in zip(loggers, saved_loggers, strict=True):
            lg.setLevel(level)
            lg.handlers[:] = handlers
        attnres.clear_cache()
        attnres.clear_decisions()


@pytest.mark.usefixtures("_isolated")
@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_python_example_runs(where: str, code: str) -> None:
    namespace = {"__name__": "__doc_example__"}
    exec(compile(code, where, "exec"), namespace)
