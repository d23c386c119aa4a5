"""Read the tiny model configs and dummy inputs of diffusers' own model tests into
``tests/data/diffusers_tiny_models.json`` (issue 19, item 5).

Run once against a checkout of huggingface/diffusers (its ``tests/models``):

    python scripts/extract_diffusers_test_configs.py /path/to/diffusers [COMMIT] \
        [--older=/path/to/an/older/diffusers@TAG ...]

(the file was made with the stored commit 58eb52c0, diffusers 0.40.0.dev0, and
``--older`` v0.34.0, the last release with aMUSEd's and I2VGen-XL's pipeline
tests).

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

A model class with no model test there may still be built tiny by diffusers'
pipeline tests (``tests/pipelines/**/test_*.py``, mostly in
``get_dummy_components``). Those modules need tokenizers from the Hub, so they
are not imported: their constructor calls of an exported model class are read
with :mod:`ast` (:func:`pipeline_configs`). A call is taken when every argument
is data written in the test file: a literal, or a name, ``self.`` attribute or
``**`` dict that the file binds to one (a default of the enclosing function, an
assignment before the call, a class attribute or constant property), combined
by arithmetic, tuples, lists, dicts and conditionals, or returned by a
method of the test class that takes no argument. Such an entry records its
source as ``path:line`` and has no inputs (a pipeline test passes none to the
model; ``tests/tiny_models.py`` says where its inputs come from).
"""

from __future__ import annotations

import ast
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


class _NotData(Exception):
    """An argument that is not data written in the test file."""


_OPS: dict[type, Any] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
    ast.Mod: lambda a, b: a % b,
}


def _data(node: ast.AST, env: dict[str, Any]) -> Any:
    """The value of ``node`` when it is data the file writes (names looked up in
    ``env``), else :class:`_NotData`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_data(e, env) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.Dict):
        out: dict[Any, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                out.update(_data(value, env))
            else:
                out[_data(key, env)] = _data(value, env)
        return out
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        key = f"{node.value.id}.{node.attr}"
        if key in env:
            return env[key]
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        return _data(node.func, env)  # a method of the class returning data
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_data(node.left, env), _data(node.right, env))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        value = _data(node.operand, env)
        return -value if isinstance(node.op, ast.USub) else not value
    if isinstance(node, ast.IfExp):
        return _data(node.body if _data(node.test, env) else node.orelse, env)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = _data(node.left, env), _data(node.comparators[0], env)
        ops = {ast.Eq: left == right, ast.NotEq: left != right, ast.Is: left is right}
        if type(node.ops[0]) in ops:
            return ops[type(node.ops[0])]
    raise _NotData(ast.dump(node)[:60])


def _bind(env: dict[str, Any], name: str, node: ast.AST | None) -> None:
    if node is None:
        return
    try:
        env[name] = _data(node, env)
    except _NotData:
        env.pop(name, None)
    except Exception:  # arithmetic on the wrong types: not data
        env.pop(name, None)


def _scopes(tree: ast.Module) -> list[tuple[ast.FunctionDef, dict[str, Any]]]:
    """Each function of a test file with the names it can see as data: module
    constants, its class's attributes and constant properties (``self.X``),
    its parameters' defaults."""
    module: dict[str, Any] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                _bind(module, target.id, stmt.value)
    out: list[tuple[ast.FunctionDef, dict[str, Any]]] = []
    for owner in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
        attrs = dict(module)
        funcs = [n for n in owner.body if isinstance(n, ast.FunctionDef)]
        if isinstance(owner, ast.ClassDef):
            for stmt in owner.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                    target = stmt.targets[0]
                    if isinstance(target, ast.Name):
                        _bind(attrs, f"self.{target.id}", stmt.value)
            for fn in funcs:
                body = [s for s in fn.body if not isinstance(s, ast.Expr)]
                if len(body) == 1 and isinstance(body[0], ast.Return):
                    _bind(attrs, f"self.{fn.name}", body[0].value)
        for fn in funcs:
            env = dict(attrs)
            args = fn.args.args[len(fn.args.args) - len(fn.args.defaults) :]
            for arg, default in zip(args, fn.args.defaults, strict=True):
                _bind(env, arg.arg, default)
            for arg, kw_default in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True):
                _bind(env, arg.arg, kw_default)
            out.append((fn, env))
    return out


def _calls(
    fn: ast.FunctionDef, env: dict[str, Any], wanted: set[str]
) -> list[tuple[int, str, Any]]:
    """The calls in ``fn`` of a class in ``wanted`` whose arguments are all data:
    (line, class, keyword arguments); names bound before a call, in the order
    the function's statements run, are data for it."""
    found: list[tuple[int, str, Any]] = []
    env = dict(env)
    nodes = sorted(
        (n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.Call))),
        key=lambda n: (n.lineno, n.col_offset),
    )
    for node in nodes:
        if isinstance(node, ast.Assign):
            if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                _bind(env, node.targets[0].id, node.value)
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else None
        if name not in wanted or node.args:
            continue
        try:
            kwargs: dict[str, Any] = {}
            for kw in node.keywords:
                if kw.arg is None:
                    kwargs.update(_data(kw.value, env))
                else:
                    kwargs[kw.arg] = _data(kw.value, env)
        except Exception:
            continue
        found.append((node.lineno, name, kwargs))
    return found


def pipeline_configs(checkout: Path, wanted: set[str]) -> dict[str, Any]:
    """The tiny configs diffusers' pipeline tests write for the classes in
    ``wanted``: class -> ``{"test": "path:line", "init": ...}``, the first call
    with data arguments in path and line order."""
    entries: dict[str, Any] = {}
    for path in sorted((checkout / "tests" / "pipelines").rglob("test_*.py")):
        rel = path.relative_to(checkout)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        calls = [c for fn, env in _scopes(tree) for c in _calls(fn, env, wanted)]
        for line, name, kwargs in sorted(calls, key=lambda c: c[0]):
            if name not in entries:
                entries[name] = {
                    "test": f"{rel}:{line}",
                    "init": {k: _recipe(v) for k, v in kwargs.items()},
                }
    return entries


def main(
    checkout: Path, commit: str | None = None, older: tuple[tuple[Path, str], ...] = ()
) -> None:
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
    exported = {
        name
        for name in dir(diffusers)
        if isinstance(cls := getattr(diffusers, name, None), type)
        and issubclass(cls, diffusers.ModelMixin)
        and cls is not diffusers.ModelMixin
    }
    from_pipelines = pipeline_configs(checkout, exported - set(entries))
    for path, tag in older:
        # a class whose pipeline tests diffusers has since removed (aMUSEd's UVit2D,
        # I2VGen-XL's UNet): the last release that still had them, named per entry
        found = pipeline_configs(path, exported - set(entries) - set(from_pipelines))
        for name, entry in found.items():
            from_pipelines[name] = {**entry, "test": f"{tag} {entry['test']}"}
    OUT.parent.mkdir(exist_ok=True)
    head = {
        "source": f"huggingface/diffusers@{commit} tests/models, tests/pipelines"
        + "".join(f"; {tag} tests/pipelines" for _, tag in older),
        "installed_diffusers": diffusers.__version__,
        "not_read": skipped,
    }
    lines = [json.dumps(head, indent=1)[:-2] + ",", ' "models": {']
    body = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(entries.items())]
    lines += [",\n".join(body), " },", ' "from_pipeline_tests": {']
    body = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(from_pipelines.items())]
    lines += [",\n".join(body), " }", "}", ""]
    OUT.write_text("\n".join(lines), encoding="utf-8")
    print(
        f"{len(entries)} model classes from model tests, {len(from_pipelines)} from "
        f"pipeline tests -> {OUT}; {len(skipped)} tester classes not read"
    )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--older=")]
    olders = [a.removeprefix("--older=").rsplit("@", 1) for a in sys.argv[1:] if a not in args]
    main(
        Path(args[0]),
        args[1] if len(args) > 1 else None,
        tuple((Path(path), tag) for path, tag in olders),
    )
