"""Every console transcript in the docs is real output (issue 11, case 14).

A transcript is a fenced ```` ```console ```` block in ``README.md`` or
``docs/*.md``: one ``$ COMMAND`` line (continued by a trailing ``\\``), the
output the command prints (stdout and stderr, as a terminal shows them, at
``COLUMNS=100``), and optionally a
last ``[exit N]`` line. The test runs the command with bash (``pipefail`` on,
so ``| tail`` keeps attnres's exit code) in a temporary folder where
``examples/`` and ``traces/`` link to the repository's and the pipeline files
the docs talk about exist, and compares line by line (trailing blanks aside).
An output line that is exactly ``...`` stands for any number of lines, and an
ISO timestamp (``2026-11-30T04:19:27.925456Z``, in log lines) for any other.

An HTML comment on the line before the fence qualifies a block:

- ``<!-- transcript: this machine -->``: the command detects this machine;
  checked only where the docs' machine is (a CPU, no kernel package present),
  and version numbers (``3.11.7``, ``2.13.0``) match any other.
- ``<!-- transcript: plugin distributions -->``: run with the three plugin
  distributions that docs/plugins.md describes (``PLUGIN_DISTRIBUTIONS``:
  one that works, one whose module is missing, one that clashes) on
  ``PYTHONPATH``.

A ```` ```toml ```` block after ``<!-- transcript file: NAME -->`` is written to
``NAME`` in that folder, for the transcripts of its document.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*transcript:\s*(?P<what>.*?)\s*-->")
FILE_MARKER = re.compile(r"<!--\s*transcript file:\s*(?P<name>[\w.-]+)\s*-->")
VERSION = re.compile(r"\b\d+\.\d+(?:\.\d+)?(?:[\w.+-]*)")
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z")

#: Pipeline files that the docs describe in words (cli.md), as they describe them.
FIXTURES = {
    "bad-syntax.toml": (
        '[pipeline]\nname = "bad-syntax"\n\n[[components]]\nname = "vae"\nhead_size =\n'
    ),
    "no-head-size.toml": (
        '[[components]]\nname = "audio_vae"\n\n[[components.layers]]\nname = "mid.attn_1"\n'
        'dtype = "float32"\n'
    ),
}

#: The plugin distributions of docs/plugins.md's doctor transcript: ``mykernel``
#: works (its kernel package is not installed), ``broken`` names a module that
#: does not exist, and ``zz_clash`` claims ``my_attn`` again.
PLUGIN_DISTRIBUTIONS = {
    "mykernel_attnres/__init__.py": "",
    "mykernel_attnres/attnres_plugin.py": (
        "from attnres import BackendSpec\n"
        "from attnres.backends import CapabilityRule, HeadSizeRule\n\n\n"
        "def spec() -> BackendSpec:\n"
        "    return BackendSpec(\n"
        "        name='my_attn', sparse=False, platforms=('cuda',),\n"
        "        dtypes=('float16', 'bfloat16'), head_sizes=HeadSizeRule(max=256, multiple_of=8),\n"
        "        implements=('causal', 'gqa'), package='mykernel',\n"
        "        capabilities={'cuda': CapabilityRule(min=(8, 0))}, causal_top_left=False,\n"
        "    )\n"
    ),
    "clashmod/__init__.py": "",
    "clashmod/p.py": "from mykernel_attnres.attnres_plugin import spec\n\nspecs = [spec()]\n",
    "docs_plugins-1.0.dist-info/METADATA": (
        "Metadata-Version: 2.1\nName: docs-plugins\nVersion: 1.0\n"
    ),
    "docs_plugins-1.0.dist-info/entry_points.txt": (
        "[attnres.backends]\n"
        "mykernel = mykernel_attnres.attnres_plugin:spec\n"
        "broken = brokenplug_missing.plugin:spec\n"
        "zz_clash = clashmod.p:specs\n"
    ),
}


@dataclass(frozen=True)
class Transcript:
    doc: Path
    line: int
    command: str
    output: tuple[str, ...]
    exit_code: int | None
    marker: str | None
    files: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.doc.name}:{self.line}"


def _transcripts() -> list[Transcript]:
    found: list[Transcript] = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        files = _files(lines)
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```console":
                i += 1
                continue
            start = i
            before = next((x for x in reversed(lines[:i]) if x.strip()), "")
            m = MARKER.search(before)
            i += 1
            body: list[str] = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            assert body and body[0].startswith("$ "), f"{doc.name}:{start + 1}: no $ line"
            while body[0].endswith("\\") and len(body) > 1:  # a continued command line
                body[0:2] = [body[0][:-1].rstrip() + " " + body[1].strip()]
            exit_code = None
            if body[-1].startswith("[exit "):
                exit_code = int(body.pop()[len("[exit ") : -1])
            assert not any(b.startswith("$ ") for b in body[1:]), (
                f"{doc.name}:{start + 1}: one command per transcript"
            )
            found.append(
                Transcript(
                    doc,
                    start + 1,
                    body[0][2:],
                    tuple(body[1:]),
                    exit_code,
                    m.group("what") if m else None,
                    files,
                )
            )
    return found


def _files(lines: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for i, line in enumerate(lines):
        m = FILE_MARKER.search(line)
        if m and i + 1 < len(lines) and lines[i + 1].strip() == "```toml":
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            out.append((m.group("name"), "\n".join(lines[i + 2 : end]) + "\n"))
    return tuple(out)


TRANSCRIPTS = _transcripts()


def _matches(expected: list[str], actual: list[str]) -> bool:
    """``...`` in ``expected`` matches any run of lines (including none)."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(_matches(expected[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and _matches(expected[1:], actual[1:])


def _docs_machine() -> bool:
    from attnres import Platform

    platform = Platform.detect()
    return platform.kind == "cpu" and not any(f.status == "present" for f in platform.packages)


def test_there_are_transcripts_to_check() -> None:
    assert len(TRANSCRIPTS) >= 20
    for t in TRANSCRIPTS:
        if t.marker is not None:
            assert t.marker in ("this machine", "plugin distributions"), (t.id, t.marker)


@pytest.mark.slow
@pytest.mark.parametrize("transcript", TRANSCRIPTS, ids=[t.id for t in TRANSCRIPTS])
def test_console_transcript_is_real_output(transcript: Transcript, tmp_path: Path) -> None:
    if transcript.marker == "this machine" and not _docs_machine():
        pytest.skip("the transcript was made on a CPU without kernel packages")
    for name in ("examples", "traces"):
        (tmp_path / name).symlink_to(ROOT / name)
    for name, content in (*FIXTURES.items(), *transcript.files):
        (tmp_path / name).write_text(content, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    if transcript.marker == "plugin distributions":
        plugins = tmp_path / "plugins"
        for name, content in PLUGIN_DISTRIBUTIONS.items():
            (plugins / name).parent.mkdir(parents=True, exist_ok=True)
            (plugins / name).write_text(content, encoding="utf-8")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugins), env.get("PYTHONPATH")]))
    env.update(
        COLUMNS="100",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    proc = subprocess.run(
        ["bash", "-c", "set -o pipefail\n" + transcript.command],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    actual = [TIMESTAMP.sub("<time>", line.rstrip()) for line in proc.stdout.splitlines()]
    expected = [TIMESTAMP.sub("<time>", line.rstrip()) for line in transcript.output]
    if transcript.marker == "this machine":
        actual = [VERSION.sub("<version>", line) for line in actual]
        expected = [VERSION.sub("<version>", line) for line in expected]
    assert _matches(expected, actual), (
        f"{transcript.id}: `{transcript.command}` printed:\n" + "\n".join(actual)
    )
    if transcript.exit_code is not None:
        assert proc.returncode == transcript.exit_code, proc.returncode
