"""Plan a model folder from its configs alone: ``attnres plan DIR``.

A diffusers pipeline folder has ``model_index.json`` and one sub-folder per
component with its ``config.json``; a transformers model folder has a
``config.json`` naming its ``architectures``. Each model is built on the meta
device from its config: no weight is read and nothing is downloaded. Only
classes that diffusers or transformers export are built.

The dtype a component is planned for comes from, in order: ``--dtype
COMPONENT=DTYPE``; ``--dtype DTYPE``; the dtype its ``*.safetensors`` files
record (their JSON headers only, never the tensors; float8 storage is not a
compute dtype and is passed over); the config's ``torch_dtype`` (or
``dtype``); else ``float32``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attnres._vocab import normalize_dtype
from attnres.integrations._plan import DtypeChoice, IntegrationPlan, plan_sites
from attnres.layer import SelectionConfig
from attnres.platform import Platform

__all__ = ["DtypeArgs", "dtype_from_weights", "parse_dtype_args", "plan_folder"]

#: the largest JSON file or safetensors header attnres reads
MAX_JSON_BYTES = 4 * 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_WEIGHT_FILES = 256

_SAFETENSORS_DTYPES: dict[str, str | None] = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": None,  # storage only: layerwise casting computes in another dtype
    "F8_E5M2": None,
}


class DtypeArgs:
    """``--dtype`` values: one for every component and/or per component."""

    def __init__(self, every: str | None, per: Mapping[str, str]) -> None:
        self.every = every
        self.per = dict(per)


def parse_dtype_args(values: Sequence[str]) -> DtypeArgs:
    every: str | None = None
    per: dict[str, str] = {}
    for value in values:
        component, sep, dtype = value.rpartition("=")
        try:
            parsed = normalize_dtype(dtype)
        except ValueError as exc:
            raise ValueError(f"--dtype {value}: {exc}") from None
        if sep:
            if not component:
                raise ValueError(f"--dtype {value}: expected COMPONENT=DTYPE or DTYPE")
            per[component] = parsed
        else:
            every = parsed
    return DtypeArgs(every, per)


def _read_json(path: Path) -> Any:
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(
            f"{path}: {size} bytes is larger than attnres reads "
            f"({MAX_JSON_BYTES}); is it a config file?"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None


def dtype_from_weights(folder: Path) -> tuple[str | None, str | None]:
    """The dtype most weight elements are stored in, from safetensors headers.

    Returns ``(dtype, detail)``; ``dtype`` is None when no header names a
    compute dtype (``detail`` then says why, or is None when there are no files).
    """
    files = sorted(folder.glob("*.safetensors"))[:MAX_WEIGHT_FILES]
    if not files:
        return None, None
    counts: dict[str, int] = {}
    storage_only = 0
    for path in files:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise ValueError(
                    f"{path}: header of {length} bytes is larger than attnres "
                    f"reads ({MAX_HEADER_BYTES})"
                )
            raw = fh.read(length)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: safetensors header is not valid JSON: {exc}") from None
        for key, entry in header.items():
            if key == "__metadata__" or not isinstance(entry, dict):
                continue
            elements = 1
            for dim in entry.get("shape", []):
                elements *= int(dim)
            name = _SAFETENSORS_DTYPES.get(str(entry.get("dtype")), "")
            if name is None:
                storage_only += elements
            elif name:
                counts[name] = counts.get(name, 0) + elements
    if not counts:
        why = (
            "weights are stored in float8, which is not a compute dtype"
            if storage_only
            else "no floating-point tensors in the headers"
        )
        return None, why
    best = max(sorted(counts), key=lambda k: counts[k])
    return best, f"{len(files)} safetensors file(s)"


def _choose_dtype(
    name: str, folder: Path, config: Mapping[str, Any], args: DtypeArgs
) -> DtypeChoice:
    if name in args.per:
        return DtypeChoice(args.per[name], f"--dtype {name}=")
    if args.every is not None:
        return DtypeChoice(args.every, "--dtype")
    dtype, detail = dtype_from_weights(folder)
    if dtype is not None:
        return DtypeChoice(dtype, "weights", detail)
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str):
            try:
                return DtypeChoice(normalize_dtype(value), f"config {key}", detail)
            except ValueError:
                continue
    return DtypeChoice("float32", "default float32", detail)


def _model_class(library: str, class_name: str, where: str) -> Any:
    import importlib

    module = importlib.import_module(library)
    base = module.ModelMixin if library == "diffusers" else module.PreTrainedModel
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{where}: {library} has no model class {class_name!r}")
    return cls


def _build(library: str, cls: Any, folder: Path, config: dict[str, Any]) -> Any:
    import torch

    # planned for inference, as from_pretrained loads a model (eval mode)
    with torch.device("meta"):
        if library == "diffusers":
            return cls.from_config(config).eval()
        cfg = cls.config_class.from_pretrained(str(folder), local_files_only=True)
        return cls._from_config(cfg).eval()


def plan_folder(
    folder: str | os.PathLike[str],
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
    dtypes: DtypeArgs | Mapping[str, str] | None = None,
) -> IntegrationPlan:
    """Plan a diffusers pipeline folder or a transformers model folder on meta.

    ``dtypes`` maps a component to its compute dtype (``"*"``: every component),
    as ``--dtype`` does; components not named get theirs from their weights'
    headers, their config, or float32 (each component's ``DtypeChoice`` says which).
    """
    folder = Path(folder)
    if dtypes is None:
        args = DtypeArgs(None, {})
    elif isinstance(dtypes, DtypeArgs):
        args = dtypes
    else:
        per = {k: normalize_dtype(v) for k, v in dtypes.items()}
        args = DtypeArgs(per.pop("*", None), per)
    index = folder / "model_index.json"
    if index.is_file():
        doc = _read_json(index)
        if not isinstance(doc, dict):
            raise ValueError(f"{index}: expected a JSON object")
        title = str(doc.get("_class_name", folder.name))
        parts: list[tuple[str, str, str]] = []
        for name, value in doc.items():
            if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
                continue
            library, class_name = value
            if library not in ("diffusers", "transformers") or not isinstance(class_name, str):
                continue
            sub = folder / name / "config.json"
            if not sub.is_file():
                # tokenizers and schedulers have no config.json model to plan
                continue
            parts.append((name, library, class_name))
    elif (folder / "config.json").is_file():
        doc = _read_json(folder / "config.json")
        archs = doc.get("architectures") if isinstance(doc, dict) else None
        if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
            raise ValueError(
                f"{folder / 'config.json'}: no 'architectures' entry naming the "
                f"transformers model class"
            )
        title = archs[0]
        parts = [(folder.name, "transformers", archs[0])]
    else:
        raise ValueError(
            f"{folder}: neither a diffusers pipeline folder (model_index.json) nor a "
            f"transformers model folder (config.json)"
        )
    unknown = sorted(set(args.per) - {p[0] for p in parts})
    if unknown:
        raise ValueError(
            f"--dtype {unknown[0]}=...: {folder} has no model component "
            f"{unknown[0]!r}; its components: {', '.join(p[0] for p in parts)}"
        )
    models: dict[str, Any] = {}
    choices: dict[str, DtypeChoice] = {}
    for name, library, class_name in parts:
        sub = (
            folder if (folder / "config.json").is_file() and not index.is_file() else folder / name
        )
        where = str(sub / "config.json")
        cfg = _read_json(sub / "config.json")
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: expected a JSON object")
        cls = _model_class(library, class_name, where)
        try:
            models[name] = _build(library, cls, sub, cfg)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(
                f"{where}: cannot build {class_name} from this config: {exc}"
            ) from None
        choices[name] = _choose_dtype(name, sub, cfg, args)
    if any(library == "diffusers" for _, library, _ in parts):
        from attnres.integrations import diffusers as _diffusers

        return _diffusers.plan(
            models, config, platform, dtypes=choices, title=title, source=str(folder)
        )
    # a transformers model folder: diffusers need not be installed
    from attnres.integrations import transformers as _transformers

    described = [
        (name, choices[name], _transformers.describe_sites(model, name, choices[name].dtype))
        for name, model in models.items()
    ]
    return plan_sites(
        title=title, source=str(folder), components=described, config=config, platform=platform
    )
