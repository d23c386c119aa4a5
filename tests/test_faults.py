"""Fault injection (SPEC 7 "Reliability"): a broken kernel package, a plugin that
raises, a ``torch.cuda`` that raises -- each becomes a recorded fact, never a
crash, and resolution goes on past it.

``test_platform.py`` checks the facts a probe records; these tests follow the
fault all the way: from the fake package on ``sys.path`` through
``Platform.detect()`` into a resolution on the detected platform (the failed
``available`` check with code ``package_broken`` and the exception's text, then
the next candidate), into the trace (its digest, its file, its replay), the
``attnres doctor`` report and a working ``attnres.Attention``.

Every scenario runs in a fresh interpreter, with fake packages (and a fake
distribution declaring ``attnres.backends`` entry points) in a temporary
folder put on ``PYTHONPATH``. One of those folders has a name that is not
UTF-8, as a real site-packages path can: the exception text then carries a
surrogate escape, and the traces must still be written and replayed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

# -- the harness ---------------------------------------------------------------------

_SCRIPT = r"""
import contextlib, io, json, sys, tempfile
from pathlib import Path
{prelude}
import attnres
from attnres import LayerSpec, SelectionConfig
from attnres.backends import plugin_failures
from attnres.platform import Platform

platform = Platform.detect(refresh=True)
out = {{
    "kind": platform.kind,
    "capability": platform.capability,
    "notes": list(platform.notes),
    "packages": {{f.name: [f.status, f.detail] for f in platform.packages}},
    "plugin_failures": [[f.entry_point, f.error] for f in plugin_failures()],
    "resolutions": {{}},
}}
tmp = Path(tempfile.mkdtemp())
for label, (layer, config, backend) in {cases}.items():
    try:
        trace = attnres.resolve(
            LayerSpec(**layer), config=SelectionConfig(**config), backend=backend
        ).trace
    except attnres.ResolutionError as exc:
        trace = exc.trace
        assert str(exc) == trace.outcome.error
    assert trace.input.platform is platform  # resolved on the detected platform
    path = attnres.dump_trace(trace, tmp / (label + ".json"))
    replayed = attnres.replay(path)
    out["resolutions"][label] = {{
        "trace": trace.to_dict(),
        "digest": trace.digest,
        "replay_ok": replayed.ok,
        "loaded_equal": attnres.load_trace(path) == trace,
    }}
{epilogue}
print("RESULT " + json.dumps(out))
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _run(
    roots: list[Path],
    cases: dict[str, tuple[dict[str, Any], dict[str, Any], str | None]],
    prelude: str = "",
    epilogue: str = "",
) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*(os.fspath(r) for r in roots), *filter(None, [env.get("PYTHONPATH", "")])]
    )
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    script = _SCRIPT.format(
        prelude=textwrap.dedent(prelude), cases=repr(cases), epilogue=textwrap.dedent(epilogue)
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    # no fault ever escapes: the interpreter finishes the whole script
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]


def _non_utf8_dir(parent: Path) -> Path:
    """A folder whose name has the byte 0xff (a str with a surrogate escape)."""
    raw = os.fsencode(parent) + b"/site-packages-\xff"
    os.mkdir(raw)
    return Path(os.fsdecode(raw))


def _checks(trace: dict[str, Any], candidate: str) -> dict[str, dict[str, Any]]:
    return {
        r["check"]: r
        for r in trace["records"]
        if r["kind"] == "check" and r["candidate"] == candidate
    }


def _evaluated(trace: dict[str, Any]) -> list[str]:
    return [
        r["candidate"] for r in trace["records"] if r["kind"] == "check" and r["check"] == "known"
    ]


# =============================================================================
# Broken kernel packages on a CUDA machine (torch.cuda answering sm90)
# =============================================================================

_H100 = """
import types
import torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3")
torch.cuda.get_device_capability = lambda i: (9, 0)
torch.version.hip = None
"""

# backend -> (package, fake module source, the text the fact must keep)
_BROKEN: dict[str, tuple[str, str, str]] = {
    "sage_attn": (
        "sageattention",
        'raise ImportError("libcuda.so.1: cannot open shared object file: No such file")\n',
        "import failed: ImportError: libcuda.so.1: cannot open shared object file: No such file",
    ),
    "xformers": (
        "xformers",
        'raise OSError("/sp/xformers/_C.so: undefined symbol: _ZN3c1017SymbolicShapeMeta")\n',
        "import failed: OSError: /sp/xformers/_C.so: undefined symbol: _ZN3c1017SymbolicShapeMeta",
    ),
    "fa": (
        "flash_attn",
        'raise RuntimeError("FlashAttention is built for CUDA 12.8, found 12.4")\n',
        "import failed: RuntimeError: FlashAttention is built for CUDA 12.8, found 12.4",
    ),
    "fa3": (
        "flash_attn_interface",
        'import sys\nsys.exit("flash_attn_interface: no kernel image for this device")\n',
        "import failed: SystemExit: flash_attn_interface: no kernel image for this device",
    ),
}
_MODULE_FILE = {
    "sageattention": "sageattention/__init__.py",
    "xformers": "xformers/__init__.py",
    "flash_attn": "flash_attn/__init__.py",
    "flash_attn_interface": "flash_attn_interface.py",
}
# a package in a folder whose name is not UTF-8, failing with its own path
_ODD_BACKEND, _ODD_PACKAGE = "sliding_tile_attn", "st_attn"
_ODD_SOURCE = 'raise OSError(__file__ + ": undefined symbol: _Z5stattnv")\n'

_LAYER = {"head_size": 128, "dtype": "bfloat16", "name": "blocks.0.attn1"}
_CUDA_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str | None]] = {
    # a relaxed request for each broken backend: it fails 'available' and the
    # machine goes on to the next candidate
    **{
        f"prefer_{b}": (_LAYER, {"global_backend": b, "global_backend_explicit": False}, None)
        for b in [*_BROKEN, _ODD_BACKEND]
    },
    # a strict request for each: rejected, and the error keeps the import error
    **{f"strict_{b}": (_LAYER, {}, b) for b in [*_BROKEN, _ODD_BACKEND]},
    # nothing requested: the cuda chain starts with the broken fa
    "nothing_requested": (_LAYER, {}, None),
}


@pytest.fixture(scope="module")
def cuda_faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cuda_faults")
    _write(root, {_MODULE_FILE[pkg]: src for pkg, src, _ in _BROKEN.values()})
    odd = _non_utf8_dir(root)
    _write(odd, {f"{_ODD_PACKAGE}/__init__.py": _ODD_SOURCE})
    result = _run([root, odd], _CUDA_CASES, prelude=_H100)
    result["odd_dir"] = os.fspath(odd)
    return result


def test_detected_platform_is_the_faked_h100(cuda_faults: dict[str, Any]) -> None:
    assert cuda_faults["kind"] == "cuda"
    assert cuda_faults["capability"] == [9, 0]
    assert cuda_faults["notes"] == []


@pytest.mark.parametrize("backend", sorted(_BROKEN))
def test_broken_package_is_a_fact(cuda_faults: dict[str, Any], backend: str) -> None:
    package, _, text = _BROKEN[backend]
    assert cuda_faults["packages"][package] == ["broken", text]


def test_broken_package_in_a_non_utf8_folder_is_a_printable_fact(
    cuda_faults: dict[str, Any],
) -> None:
    status, detail = cuda_faults["packages"][_ODD_PACKAGE]
    assert status == "broken"
    assert detail.startswith("import failed: OSError: ")
    assert detail.endswith("st_attn/__init__.py: undefined symbol: _Z5stattnv")
    # the undecodable byte is kept visibly, as an escape, not as a lone surrogate
    assert "site-packages-\\udcff" in detail
    detail.encode("utf-8")  # strict: no surrogate left


@pytest.mark.parametrize("backend", [*sorted(_BROKEN), _ODD_BACKEND])
def test_relaxed_request_records_the_unavailability_and_goes_on(
    cuda_faults: dict[str, Any], backend: str
) -> None:
    res = cuda_faults["resolutions"][f"prefer_{backend}"]
    trace = res["trace"]
    checks = _checks(trace, backend)
    available = checks["available"]
    assert available["passed"] is False
    (failure,) = available["failures"]
    assert failure["code"] == "package_broken"
    package = _ODD_PACKAGE if backend == _ODD_BACKEND else _BROKEN[backend][0]
    assert failure["message"].startswith(f"package {package!r} is broken: import failed: ")
    assert failure["message"].endswith(cuda_faults["packages"][package][1])
    # on this sm90 device, with bf16 and head size 128, the package is the only problem
    assert [c for c, r in checks.items() if not r["passed"]] == ["available"]
    # the machine moved on: past fa (broken too, a recorded skip) to torch_sdpa
    assert _evaluated(trace)[0] == backend
    assert trace["outcome"]["status"] == "selected"
    assert trace["outcome"]["backend"] == "torch_sdpa"
    assert trace["outcome"]["reason"] == "platform default fallback"
    assert trace["outcome"]["origin"] == "global_preference"


@pytest.mark.parametrize("backend", [*sorted(_BROKEN), _ODD_BACKEND])
def test_strict_request_is_rejected_with_the_import_error(
    cuda_faults: dict[str, Any], backend: str
) -> None:
    trace = cuda_faults["resolutions"][f"strict_{backend}"]["trace"]
    outcome = trace["outcome"]
    assert outcome["status"] == "rejected"
    assert outcome["code"] == "package_broken"
    assert outcome["error"].startswith(f"Attention backend {backend!r} is not available: ")
    package = _ODD_PACKAGE if backend == _ODD_BACKEND else _BROKEN[backend][0]
    assert cuda_faults["packages"][package][1] in outcome["error"]
    assert _evaluated(trace) == [backend]


def test_nothing_requested_skips_the_broken_chain_head(cuda_faults: dict[str, Any]) -> None:
    # the Hopper chain prefers fa3, then fa, only where usable: the broken packages
    # are the recorded reasons both are passed over, and torch_sdpa, the
    # unconditional default, serves
    trace = cuda_faults["resolutions"]["nothing_requested"]["trace"]
    skips = [r for r in trace["records"] if r["kind"] == "skip"]
    assert [(r["stage"], r["candidate"]) for r in skips] == [
        ("platform_default", "fa3"),
        ("platform_default", "fa"),
    ]
    assert "package 'flash_attn_interface' is broken" in skips[0]["detail"]
    assert skips[1]["detail"] == (
        "preferred on cuda only where usable: package 'flash_attn' is broken: " + _BROKEN["fa"][2]
    )
    assert _evaluated(trace) == ["torch_sdpa"]
    assert trace["outcome"]["backend"] == "torch_sdpa"
    assert trace["outcome"]["reason"] is None


def test_fault_traces_are_written_loaded_and_replayed(cuda_faults: dict[str, Any]) -> None:
    assert set(cuda_faults["resolutions"]) == set(_CUDA_CASES)
    for label, res in cuda_faults["resolutions"].items():
        assert res["replay_ok"] is True, label
        assert res["loaded_equal"] is True, label
        assert len(res["digest"]) == 64, label
        # every trace carries the platform facts, the faults included
        facts = {f["name"]: f for f in res["trace"]["input"]["platform"]["packages"]}
        assert facts["sageattention"]["status"] == "broken"
        assert facts[_ODD_PACKAGE]["detail"] == cuda_faults["packages"][_ODD_PACKAGE][1]


# =============================================================================
# Plugins that raise, and a torch.cuda that raises on query
# =============================================================================

_CUDA_RAISES = """
import torch

def _is_available():
    raise RuntimeError("CUDA driver initialization failed, you might not have a GPU")

torch.cuda.is_available = _is_available
"""

_PLUGIN_DIST = "attnres_fault_plugins-1.0.dist-info"
_PLUGIN_FILES = {
    f"{_PLUGIN_DIST}/METADATA": "Metadata-Version: 2.1\nName: attnres-fault-plugins\n"
    "Version: 1.0\n",
    f"{_PLUGIN_DIST}/entry_points.txt": textwrap.dedent(
        """
        [attnres.backends]
        broken_import = attnres_fault_import:SPEC
        exits = attnres_fault_exit:make
        oserror = attnres_fault_oddpath:SPEC
        good = attnres_fault_good:SPEC
        """
    ),
    "attnres_fault_import.py": "raise ImportError(\"cannot import name '_C' from partially "
    "initialized module 'faultkern'\")\n",
    "attnres_fault_exit.py": """
        def make():
            raise SystemExit("faultkern: refusing to load")
        """,
    "attnres_fault_good.py": """
        from attnres import BackendSpec
        SPEC = BackendSpec(
            name="faultless_kernel", sparse=False, platforms=("cpu",), dtypes=("float32",)
        )
        """,
}
_ODD_PLUGIN = {"attnres_fault_oddpath.py": 'raise OSError(__file__ + ": undefined symbol: k")\n'}

_CPU_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str | None]] = {
    "plain": ({"head_size": 64, "dtype": "float32"}, {}, None),
    "good_plugin": ({"head_size": 64, "dtype": "float32"}, {}, "faultless_kernel"),
    "preferred_sage": (
        {"head_size": 64, "dtype": "float32"},
        {"global_backend": "sage_attn", "global_backend_explicit": False},
        None,
    ),
}

_CPU_EPILOGUE = """
import torch
from attnres.cli import main
layer = attnres.Attention(8, 64, name="fault.attn", dtype="float32")
q = torch.randn(1, 4, 8, 64)
out["attention"] = [layer.backend.name, list(layer(q, q, q).shape)]
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    code = main(["doctor", "--json"])
out["doctor"] = [code, json.loads(buf.getvalue())]
"""


@pytest.fixture(scope="module")
def cpu_faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cpu_faults")
    _write(root, _PLUGIN_FILES)
    odd = _non_utf8_dir(root)
    _write(odd, _ODD_PLUGIN)
    return _run([root, odd], _CPU_CASES, prelude=_CUDA_RAISES, epilogue=_CPU_EPILOGUE)


_CUDA_NOTE = (
    "torch.cuda query failed: RuntimeError: CUDA driver initialization failed, "
    "you might not have a GPU"
)


def test_torch_cuda_that_raises_is_a_note_and_the_kind_is_cpu(cpu_faults: dict[str, Any]) -> None:
    assert cpu_faults["kind"] == "cpu"
    assert cpu_faults["capability"] is None
    assert _CUDA_NOTE in cpu_faults["notes"]


def test_plugins_that_raise_are_recorded_in_plugin_failures(cpu_faults: dict[str, Any]) -> None:
    failures = dict(cpu_faults["plugin_failures"])
    assert set(failures) == {
        "broken_import = attnres_fault_import:SPEC",
        "exits = attnres_fault_exit:make",
        "oserror = attnres_fault_oddpath:SPEC",
    }
    assert failures["broken_import = attnres_fault_import:SPEC"] == (
        "ImportError: cannot import name '_C' from partially initialized module 'faultkern'"
    )
    assert failures["exits = attnres_fault_exit:make"] == "SystemExit: faultkern: refusing to load"
    odd = failures["oserror = attnres_fault_oddpath:SPEC"]
    assert odd.startswith("OSError: ")
    assert odd.endswith("attnres_fault_oddpath.py: undefined symbol: k")
    odd.encode("utf-8")  # printable: the non-UTF-8 byte is escaped


def test_plugins_that_raise_are_notes_of_the_detected_platform(cpu_faults: dict[str, Any]) -> None:
    notes = cpu_faults["notes"]
    for entry_point, error in cpu_faults["plugin_failures"]:
        assert f"plugin {entry_point} failed to load: {error}" in notes
    assert len(notes) == 1 + len(cpu_faults["plugin_failures"])


def test_resolution_goes_on_after_the_faults(cpu_faults: dict[str, Any]) -> None:
    res = cpu_faults["resolutions"]
    plain = res["plain"]["trace"]["outcome"]
    assert (plain["status"], plain["backend"], plain["origin"]) == (
        "selected",
        "torch_sdpa",
        "none",
    )
    # the working plugin, loaded beside the broken ones, serves
    good = res["good_plugin"]["trace"]["outcome"]
    assert (good["status"], good["backend"], good["origin"]) == (
        "selected",
        "faultless_kernel",
        "layer",
    )
    preferred = res["preferred_sage"]["trace"]
    assert preferred["outcome"]["backend"] == "torch_sdpa"
    assert preferred["outcome"]["reason"] == "platform default fallback"
    for label, r in res.items():
        assert r["replay_ok"] is True, label
        assert _CUDA_NOTE in r["trace"]["input"]["platform"]["notes"], label


def test_an_attention_layer_runs_after_the_faults(cpu_faults: dict[str, Any]) -> None:
    assert cpu_faults["attention"] == ["torch_sdpa", [1, 4, 8, 64]]


def test_doctor_reports_the_faults(cpu_faults: dict[str, Any]) -> None:
    code, doc = cpu_faults["doctor"]
    assert code == 0
    assert doc["platform"]["kind"] == "cpu"
    assert _CUDA_NOTE in doc["notes"]
    assert {f["entry_point"] for f in doc["plugin_failures"]} == {
        ep for ep, _ in cpu_faults["plugin_failures"]
    }
