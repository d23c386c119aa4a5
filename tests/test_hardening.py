"""Issue 20: what a new user's run of 0.2 broke, beyond the bad-input catalogue
(tests/test_bad_inputs.py holds every error case): model folders that must plan,
the results file shared by a fleet, a cast a layer refuses, the version, the
command line's flags, and the one reader and the one writer.
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_folders import CONFIGS, safetensors, tiny_folder

import attnres
from attnres import Attention, Backend, Platform
from attnres.cli import main
from attnres.errors import ResultsFileError
from attnres.integrations import FolderBuildError, _untrusted, plan_folder
from attnres.tuning import Measured, ResultEntry, read_results, write_results

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "attnres"
CPU = Platform.simulate("cpu")


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main([*argv, "--json", "--platform", "cpu"])
    out, err = capsys.readouterr()
    assert out, err
    return code, json.loads(out)


# -- item 1: ordinary config values plan ------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "dtype", "source"),
    [
        ({"_attn_implementation": "flash_attention_2"}, "bfloat16", "config torch_dtype"),
        ({"torch_dtype": "auto"}, "float32", "default float32"),
        # item 16: float8 in a config is storage, as in the weights: not a compute dtype
        ({"torch_dtype": "float8_e4m3fn"}, "float32", "default float32"),
    ],
    ids=["attn-implementation", "torch-dtype-auto", "torch-dtype-float8"],
)
def test_ordinary_config_values_plan(
    tmp_path: Path, edit: dict[str, Any], dtype: str, source: str
) -> None:
    folder = tiny_folder(tmp_path / "pipe", text_encoder=lambda d: d.update(edit))
    plan = plan_folder(folder, platform=CPU)
    assert plan.ok, plan.errors
    (comp,) = [c for c in plan.components if c.name == "text_encoder"]
    assert comp.dtype is not None and (comp.dtype.dtype, comp.dtype.source) == (dtype, source)
    if "float8" in str(edit):
        assert "float8_e4m3fn is storage, not a compute dtype" in comp.dtype.describe()
    assert len(plan.by_component()["text_encoder"]) == 1


# -- item 7: what is not a model is skipped, saying so ------------------------------------


def test_components_that_are_not_models_are_skipped_and_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tiny_folder(
        tmp_path / "pipe",
        index=lambda d: d.update(
            safety_checker=[None, None], feature_extractor=["transformers", "CLIPImageProcessor"]
        ),
    )
    code, doc = _json(capsys, ["plan", str(folder)])
    assert code == 0
    assert {c["name"] for c in doc["components"]} == {"vae", "text_encoder"}
    skipped = {s["name"]: s["why"] for s in doc["skipped"]}
    assert skipped == {
        "scheduler": "FlowMatchEulerDiscreteScheduler, not a model",
        "tokenizer": "T5TokenizerFast, not a model",
        "safety_checker": "absent: null in model_index.json",
        "feature_extractor": "CLIPImageProcessor, not a model",
    }
    assert main(["plan", str(folder), "--platform", "cpu"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Skipped: scheduler (FlowMatchEulerDiscreteScheduler, not a model); tokenizer" in text


# -- item 4: a missing extra names the extra ----------------------------------------------


@pytest.mark.parametrize("library", ["diffusers", "transformers"])
def test_a_missing_extra_says_which_to_install(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    library: str,
) -> None:
    folder = tiny_folder(tmp_path / "pipe")
    monkeypatch.setitem(sys.modules, library, None)  # import raises ImportError
    assert main(["plan", str(folder), "--platform", "cpu"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"needs {library}, which does not import here" in err
    assert f"pip install 'attnres[{library}]'" in err
    assert "bug in attnres" not in err


class _BrokenAtImport:
    """A meta path finder under which importing ``name`` raises what diffusers 0.42
    raises on torch 2.5: not an ImportError, an AttributeError from inside its import."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == self.name:
            raise AttributeError("module 'torch' has no attribute 'accelerator'")


@pytest.mark.parametrize("library", ["diffusers", "transformers"])
def test_a_library_that_fails_at_import_is_a_user_error_naming_the_versions(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    library: str,
) -> None:
    from importlib import metadata

    from attnres._torch_floor import MIN_TORCH, installed_torch
    from attnres.integrations._plan import SUPPORTED_VERSIONS

    folder = tiny_folder(tmp_path / "pipe")
    monkeypatch.delitem(sys.modules, library, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenAtImport(library), *sys.meta_path])
    assert main(["plan", str(folder), "--platform", "cpu"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "bug in attnres" not in err
    # what failed, which versions are there and which are supported, what to do
    assert f"needs {library}, which does not import here" in err
    assert "AttributeError: module 'torch' has no attribute 'accelerator'" in err
    assert f"installed: {library} {metadata.version(library)}, torch {installed_torch()}" in err
    low, high = SUPPORTED_VERSIONS[library]
    floor = f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}"
    assert f"supports {library}>={low},<{high} with {floor}" in err
    assert f"pip install 'attnres[{library}]'" in err


# -- item 9: the dtype from the files from_pretrained loads ---------------------------------


def test_variant_files_beside_the_default_ones_are_passed_over(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path / "sd15")
    vae = folder / "vae"
    safetensors(
        vae / "diffusion_pytorch_model.safetensors",
        {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}},
    )
    safetensors(
        vae / "diffusion_pytorch_model.fp16.safetensors",
        {"w": {"dtype": "F16", "shape": [64, 64], "data_offsets": [0, 64]}},
    )
    dtype, detail = _untrusted.dtype_from_weights(vae)
    assert dtype == "float32"
    assert detail == "1 safetensors file(s); 1 variant file(s) passed over, as from_pretrained does"
    (vae / "diffusion_pytorch_model.safetensors").unlink()
    dtype, detail = _untrusted.dtype_from_weights(vae)
    assert dtype == "float16" and detail is not None and "only variant files" in detail
    # sharded variants: model.fp16-00001-of-00002.safetensors is a variant too
    assert _untrusted._is_variant(Path("model.fp16-00001-of-00002.safetensors"))
    assert not _untrusted._is_variant(Path("model-00001-of-00002.safetensors"))


def test_more_weight_files_than_are_read_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_untrusted, "MAX_WEIGHT_FILES", 3)
    for i in range(5):
        safetensors(
            tmp_path / f"model-{i:05d}-of-00005.safetensors",
            {"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}},
        )
    dtype, detail = _untrusted.dtype_from_weights(tmp_path)
    assert dtype == "bfloat16" and detail is not None and "the first 3 of 5 files read" in detail


# -- item 10: a single model folder's component is not its folder's name -----------------


def _t5_folder(path: Path, **extra: Any) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**CONFIGS["text_encoder"], **extra}))
    return path


def test_a_model_folder_named_by_a_commit_hash_is_its_models_component(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _t5_folder(tmp_path / "snapshots" / "5f3c1a0e9b8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b")
    code, doc = _json(capsys, ["plan", str(snapshot)])
    assert code == 0
    (comp,) = doc["components"]
    assert (comp["name"], comp["kind"]) == ("text_encoder", "text_encoder")
    monkeypatch.chdir(snapshot)
    code, doc = _json(capsys, ["plan", "."])
    assert code == 0 and doc["components"][0]["name"] == "text_encoder"
    code, doc = _json(capsys, ["plan", ".", "--component", "text_encoder_2"])
    assert code == 0 and doc["components"][0]["name"] == "text_encoder_2"
    assert main(["plan", ".", "--component", "../x"]) == 2
    assert "'../x' is not a component name" in capsys.readouterr().err


def test_a_single_diffusers_model_folder_is_planned_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vae = tmp_path / "vae"
    vae.mkdir()
    (vae / "config.json").write_text(json.dumps(CONFIGS["vae"]))
    code, doc = _json(capsys, ["plan", str(vae)])
    assert code == 0
    (comp,) = doc["components"]
    sites = [site for layer in comp["layers"] for site in layer["sites"]]
    assert (comp["name"], comp["kind"], len(sites)) == ("vae", "vae", 2)


# -- item 18: --dtype names are normalised ------------------------------------------------


def test_dtype_component_names_are_normalised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tiny_folder(tmp_path / "pipe")
    code, doc = _json(capsys, ["plan", str(folder), "--dtype", "Text-Encoder=fp16"])
    assert code == 0
    got = {c["name"]: (c["dtype"], c["dtype_source"]) for c in doc["components"]}
    assert got["text_encoder"] == ("float16", "--dtype text_encoder=")


def test_help_lists_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for code in (
        "0 success",
        "1 a resolution",
        "2 bad usage",
        "70 an internal error",
        "130 interrupted",
        "143 terminated",
    ):
        assert code in text, code


# -- fuzzing: the build runs under a budget ------------------------------------------------


def test_a_build_over_its_budget_is_stopped_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_untrusted, "MAX_BUILD_TORCH_CALLS", 5)
    folder = tiny_folder(tmp_path / "pipe")
    assert torch.is_grad_enabled() and torch.get_default_dtype() is torch.float32
    with pytest.raises(
        FolderBuildError,
        match=r"for component '(vae|text_encoder)' from this "
        r"config: _BudgetExceeded: over the budget of 5 torch calls",
    ):
        plan_folder(folder, platform=CPU)
    # a build stopped half-way leaves torch's global state as it found it
    assert torch.is_grad_enabled() and torch.get_default_dtype() is torch.float32


def test_one_line_drops_cpp_stack_frames() -> None:
    exc = RuntimeError(
        "Trying to create tensor with negative dimension -5\nException raised "
        "from check_size_nonnegative at c10/core/...\nframe #0: c10::Error"
    )
    assert _untrusted.one_line(exc) == (
        "RuntimeError: Trying to create tensor with negative dimension -5"
    )


# -- item 5: a cast a layer refuses changes nothing -----------------------------------------


def test_a_cast_a_layer_refuses_leaves_no_model_half_cast() -> None:
    model = torch.nn.ModuleDict(
        {
            "before": torch.nn.Linear(4, 4),
            "attn": Attention(2, 8, dtype="float32", platform=CPU, name="attn"),
            "after": torch.nn.Linear(4, 4),
        }
    )
    model.to(torch.float8_e4m3fn)  # no backend on CPU takes float8
    assert {p.dtype for p in model.parameters()} == {torch.float8_e4m3fn}  # all, not half
    attn = model["attn"]
    assert attn.backend == Backend.parse("torch_sdpa") and attn.layer_spec.dtype == "float32"
    q = torch.zeros(1, 3, 2, 8, dtype=torch.float8_e4m3fn)
    refused = r"cannot take torch\.float8_e4m3fn .* resolved for float32"
    with pytest.raises(ValueError, match=refused):
        attn(q, q, q)
    # cast on its own, the layer refuses before anything changes
    alone = Attention(2, 8, dtype="float32", platform=CPU, name="alone")
    with pytest.raises(attnres.ResolutionError, match="float8_e4m3fn"):
        alone.to(torch.float8_e4m3fn)
    assert alone.layer_spec.dtype == "float32"


# -- item 6: one results file for a fleet -----------------------------------------------------


def _entry(call: str) -> ResultEntry:
    sdpa, eager = Backend.parse("torch_sdpa"), Backend.parse("eager")
    return ResultEntry(
        platform={"kind": "cpu"},
        call=call,
        incumbent=sdpa,
        measured=(Measured(sdpa, 1000, 10), Measured(eager, 900, 10, 0.0)),
        no_kernel=(),
        warmup=1,
        repeats=3,
    )


def _save_many(path: str, worker: int, rounds: int) -> None:
    for i in range(rounds):
        write_results(path, [_entry(f"worker{worker}-call{i}")])


def test_processes_saving_to_one_file_keep_every_entry(tmp_path: Path) -> None:
    path = str(tmp_path / "fleet.json")
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_save_many, args=(path, w, 5)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    calls = {e.call for e in read_results(path)}
    assert calls == {f"worker{w}-call{i}" for w in range(4) for i in range(5)}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_no_kernel_naming_two_backends_reads_back(tmp_path: Path) -> None:
    """Found by reading: two no_kernel backends failed to sort (Backend has no order)."""
    sdpa = Backend.parse("torch_sdpa")
    entry = ResultEntry(
        platform={"kind": "cpu"},
        call="c",
        incumbent=sdpa,
        measured=(Measured(sdpa, 10, 1),),
        no_kernel=((Backend.parse("sage_attn"), "none"), (Backend.parse("fa"), "none")),
        warmup=0,
        repeats=1,
    )
    write_results(tmp_path / "r.json", [entry])
    (back,) = read_results(tmp_path / "r.json")
    assert [b.name for b, _ in back.no_kernel] == ["fa", "sage_attn"]


def test_an_impossible_results_file_never_decides(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_results(path, [_entry("c")])
    doc = json.loads(path.read_text())
    doc["entries"][0]["measurements"][1]["median_ns"] = -1
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsFileError, match="median_ns: -1 is impossible"):
        read_results(path)
    with pytest.raises(ResultsFileError):  # and it is never overwritten
        write_results(path, [_entry("d")])
    assert json.loads(path.read_text()) == doc


# -- item 17: one source for the version --------------------------------------------------------


def test_one_source_for_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "attnres.__version__"
    tree = ast.parse((SRC / "__init__.py").read_text())
    literal = next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "__version__"
        and isinstance(node.value, ast.Constant)
    )
    assert literal == attnres.__version__
    # the 0.3 development line: CHANGELOG's first release heading is this version's
    changelog = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## \[(\d+\.\d+\.\d+)\]", changelog, re.M)
    assert first is not None and attnres.__version__.startswith(first.group(1))
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"attnres {attnres.__version__}"


# -- Done when: one reader, one writer ----------------------------------------------------------

#: The only modules that open a file attnres reads or writes.
_READER_WRITER = {"_files.py"}
#: Calls that open, read or write a file by path, and third-party loaders that do.
_OPENERS = re.compile(
    r"\bopen\(|\.read_text\(|\.read_bytes\(|\.write_text\(|\.write_bytes\(|\.open\(|"
    r"\bos\.open\(|from_pretrained\(|\bjson\.load\(|\btomllib\.load\(|\bmkfifo\(|"
    r"safe_open\(|\btorch\.load\("
)
#: Each exception, with why it is not a file attnres reads or writes.
_ALLOWED = {
    # the CLI points its own stdout at /dev/null after a broken pipe
    ("cli.py", "devnull = os.open(os.devnull, os.O_WRONLY)"),
}


def test_no_module_but_the_reader_and_the_writer_opens_a_file() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name in _READER_WRITER:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if not _OPENERS.search(code) or code.strip().startswith(('"', "'")):
                continue
            if (path.name, code.strip()) in _ALLOWED:
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)


def test_plan_dir_opens_the_folders_files_only_through_the_one_reader(
    tmp_path: Path,
) -> None:
    """At run time: every file of the folder is opened from attnres._files (an
    audit hook sees every open; diffusers and transformers read nothing there)."""
    folder = tiny_folder(tmp_path / "pipe")
    safetensors(
        folder / "vae" / "diffusion_pytorch_model.safetensors",
        {"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}},
    )
    root = str(folder.resolve())
    opened: list[tuple[str, str]] = []
    active = [True]
    reader = str(SRC / "_files.py")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if not active[0] or event != "open":
            return
        target = args[0]
        if not isinstance(target, str | os.PathLike) or not os.fspath(target).startswith(root):
            return
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(
            (os.path.dirname(os.__file__), "<frozen")
        ):
            frame = frame.f_back  # the stdlib's own frames (pathlib, os)
        opened.append((os.fspath(target), frame.f_code.co_filename if frame else "?"))

    sys.addaudithook(hook)
    try:
        plan = plan_folder(folder, platform=CPU)
    finally:
        active[0] = False  # an audit hook cannot be removed: it goes quiet
    assert plan.ok
    files = [(p, by) for p, by in opened if not os.path.isdir(p)]
    assert {Path(p).name for p, _ in files} >= {
        "model_index.json",
        "config.json",
        "diffusion_pytorch_model.safetensors",
    }
    assert {by for _, by in files} == {reader}, files


# -- item 19: vocabulary values are compared as members, not string literals ------------------


def test_no_vocabulary_value_is_compared_as_a_string_literal() -> None:
    from attnres._states import PackageStatus, Status

    values = "|".join(m.value for m in (*Status, *PackageStatus))
    pattern = re.compile(
        rf"status\s*(==|!=)\s*[\"']({values})[\"']|[\"']({values})[\"']\s*"
        rf"(==|!=)\s*\S*status"
    )
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("MAX_BUILD_SECONDS", 0.0, "over the budget of 0 s (MAX_BUILD_SECONDS)"),
        ("MAX_BUILD_MEMORY_BYTES", -(1 << 40), "GiB of memory (MAX_BUILD_MEMORY_BYTES)"),
    ],
)
def test_time_and_memory_budgets_stop_a_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, value: float, says: str
) -> None:
    monkeypatch.setattr(_untrusted, setting, value)
    folder = tiny_folder(tmp_path / "pipe")
    with pytest.raises(FolderBuildError, match=re.escape(says)):
        plan_folder(folder, platform=CPU)
