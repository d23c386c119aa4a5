"""Read the tiny model configs and dummy inputs of diffusers' own model tests into
``tests/data/diffusers_tiny_models.json`` (issue 19, item 5).

Run once against a checkout of huggingface/diffusers (its ``tests/models``):

    python scripts/extract_diffusers_test_configs.py /path/to/diffusers [COMMIT]

Each test module under ``tests/models`` is imported with the installed
diffusers; every tester class that names a ``model_class`` and gives an init
dict and dummy inputs (``get_init_dict``/``get_dummy_inputs``, or the older
``prepare_init_args_and_inputs_for_common``) contributes its model class's
entry: the init dict as data, and the inputs as recipes (a tensor's shape and
dtype; its values where they matter: integers, masks, a few scalars; a Python
value as its ``repr``). The file records the test each entry came from; the
tests rebuild the inputs from the recipes (``tests/tiny_models.py``).
Test-only packages the modules import but these entries never use
(``parameterized``, ``datasets``, ``requests_mock``) are stood in for.
"""

from __future__ import annotations

import importlib
import json
import logging
import subprocess
import sys
import types
import unittest
import warnings
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "diffusers_tiny_models.json"


class _Anything(types.ModuleType):
    """A test-only package that is imported but never used by the entries read."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _decorator


def _decorator(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


def _recipe(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        out: dict[str, Any] = {
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
        few = value.numel() <= 8
        mask_like = value.numel() <= 4096 and value.unique().numel() <= 2
        if (not value.is_floating_point() or few or mask_like) and value.numel() <= 4096:
            out["value"] = value.tolist()
        return out
    if isinstance(value, torch.Generator):
        return {"generator": 0}
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return {"list": [_recipe(v) for v in value]}
    if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
        return {"dict": {k: _recipe(v) for k, v in value.items()}}
    text = repr(value)
    try:
        import ast

        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"unsupported": type(value).__name__}
    return {"python": text}


def main(checkout: Path, commit: str | None = None) -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    for name in ("parameterized", "datasets", "requests_mock"):
        sys.modules[name] = _Anything(name)
    sys.modules["parameterized"].parameterized = _Anything("parameterized")  # type: ignore[attr-defined]
    sys.path.insert(0, str(checkout))
    import diffusers

    commit = (
        commit
        or subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    entries: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for path in sorted((checkout / "tests" / "models").rglob("test_*.py")):
        rel = path.relative_to(checkout)
        try:
            module = importlib.import_module(".".join(rel.with_suffix("").parts))
        except Exception as exc:
            skipped[str(rel)] = f"import: {type(exc).__name__}: {exc}"[:160]
            continue
        for tester_name, tester in vars(module).items():
            if not isinstance(tester, type) or tester.__module__ != module.__name__:
                continue
            new = hasattr(tester, "get_init_dict") and hasattr(tester, "get_dummy_inputs")
            old = hasattr(tester, "prepare_init_args_and_inputs_for_common")
            if not (new or old):
                continue
            if not hasattr(tester, "model_class"):  # a block tester: not a model class
                continue
            try:
                obj = tester("__init__") if issubclass(tester, unittest.TestCase) else tester()
                model_class = obj.model_class
                if not isinstance(model_class, type) or model_class.__name__ in entries:
                    continue
                if new:
                    init, inputs = obj.get_init_dict(), obj.get_dummy_inputs()
                else:
                    init, inputs = obj.prepare_init_args_and_inputs_for_common()
            except Exception as exc:
                skipped[f"{rel}::{tester_name}"] = f"{type(exc).__name__}: {exc}"[:160]
                continue
            entries[model_class.__name__] = {
                "test": f"{rel}::{tester_name}",
                "init": {k: _recipe(v) for k, v in init.items()},
                "inputs": {k: _recipe(v) for k, v in inputs.items()},
            }
    OUT.parent.mkdir(exist_ok=True)
    head = {
        "source": f"huggingface/diffusers@{commit} tests/models",
        "installed_diffusers": diffusers.__version__,
        "not_read": skipped,
    }
    lines = [json.dumps(head, indent=1)[:-2] + ",", ' "models": {']
    body = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(entries.items())]
    lines += [",\n".join(body), " }", "}", ""]
    OUT.write_text("\n".join(lines), encoding="utf-8")
    print(f"{len(entries)} model classes -> {OUT}; {len(skipped)} tester classes not read")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
