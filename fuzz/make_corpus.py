"""Write the seed corpus of every fuzz target (fuzz/corpus/TARGET/) from the
repository's own traces, pipelines and example folders. Run it again when they
change; the fuzzers add what they find to these folders only when asked."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_folders import CONFIGS, INDEX  # noqa: E402

CORPUS = ROOT / "fuzz" / "corpus"
FOLDER_FILES = (
    "model_index.json",
    "vae/config.json",
    "text_encoder/config.json",
    "vae/diffusion_pytorch_model.safetensors",
)


def _write(target: str, name: str, data: bytes) -> None:
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)


def main() -> None:
    shutil.rmtree(CORPUS, ignore_errors=True)
    traces = sorted((ROOT / "traces").glob("*.json"), key=lambda p: p.stat().st_size)
    for path in traces[:8]:
        _write("trace", path.name, path.read_bytes())
        _write("replay", path.name, path.read_bytes())
    for path in sorted((ROOT / "examples").glob("*.toml")):
        _write("pipeline", path.name, path.read_bytes())
    header = {
        "w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]},
        "__metadata__": {"format": "pt"},
    }
    raw = json.dumps(header).encode()
    st = struct.pack("<Q", len(raw)) + raw + b"\0" * 32
    _write("header", "bf16.safetensors", st)
    seeds = [
        json.dumps(INDEX).encode(),
        json.dumps(CONFIGS["vae"]).encode(),
        json.dumps(CONFIGS["text_encoder"]).encode(),
        st,
    ]
    for i, (name, data) in enumerate(zip(FOLDER_FILES, seeds, strict=True)):
        _write("folder", name.replace("/", "-"), bytes([i]) + data)
    flux = ROOT / "examples" / "flux.1-dev"
    _write("folder", "flux-model_index.json", bytes([0]) + (flux / "model_index.json").read_bytes())
    _write("folder", "flux-vae.json", bytes([1]) + (flux / "vae" / "config.json").read_bytes())
    _write(
        "folder",
        "flux-t5.json",
        bytes([2]) + (flux / "text_encoder_2" / "config.json").read_bytes(),
    )
    entry = {
        "platform": {
            "kind": "cpu",
            "device_name": None,
            "capability": None,
            "arch": None,
            "torch_version": "2.13.0",
            "packages": {},
        },
        "call": "q(1, 64, 8, 64) float32",
        "incumbent": "torch_sdpa",
        "no_kernel": {"sage_attn": "not installed", "fa": "not installed"},
        "warmup": 2,
        "repeats": 5,
        "measurements": [
            {
                "candidate": "torch_sdpa",
                "median_ns": 1000,
                "spread_ns": 20,
                "deviation": None,
                "error": None,
            },
            {
                "candidate": "eager",
                "median_ns": 900,
                "spread_ns": 30,
                "deviation": 1e-7,
                "error": None,
            },
        ],
    }
    doc = {"format": "attnres-autotune-results", "version": 1, "entries": [entry]}
    _write("results", "results.json", json.dumps(doc, indent=2).encode())
    _write("config", "seed-vae", bytes(range(8)))
    _write("config", "seed-t5", bytes([1, 3, 16, 5, 32, 7, 48, 9]))
    _issue_32_seeds()


def _issue_32_seeds() -> None:
    """Seeds of the parsers issue 32 added targets for, with the inputs it found."""
    nines = "9" * 102
    for i, text in enumerate(
        ["fa.deterministic=true", "sage_attn.pv_accum_dtype=fp32", "x", "fa.=1", "fa3.x=none"]
    ):
        _write("option", f"seed-{i}", text.encode())
    schedules = ["0:sage_attn,40:fa", "\u00b2:fa", "9" * 5000 + ":fa", "0:fa,0:eager"]
    for i, text in enumerate(schedules):
        _write("schedule", f"seed-{i}", text.encode())
    for i, text in enumerate(
        ["cuda:sm90+flash_attn", "cuda:sm" + nines, "cuda:sm" + "9" * 4302, "rocm:gfx942+all"]
    ):
        _write("platform", f"seed-{i}", text.encode())
    for i, text in enumerate(["bf16", "fp32\nvae=fp32", "float8_e4m3fn", "vae=\nx"]):
        _write("dtype", f"seed-{i}", text.encode())
    huge = bytes([0xFF]) + b"\xff" * 600
    for i, data in enumerate([b"\x00\x02\x00\x02\x00\x08\x00\x08", huge + huge, b"\x00\xff"]):
        _write("layout", f"seed-{i}", data)
    flag = {name: bytes([i]) for i, name in enumerate(_CLI_FLAGS)}
    cli = [
        [flag["--ring-degree"], b"2", flag["--heads"], b"8"],
        [flag["--ulysses-degree"], b"9" * 100],
        [flag["--platform"], b"cuda:sm" + nines.encode()],
        [flag["--ulysses-degree"], b"2", flag["--heads"], b"24", flag["--kv-heads"], b"48"],
        [flag["--schedule"], "\u00b2:fa".encode()],
        [flag["--backend-option"], b"fa.deterministic=true", flag["--backend-option"],
         b"fa.deterministic=false"],
        [flag["--ring-degree"], b"2", flag["--attention-backend"], b"flex_attention"],
        [flag["--autotune"], flag["--ring-degree"], b"2", flag["--json"]],
    ]  # fmt: skip
    for i, words in enumerate(cli):
        _write("cli", f"seed-{i}", b"\0".join(words))
    # ``attnres plan`` of an example pipeline, --trace-out DIR (every trace replays)
    plan = {name: bytes([i]) for i, name in enumerate(_PLAN_FLAGS)}
    plans = [
        [b"plan"],
        [b"plan", plan["--attention-backend"], b"sage_attn", plan["--platform"],
         b"cuda:sm90+sageattention"],
        [b"plan", plan["--ring-degree"], b"2", plan["--ulysses-degree"], b"2"],
        [b"plan", plan["--backend-option"], b"fa.deterministic=true", plan["--json"]],
    ]  # fmt: skip
    for i, words in enumerate(plans):
        _write("cli", f"seed-plan-{i}", b"\0".join(words))


#: the flags of the cli target, in its order (fuzz/fuzz_attnres.py's _CLI_FLAGS)
_CLI_FLAGS = (
    "--head-size", "--dtype", "--platform", "--ulysses-degree", "--ring-degree", "--heads",
    "--kv-heads", "--schedule", "--backend-option", "--attention-backend", "--supported",
    "--default", "--requires", "--role", "--layer-name", "--component", "--autotune", "--json",
)  # fmt: skip


#: the flags of a ``plan`` command line (fuzz/fuzz_attnres.py's _PLAN_FLAGS)
_PLAN_FLAGS = (
    "--dtype", "--component", "--attention-backend", "--autotune", "--autotune-min-elements",
    "--platform", "--json", "--ulysses-degree", "--ring-degree", "--backend-option",
)  # fmt: skip


if __name__ == "__main__":
    main()
