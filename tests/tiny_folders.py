"""Tiny model folders for ``attnres plan DIR`` (issue 20): a diffusers pipeline
folder with a small VAE and a small T5 text encoder, and the edits the
bad-input catalogue and the fuzz corpus make to it. Everything builds in well
under a second on the meta device."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

INDEX: dict[str, Any] = {
    "_class_name": "TinyPipeline",
    "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "text_encoder": ["transformers", "T5EncoderModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}

CONFIGS: dict[str, dict[str, Any]] = {
    "vae": {
        "_class_name": "AutoencoderKL",
        "_diffusers_version": "0.42.1",
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": [8],
        "down_block_types": ["DownEncoderBlock2D"],
        "up_block_types": ["UpDecoderBlock2D"],
        "latent_channels": 4,
        "layers_per_block": 1,
        "norm_num_groups": 4,
    },
    "text_encoder": {
        "architectures": ["T5EncoderModel"],
        "model_type": "t5",
        "d_model": 16,
        "d_kv": 8,
        "d_ff": 32,
        "num_heads": 2,
        "num_layers": 1,
        "vocab_size": 32,
        "torch_dtype": "bfloat16",
    },
}


def safetensors(path: Path, header: Any) -> None:
    """A safetensors file holding ``header`` (any JSON) and no tensor bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def tiny_folder(
    root: Path,
    *,
    index: Callable[[dict[str, Any]], object] | None = None,
    vae: Callable[[dict[str, Any]], object] | None = None,
    text_encoder: Callable[[dict[str, Any]], object] | None = None,
) -> Path:
    """The tiny pipeline folder at ``root``, each document edited in place first."""
    doc = json.loads(json.dumps(INDEX))
    if index is not None:
        index(doc)
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps(doc))
    for name, edit in (("vae", vae), ("text_encoder", text_encoder)):
        cfg = json.loads(json.dumps(CONFIGS[name]))
        if edit is not None:
            edit(cfg)
        (root / name).mkdir(exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root


def with_file(name: str, content: str | bytes, **edits: Any) -> Callable[[Path], Path]:
    """A builder: the tiny folder with ``name`` (relative) holding ``content``."""

    def build(root: Path) -> Path:
        folder = tiny_folder(root, **edits)
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir() and not path.is_symlink():
            import shutil

            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return folder

    return build


def with_header(header: Any) -> Callable[[Path], Path]:
    """A builder: the tiny folder whose VAE has a safetensors file holding ``header``."""

    def build(root: Path) -> Path:
        folder = tiny_folder(root)
        safetensors(folder / "vae" / "diffusion_pytorch_model.safetensors", header)
        return folder

    return build


def with_special(name: str, kind: str) -> Callable[[Path], Path]:
    """A builder: ``name`` replaced by a FIFO, a directory, a dangling symlink, a loop."""

    def build(root: Path) -> Path:
        import shutil

        folder = tiny_folder(root)
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dir":
            path.mkdir()
        elif kind == "dangling":
            path.symlink_to("gone")
        elif kind == "loop":
            path.symlink_to(path.name)
        elif kind == "missing":
            pass
        else:
            raise ValueError(kind)
        return folder

    return build
