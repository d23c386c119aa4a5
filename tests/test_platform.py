"""Platform facts: the simulation grammar, default chains, and probes that never crash."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import attnres
from attnres import platform as P
from attnres._vocab import PLATFORM_KINDS, Requirement
from attnres.backends import Backend, get_spec, reload_plugins
from attnres.platform import GRAMMAR, KNOWN_PACKAGES, PackageFact, Platform

GRAMMAR_TEXT = "KIND[:ARCH][+PACKAGE...]"
ALL_PACKAGES = frozenset(p.name for p in KNOWN_PACKAGES)


def _statuses(platform: Platform) -> dict[str, str]:
    return {f.name: f.status for f in platform.packages}


def _present(platform: Platform) -> set[str]:
    return {f.name for f in platform.packages if f.status == "present"}


# -- simulate: valid strings --------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "capability", "arch", "present"),
    [
        ("cpu", "cpu", None, None, set()),
        (
            "cuda:sm90+flash_attn+sageattention",
            "cuda",
            (9, 0),
            "sm90",
            {"flash_attn", "sageattention"},
        ),
        ("cuda:9.0", "cuda", (9, 0), "sm90", set()),
        ("cuda:sm_80", "cuda", (8, 0), "sm80", set()),
        ("cuda:86", "cuda", (8, 6), "sm86", set()),
        ("CUDA:SM90A+Flash_Attn", "cuda", (9, 0), "sm90", {"flash_attn"}),
        ("cuda:sm120", "cuda", (12, 0), "sm120", set()),
        ("cuda:12.1", "cuda", (12, 1), "sm121", set()),
        ("cuda", "cuda", None, None, set()),
        ("cuda:sm100+all", "cuda", (10, 0), "sm100", set(ALL_PACKAGES)),
        ("rocm:gfx942+aiter", "rocm", None, "gfx942", {"aiter"}),
        ("rocm:GFX90A", "rocm", None, "gfx90a", set()),
        ("npu+torch_npu", "npu", None, None, {"torch_npu"}),
        ("mps", "mps", None, None, set()),
        ("xpu", "xpu", None, None, set()),
        ("  cpu  ", "cpu", None, None, set()),
        ("cuda:sm100+flash-attn-4", "cuda", (10, 0), "sm100", {"flash_attn_4"}),
        ("cuda+fa4+fa3", "cuda", None, None, {"flash_attn_4", "flash_attn_interface"}),
        ("cuda+flash-attn", "cuda", None, None, {"flash_attn"}),
        ("cuda+flash_attn.cute", "cuda", None, None, {"flash_attn_4"}),
        ("rocm:gfx950+amd-aiter", "rocm", None, "gfx950", {"aiter"}),
        (
            "cuda+sage+sageattn3+xformers",
            "cuda",
            None,
            None,
            {"sageattention", "sageattn3", "xformers"},
        ),
        ("cuda:sm90+st_attn+vsa+svg", "cuda", (9, 0), "sm90", {"st_attn", "vsa", "svg"}),
        ("cuda+flash_attn+flash_attn", "cuda", None, None, {"flash_attn"}),
    ],
)
def test_simulate_valid_strings(
    text: str,
    kind: str,
    capability: tuple[int, int] | None,
    arch: str | None,
    present: set[str],
) -> None:
    p = Platform.simulate(text)
    assert p.kind == kind
    assert p.capability == capability
    assert p.arch == arch
    assert p.simulated is True
    assert p.notes == ()
    assert p.torch_version == P.SIMULATED_TORCH_VERSION
    # every known package is reported, present or missing with its reason
    assert {f.name for f in p.packages} >= ALL_PACKAGES
    assert _present(p) == present
    for fact in p.packages:
        if fact.name in present:
            assert fact.usable
            assert fact.detail is None
        else:
            assert (fact.status, fact.version, fact.detail) == ("missing", None, "not installed")
            assert not fact.usable
            assert p.package(fact.name) == fact


def test_simulated_packages_are_sorted_and_unique() -> None:
    names = [f.name for f in Platform.simulate("cuda:sm90+all").packages]
    assert names == sorted(set(names))


def test_flash_attn_4_alias_does_not_mark_flash_attn_2() -> None:
    p = Platform.simulate("cuda:sm100+flash-attn-4")
    assert p.package("flash_attn_4").usable
    assert not p.package("flash_attn").usable


def test_simulated_describe_and_torch_version() -> None:
    p = Platform.simulate("cuda:sm90+flash_attn")
    assert p.describe().startswith("cuda sm90")
    assert Platform.simulate("rocm:gfx942").describe().startswith("rocm gfx942")
    assert p.torch_at_least((2, 5)) is True
    assert p.torch_at_least((99, 0)) is False
    assert Platform(kind="cpu").torch_at_least((2, 5)) is None


def test_package_lookup_of_an_unprobed_name() -> None:
    fact = Platform.simulate("cpu").package("no_such_package")
    assert fact == PackageFact("no_such_package", "missing", None, "not probed on this platform")
    assert not fact.usable


def test_package_fact_describe() -> None:
    assert PackageFact("x", "present", "2.7.0").describe() == "2.7.0"
    assert PackageFact("x", "present").describe() == "unknown version"
    assert PackageFact("x", "missing", None, "not installed").describe() == "missing: not installed"
    broken = PackageFact("x", "broken", None, "import failed: OSError: boom")
    assert broken.describe() == "broken: import failed: OSError: boom"
    assert PackageFact("x", "missing").describe() == "missing"


def test_platform_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="platform kind must be one of"):
        Platform(kind="gpu")


# -- simulate: invalid strings ------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "gpu",
        "cuda:abc",
        "cuda:sm9",
        "cuda:9",
        "cuda:",
        "rocm:sm90",
        "rocm:90",
        "cuda+nosuchpkg",
        "cuda::sm90",
        "cpu+",
        "cuda+flash_attn+",
        "cuda sm90",
        "+flash_attn",
        ":sm90",
        "cuda:sm90:sm80",
        "cuda+flash attn",
    ],
)
def test_simulate_invalid_strings_show_the_grammar(text: str) -> None:
    with pytest.raises(ValueError) as info:
        Platform.simulate(text)
    msg = str(info.value)
    assert GRAMMAR_TEXT in msg
    assert GRAMMAR in msg


@pytest.mark.parametrize("value", [None, 42, b"cpu", ["cpu"]])
def test_simulate_non_strings_are_a_value_error(value: Any) -> None:
    with pytest.raises(ValueError, match=r"KIND\[:ARCH\]\[\+PACKAGE\.\.\.\]"):
        Platform.simulate(value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("gpu", "unknown platform kind 'gpu'"),
        ("cuda:abc", "cannot parse CUDA architecture 'abc'"),
        ("rocm:sm90", "cannot parse ROCm architecture 'sm90'"),
        ("cuda+nosuchpkg", "unknown kernel package 'nosuchpkg'"),
    ],
)
def test_simulate_errors_say_what_was_wrong(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        Platform.simulate(text)
    assert repr(text) in str(info.value)


def test_unknown_package_error_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        Platform.simulate("cuda+nosuchpkg")
    for name in ALL_PACKAGES:
        assert name in str(info.value)


def test_grammar_names_every_kind() -> None:
    assert GRAMMAR.startswith(GRAMMAR_TEXT)
    for kind in PLATFORM_KINDS:
        assert kind in GRAMMAR


# -- equality -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("cuda:sm90+flash_attn", "cuda:sm90+flash_attn"),
        ("cuda:sm90+flash_attn+sageattention", "cuda:sm90+sageattention+flash_attn"),
        ("CUDA:9.0+FLASH_ATTN", "cuda:sm90+flash-attn"),
        ("rocm:gfx942+aiter", "rocm:GFX942+amd-aiter"),
        ("cpu", " cpu"),
    ],
)
def test_equal_strings_give_equal_hash_equal_platforms(a: str, b: str) -> None:
    pa, pb = Platform.simulate(a), Platform.simulate(b)
    assert pa == pb
    assert hash(pa) == hash(pb)
    assert len({pa, pb}) == 1


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("cuda:sm90+flash_attn", "cuda:sm80+flash_attn"),
        ("cuda:sm90+flash_attn", "cuda:sm90"),
        ("cuda:sm90", "cuda"),
        ("cpu", "mps"),
        ("cuda+flash_attn", "cuda+flash-attn-4"),
    ],
)
def test_different_strings_give_different_platforms(a: str, b: str) -> None:
    assert Platform.simulate(a) != Platform.simulate(b)


# -- default chains -----------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "chain"),
    [
        ("cuda", ("fa", "torch_sdpa")),
        ("rocm", ("aiter", "torch_sdpa")),
        ("cpu", ("torch_sdpa",)),
        ("mps", ("torch_sdpa",)),
        ("xpu", ("torch_sdpa",)),
    ],
)
def test_default_chain_per_kind(kind: str, chain: tuple[str, ...]) -> None:
    assert Platform.simulate(kind).default_chain() == tuple(Backend(n) for n in chain)


@pytest.mark.parametrize("kind", PLATFORM_KINDS)
def test_every_default_chain_runs_on_its_kind_and_ends_in_torch_sdpa(kind: str) -> None:
    chain = Platform.simulate(kind).default_chain()
    assert chain
    assert chain[-1] == Backend("torch_sdpa")
    assert len(set(chain)) == len(chain)
    for backend in chain:
        assert kind in get_spec(backend).platforms, (kind, backend)
        assert not backend.is_sparse


def test_npu_chain_prefers_ascend_fa() -> None:
    assert Platform.simulate("npu+torch_npu").default_chain()[0] == Backend("ascend_fa")


# -- detect on this machine ---------------------------------------------------


@pytest.fixture
def fresh_detect() -> Iterator[None]:
    saved = P._DETECTED
    yield
    P._DETECTED = saved
    P._DETECTED_AT = -1  # checked against the registry on the next use


def _module_findable(module: str) -> bool:
    return importlib.util.find_spec(module.split(".")[0]) is not None


def test_detect_on_this_machine(fresh_detect: None) -> None:
    import torch

    p = Platform.detect(refresh=True)
    assert p.simulated is False
    assert p.torch_version == torch.__version__.split("+")[0]
    if not torch.cuda.is_available():
        assert p.kind == "cpu"
        assert p.capability is None
    facts = {f.name: f for f in p.packages}
    assert set(facts) >= ALL_PACKAGES
    absent = [probe for probe in KNOWN_PACKAGES if not _module_findable(probe.module)]
    for probe in absent:
        assert facts[probe.name] == PackageFact(probe.name, "missing", None, "not installed")
    for fact in p.packages:
        assert fact.status in {"present", "missing", "broken"}


def test_this_machine_has_no_kernel_packages(fresh_detect: None) -> None:
    """The CI machine is CPU-only and installs none of the optional kernels."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine")
    p = Platform.detect(refresh=True)
    assert p.kind == "cpu"
    assert p.notes == ()
    for probe in KNOWN_PACKAGES:
        assert p.package(probe.name).status == "missing", probe.name
        assert p.package(probe.name).detail == "not installed", probe.name


def test_detect_is_cached_unless_refreshed(fresh_detect: None) -> None:
    first = Platform.detect()
    assert Platform.detect() is first
    assert Platform.detect(refresh=False) is first
    again = Platform.detect(refresh=True)
    assert again is not first
    assert again == first
    assert Platform.detect() is again


def test_detect_records_plugin_failures_as_notes(
    fresh_detect: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    class EP:
        name, value = "bad", "badpkg:spec"

        def load(self) -> object:
            raise ImportError("no kernels here")

    real_entry_points = importlib.metadata.entry_points

    def entry_points(**kw: Any) -> Any:
        # only the attnres group is faked: torch asks for its own groups too
        if kw.get("group") == "attnres.backends":
            return [EP()]
        return real_entry_points(**kw)

    real = reload_plugins()
    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    try:
        reload_plugins()
        p = Platform.detect(refresh=True)
        assert "plugin bad = badpkg:spec failed to load: ImportError: no kernels here" in p.notes
    finally:
        monkeypatch.undo()
        assert reload_plugins() == real


def test_public_surface_exports_platform() -> None:
    assert attnres.Platform is Platform


# -- probe faults, each in a fresh interpreter --------------------------------

_DETECT_SCRIPT = """
import json, sys
import attrs
{prelude}
from attnres.platform import Platform
out = []
for _ in range({runs}):
    p = Platform.detect(refresh=True)
    out.append({{
        "kind": p.kind,
        "capability": p.capability,
        "notes": list(p.notes),
        # issue 31: the distribution only where the probe found one
        "packages": {{f.name: attrs.asdict(f, filter=lambda a, v: v is not None
                      or a.name != "distribution") for f in p.packages}},
    }})
print("RESULT " + json.dumps(out))
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _dist_info(name: str, version: str) -> dict[str, str]:
    folder = f"{name.replace('-', '_')}-{version}.dist-info"
    return {
        f"{folder}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
    }


def _detect_in_subprocess(
    root: Path, files: dict[str, str], prelude: str = "", runs: int = 1
) -> list[dict[str, Any]]:
    _write(root, files)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH", "")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    script = _DETECT_SCRIPT.format(prelude=textwrap.dedent(prelude), runs=runs)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    # detection itself never raises: the interpreter exits cleanly
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0][len("RESULT ") :])  # type: ignore[no-any-return]


_FAULTS: dict[str, str] = {
    "sageattention/__init__.py": """
        raise ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")
        """,
    "xformers/__init__.py": """
        raise OSError(
            "/site-packages/xformers/_C.so: undefined symbol: _ZN3c1017SymbolicShapeMeta"
        )
        """,
    "aiter/__init__.py": """
        raise RuntimeError("HIP error: no ROCm-capable device is detected")
        """,
    "vsa/__init__.py": """
        import sys
        sys.exit(3)
        """,
    "st_attn/__init__.py": """
        raise RuntimeError("first line of the error\\nsecond line\\nthird line")
        """,
    "svg/__init__.py": """
        raise ValueError()
        """,
    "torch_npu/__init__.py": """
        import module_that_does_not_exist_anywhere
        """,
    # working fakes in the same interpreter
    "sageattn3/__init__.py": """
        __version__ = "0.0.dev0"
        """,
    **_dist_info("sageattn3", "1.0.2"),
    "flash_attn_interface.py": """
        __version__ = "3.0.0b1"
        """,
}

_EXPECTED_BROKEN: dict[str, str] = {
    "sageattention": (
        "import failed: ImportError: libcuda.so.1: cannot open shared object file: "
        "No such file or directory"
    ),
    "xformers": (
        "import failed: OSError: /site-packages/xformers/_C.so: undefined symbol: "
        "_ZN3c1017SymbolicShapeMeta"
    ),
    "aiter": "import failed: RuntimeError: HIP error: no ROCm-capable device is detected",
    "vsa": "import failed: SystemExit: 3",
    "st_attn": "import failed: RuntimeError: first line of the error",
    "svg": "import failed: ValueError",
    "torch_npu": (
        "import failed: ModuleNotFoundError: No module named 'module_that_does_not_exist_anywhere'"
    ),
}


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("faults")
    (result,) = _detect_in_subprocess(root, _FAULTS)
    return result


@pytest.mark.parametrize("name", sorted(_EXPECTED_BROKEN))
def test_broken_package_is_recorded_not_raised(faults: dict[str, Any], name: str) -> None:
    fact = faults["packages"][name]
    assert fact == {
        "name": name,
        "status": "broken",
        "version": None,
        "detail": _EXPECTED_BROKEN[name],
    }
    assert fact["detail"].startswith("import failed: ")


def test_broken_packages_leave_the_rest_alone(faults: dict[str, Any]) -> None:
    assert faults["kind"] == "cpu"
    assert faults["notes"] == []
    for name in ("flash_attn", "flash_attn_4"):
        assert faults["packages"][name] == {
            "name": name,
            "status": "missing",
            "version": None,
            "detail": "not installed",
        }


def test_working_package_with_version_attribute(tmp_path: Path) -> None:
    (result,) = _detect_in_subprocess(
        tmp_path, {"sageattention/__init__.py": '__version__ = "2.2.0"\n'}
    )
    assert result["packages"]["sageattention"] == {
        "name": "sageattention",
        "status": "present",
        "version": "2.2.0",
        "detail": None,
    }


def test_working_package_version_comes_from_its_distribution(faults: dict[str, Any]) -> None:
    assert faults["packages"]["sageattn3"]["status"] == "present"
    assert faults["packages"]["sageattn3"]["version"] == "1.0.2"
    # no distribution: the module's own __version__
    assert faults["packages"]["flash_attn_interface"]["status"] == "present"
    assert faults["packages"]["flash_attn_interface"]["version"] == "3.0.0b1"


def _flash_attn_files(*, fa4_dist: bool, cute: bool, fa2_dist: bool) -> dict[str, str]:
    files = {"flash_attn/__init__.py": ""}
    if cute:
        files["flash_attn/cute/__init__.py"] = '__version__ = "1.0"\n'
    if fa4_dist:
        files.update(_dist_info("flash-attn-4", "1.0"))
    if fa2_dist:
        files.update(_dist_info("flash-attn", "2.7.4"))
        files["flash_attn/__init__.py"] = '__version__ = "2.7.4"\n'
    return files


def test_flash_attn_4_alone_is_not_flash_attn_2(tmp_path: Path) -> None:
    (result,) = _detect_in_subprocess(
        tmp_path, _flash_attn_files(fa4_dist=True, cute=True, fa2_dist=False)
    )
    fa2 = result["packages"]["flash_attn"]
    assert fa2["status"] == "missing"
    assert "flash-attn-4" in fa2["detail"]
    assert "flash_attn" in fa2["detail"]
    fa4 = result["packages"]["flash_attn_4"]
    assert fa4 == {
        "name": "flash_attn_4",
        "status": "present",
        "version": "1.0",
        "detail": None,
        "distribution": "flash-attn-4",
    }


def test_flash_attn_4_dist_without_its_cute_module(tmp_path: Path) -> None:
    (result,) = _detect_in_subprocess(
        tmp_path, _flash_attn_files(fa4_dist=True, cute=False, fa2_dist=False)
    )
    assert result["packages"]["flash_attn"]["status"] == "missing"
    assert "flash-attn-4" in result["packages"]["flash_attn"]["detail"]
    fa4 = result["packages"]["flash_attn_4"]
    assert fa4["status"] == "broken"
    assert fa4["detail"] == (
        "import failed: ModuleNotFoundError: No module named 'flash_attn.cute'"
    )


def test_flash_attn_2_alone_does_not_make_flash_attn_4_broken(tmp_path: Path) -> None:
    (result,) = _detect_in_subprocess(
        tmp_path, _flash_attn_files(fa4_dist=False, cute=False, fa2_dist=True)
    )
    assert result["packages"]["flash_attn"] == {
        "name": "flash_attn",
        "status": "present",
        "version": "2.7.4",
        "detail": None,
        "distribution": "flash-attn",
    }
    assert result["packages"]["flash_attn_4"] == {
        "name": "flash_attn_4",
        "status": "missing",
        "version": None,
        "detail": "not installed",
    }


def test_flash_attn_2_and_4_together(tmp_path: Path) -> None:
    (result,) = _detect_in_subprocess(
        tmp_path, _flash_attn_files(fa4_dist=True, cute=True, fa2_dist=True)
    )
    assert result["packages"]["flash_attn"]["status"] == "present"
    assert result["packages"]["flash_attn"]["version"] == "2.7.4"
    assert result["packages"]["flash_attn_4"]["status"] == "present"
    assert result["packages"]["flash_attn_4"]["version"] == "1.0"


def test_flash_attn_2_with_its_early_cute_is_recorded_as_flash_attn(tmp_path: Path) -> None:
    """Issue 31: flash-attn 2.8 ships its own early ``flash_attn.cute`` (0.1.0), another
    kernel than flash-attn-4: the probe records the fa4 package as that flash-attn
    distribution and version, and the catalogue's fa4 facts for it drop what the early
    interface does not take (varlen with max_seqlen_*, key padding, deterministic)."""
    (result,) = _detect_in_subprocess(
        tmp_path, _flash_attn_files(fa4_dist=False, cute=True, fa2_dist=True)
    )
    fa4 = result["packages"]["flash_attn_4"]
    assert (fa4["status"], fa4["version"], fa4["distribution"]) == (
        "present",
        "2.7.4",
        "flash-attn",
    )
    platform = Platform(
        kind="cuda", capability=(9, 0), packages=(PackageFact(**fa4),), torch_version="2.13.0"
    )
    spec, applied = platform.installed(get_spec(Backend("fa4")))
    assert [v.kernel for v in applied][-1] == "flash-attn 2.x's early flash_attn.cute (0.1.0)"
    assert Requirement.PACKED_VARLEN not in spec.implements and spec.varlen_kernel is None
    assert [o.name for o in spec.options] == ["pack_gqa"]
    real = Platform.simulate("cuda:sm90+flash_attn_4")
    assert (
        platform.installed(get_spec(Backend("fa4")))[0]
        != real.installed(get_spec(Backend("fa4")))[0]
    )


def test_broken_flash_attn_2_alone(tmp_path: Path) -> None:
    files = _flash_attn_files(fa4_dist=False, cute=False, fa2_dist=True)
    files["flash_attn/__init__.py"] = (
        'raise OSError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice")\n'
    )
    (result,) = _detect_in_subprocess(tmp_path, files)
    assert result["packages"]["flash_attn"] == {
        "name": "flash_attn",
        "status": "broken",
        "version": None,
        "detail": (
            "import failed: OSError: flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice"
        ),
    }
    # flash-attn-4 is not installed at all: not "broken" by its sibling's error
    assert result["packages"]["flash_attn_4"]["status"] == "missing"
    assert result["packages"]["flash_attn_4"]["detail"] == "not installed"


def test_torch_cuda_that_raises_becomes_a_note(tmp_path: Path) -> None:
    prelude = """
    import torch

    def _is_available():
        raise RuntimeError("CUDA driver initialization failed, you might not have a GPU")

    torch.cuda.is_available = _is_available
    """
    (first,) = _detect_in_subprocess(tmp_path, {}, prelude=prelude)
    assert first["kind"] == "cpu"
    assert first["capability"] is None
    assert first["notes"] == [
        "torch.cuda query failed: RuntimeError: CUDA driver initialization failed, "
        "you might not have a GPU"
    ]


def test_torch_cuda_device_query_that_raises_falls_back_to_cpu(tmp_path: Path) -> None:
    prelude = """
    import torch

    def _props(index):
        raise AssertionError("Torch not compiled with CUDA enabled")

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_properties = _props
    """
    (result,) = _detect_in_subprocess(tmp_path, {}, prelude=prelude)
    assert result["kind"] == "cpu"
    assert result["capability"] is None
    assert result["notes"] == [
        "torch.cuda query failed: AssertionError: Torch not compiled with CUDA enabled"
    ]


def test_simulated_cuda_device_is_reported(tmp_path: Path) -> None:
    """With torch.cuda answering, detect reports cuda, its capability and arch."""
    prelude = """
    import types
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(name="NVIDIA H100")
    torch.cuda.get_device_capability = lambda i: (9, 0)
    torch.version.hip = None
    """
    (result,) = _detect_in_subprocess(tmp_path, {}, prelude=prelude)
    assert result["kind"] == "cuda"
    assert result["capability"] == [9, 0]
    assert result["notes"] == []


def test_a_current_fastvideo_kernel_install_is_found(tmp_path: Path) -> None:
    """FastVideo #962 merged st_attn, vsa and VMoBA into fastvideo_kernel: an install
    of fastvideo-kernel has none of the old modules, and must not read as missing."""
    files = {"fastvideo_kernel/__init__.py": ""}
    files.update(_dist_info("fastvideo-kernel", "0.2.5"))
    (result,) = _detect_in_subprocess(tmp_path, files)
    assert result["packages"]["fastvideo_kernel"] == {
        "name": "fastvideo_kernel",
        "status": "present",
        "version": "0.2.5",
        "detail": None,
        "distribution": "fastvideo-kernel",
    }
    for old in ("st_attn", "vsa", "vmoba"):
        assert result["packages"][old]["status"] == "missing"


def test_fastvideo_kernel_token_serves_its_sparse_backends() -> None:
    from attnres import LayerSpec, resolve

    layer = LayerSpec(128, "bf16")
    for text in ("cuda:sm90+fastvideo_kernel", "cuda:sm90+fastvideo-kernel"):
        platform = Platform.simulate(text)
        for backend in ("sliding_tile_attn", "video_sparse_attn"):
            assert resolve(layer, platform=platform, backend=backend).backend.name == backend
    # the old module names keep working for old installs
    for token, backend in (
        ("st_attn", "sliding_tile_attn"),
        ("vsa", "video_sparse_attn"),
        ("vmoba+flash_attn", "vmoba_attn"),
    ):
        platform = Platform.simulate(f"cuda:sm90+{token}")
        assert resolve(layer, platform=platform, backend=backend).backend.name == backend
    with_fa = Platform.simulate("cuda:sm90+fastvideo_kernel+flash_attn")
    assert resolve(layer, platform=with_fa, backend="vmoba_attn").backend.name == "vmoba_attn"


# -- issue 31: versions in the simulation grammar, chains per CUDA generation ----


def test_simulate_takes_a_version_and_a_distribution() -> None:
    sage = Platform.simulate("cuda:sm89+sageattention==1.0.6").package("sageattention")
    assert (sage.version, sage.distribution) == ("1.0.6", "sageattention")
    cute = Platform.simulate("cuda:sm90+flash_attn_4==flash-attn@2.8.3").package("flash_attn_4")
    assert (cute.version, cute.distribution) == ("2.8.3", "flash-attn")
    # the old strings keep their meaning: version "simulated", no distribution
    old = Platform.simulate("cuda:sm90+flash_attn+sageattention")
    assert old.package("sageattention") == PackageFact("sageattention", "present", "simulated")
    assert "==VERSION" in GRAMMAR
    for bad in ("cuda+all==1.0", "cuda+sageattention==", "cuda+sageattention==@1.0"):
        with pytest.raises(ValueError, match="expected KIND"):
            Platform.simulate(bad)


def test_sageattention_1_is_not_sageattention_2() -> None:
    """A machine with the registry's sageattention 1.0.6 gets SageAttention 1's facts:
    head sizes 64/96/128, no per-GPU functions, no lse, no key padding."""
    from attnres import LayerSpec, resolve
    from attnres.errors import ResolutionError

    base = get_spec(Backend("sage_attn"))
    one = Platform.simulate("cuda:sm89+sageattention==1.0.6")
    spec, applied = one.installed(base)
    assert [v.kernel for v in applied] == ["SageAttention 1"]
    assert spec.head_sizes.allowed == {64, 96, 128}
    assert (spec.entry_points, spec.lse, spec.masks) == ((), None, ())
    two = Platform.simulate("cuda:sm89+sageattention==2.2.0")
    assert two.installed(base) == (base, ())
    # head 96: SageAttention 1 takes it, 2 does not refuse it either; head 80: only 2
    layer = LayerSpec(80, "fp16")
    with pytest.raises(ResolutionError, match=r"head size 80 is not one of \[64, 96, 128\]"):
        resolve(layer, platform=one, backend="sage_attn")
    assert resolve(layer, platform=two, backend="sage_attn").backend.name == "sage_attn"
    assert resolve(LayerSpec(96, "fp16"), platform=one, backend="sage_attn").backend.name == (
        "sage_attn"
    )


def test_cuda_chain_follows_the_gpu_generation() -> None:
    def chain(spec: str) -> list[str]:
        return [b.name for b in Platform.simulate(spec).default_chain()]

    for sm in ("sm80", "sm86", "sm89"):
        assert chain(f"cuda:{sm}") == ["fa", "torch_sdpa"]
    # issue 31: FlashAttention-3 leads on Hopper, flash-attn 2 where FA3 is not installed
    assert chain("cuda:sm90") == ["fa3", "fa", "torch_sdpa"]
    for sm in ("sm100", "sm103"):
        assert chain(f"cuda:{sm}") == ["fa4", "torch_sdpa"]
    for sm in ("sm120", "sm121"):
        assert chain(f"cuda:{sm}") == ["torch_sdpa"]
    assert chain("cuda") == chain("cuda:sm75") == ["fa", "torch_sdpa"]  # unknown, older
    assert chain("rocm:gfx942") == chain("rocm:gfx950") == ["aiter", "torch_sdpa"]
    assert chain("rocm:gfx90a") == ["fa", "torch_sdpa"]
    assert chain("rocm") == chain("rocm:gfx1100") == ["aiter", "torch_sdpa"]


def test_hopper_prefers_fa3_and_falls_through_to_fa_where_it_cannot() -> None:
    """Issue 31: on sm90 the platform default is fa3 where flash_attn_interface is
    installed, then fa (not installed, or a layer fa3 cannot take: dropout), and
    torch_sdpa for what neither takes (a mask)."""
    from attnres import LayerSpec, Requirements, resolve

    def chosen(platform: str, **req: bool) -> tuple[str, str | None]:
        layer = LayerSpec(128, "bf16", requirements=Requirements(**req))
        r = resolve(layer, platform=Platform.simulate(platform))
        return r.backend.name, r.reason

    both = "cuda:sm90+flash_attn+flash_attn_interface"
    assert chosen(both) == ("fa3", None)
    assert chosen(both, backward=True) == ("fa3", None)
    assert chosen(both, dropout=True) == ("fa", "platform default fallback")
    assert chosen(both, attn_mask=True) == ("torch_sdpa", "platform default fallback")
    assert chosen("cuda:sm90+flash_attn") == ("fa", None)  # FA3 passed over, no reason
    assert chosen("cuda:sm89+flash_attn+flash_attn_interface") == ("fa", None)
