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

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from attnres._codec import located
from attnres._vocab import normalize_component, normalize_dtype
from attnres.errors import InvalidArgumentError
from attnres.integrations import _untrusted
from attnres.integrations._plan import DtypeChoice, plan_sites
from attnres.layer import SelectionConfig
from attnres.plan import PlanResult
from attnres.platform import Platform

__all__ = ["DtypeArgs", "parse_dtype_args", "plan_folder"]


@attrs.frozen
class DtypeArgs:
    """``--dtype`` values: one for every component and/or per component."""

    every: str | None
    per: dict[str, str]


def parse_dtype_args(values: Sequence[str]) -> DtypeArgs:
    every: str | None = None
    per: dict[str, str] = {}
    for value in values:
        component, sep, dtype = value.rpartition("=")
        try:
            parsed = normalize_dtype(dtype)
        except ValueError as exc:
            raise InvalidArgumentError(f"--dtype {value}: {exc}") from None
        # issue 20, 18: names normalised as --attention-backend's; a conflict is an error
        if sep:
            if not component.strip():
                raise InvalidArgumentError(f"--dtype {value}: expected COMPONENT=DTYPE or DTYPE")
            name = normalize_component(component)
            if per.get(name, parsed) != parsed:
                raise InvalidArgumentError(
                    f"--dtype: component {name!r} was given two dtypes ({name}={per[name]} and "
                    f"{name}={parsed}); give it once"
                )
            per[name] = parsed
        else:
            if every not in (None, parsed):
                raise InvalidArgumentError(
                    f"--dtype: the dtype for every component was given twice ({every} and "
                    f"{parsed}); give it once, and COMPONENT=DTYPE for a single component"
                )
            every = parsed
    return DtypeArgs(every, per)


def _choose_dtype(
    name: str, folder: Path, config: Mapping[str, Any], args: DtypeArgs
) -> DtypeChoice:
    if normalize_component(name) in args.per:
        return DtypeChoice(args.per[normalize_component(name)], f"--dtype {name}=")
    if args.every is not None:
        return DtypeChoice(args.every, "--dtype")
    # the dtype most weight elements are stored in, from the headers (issue 20)
    dtype, detail = _untrusted.dtype_from_weights(folder)
    if dtype is not None:
        return DtypeChoice(dtype, "weights", detail)
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str):
            try:
                parsed = normalize_dtype(value)
            except ValueError:
                continue  # "auto" and the like: not a dtype to plan for
            if parsed.startswith("float8"):  # storage, as in the weights (issue 20, 16)
                detail = f"config {key} {parsed} is storage, not a compute dtype"
                continue
            return DtypeChoice(parsed, f"config {key}", detail)
    return DtypeChoice("float32", "default float32", detail)


def plan_folder(
    folder: str | os.PathLike[str],
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
    dtypes: DtypeArgs | Mapping[str, str] | None = None,
    component: str | None = None,
    sp: Any = None,
) -> PlanResult:
    """Plan a diffusers pipeline folder or a transformers model folder on meta.

    ``sp`` (issue 35, ``--sp-degree``): an :class:`attnres.machine.AutoLayout`
    whose choice each diffusers denoiser site with head facts is planned under.

    ``dtypes`` maps a component to its compute dtype (``"*"``: every component),
    as ``--dtype`` does; components not named get theirs from their weights'
    headers, their config, or float32 (each component's ``DtypeChoice`` says which).
    ``component`` names the component of a single model folder (default: from its
    config, see :func:`._untrusted.read_model_folder`).
    """
    folder = Path(folder)
    args = dtypes
    if not isinstance(args, DtypeArgs):
        per = {
            normalize_component(k) if k != "*" else k: normalize_dtype(v)
            for k, v in (args or {}).items()
        }
        args = DtypeArgs(per.pop("*", None), per)
    # issue 20: every file through the one reader, every key a name, every config
    # bounded, every build under a budget; a model that cannot be planned is an error
    index = folder / "model_index.json"
    skipped: list[tuple[str, str]] = []
    if os.path.lexists(index):
        if component is not None:
            raise InvalidArgumentError(
                located(
                    str(folder),
                    f"--component {component}",
                    message="it is a pipeline folder, whose model_index.json names its components",
                )
            )
        title, found, skipped = _untrusted.read_pipeline_index(folder, index)
    elif os.path.lexists(folder / "config.json"):
        title, part = _untrusted.read_model_folder(folder, folder / "config.json", component)
        found = [part]
    else:
        raise InvalidArgumentError(
            located(
                str(folder),
                message="neither a diffusers pipeline folder (model_index.json) nor a "
                "transformers or diffusers model folder (config.json)",
            )
        )
    names = [p.name for p in found]
    unknown = sorted(set(args.per) - {normalize_component(n) for n in names})
    if unknown:
        raise InvalidArgumentError(
            located(
                str(folder),
                f"--dtype {unknown[0]}=...",
                message=f"no model component {unknown[0]!r}; its components: {', '.join(names)}",
            )
        )
    models: dict[str, Any] = {}
    choices: dict[str, DtypeChoice] = {}
    for part in found:
        models[part.name] = _untrusted.build_part(part)
        choices[part.name] = _choose_dtype(part.name, part.folder, part.config, args)
    if any(p.library == "diffusers" for p in found):
        from attnres.integrations import diffusers as _diffusers

        try:  # the pipeline model_index.json names: the caller whose code is read
            caller = _diffusers.pipeline_class(title)
        except Exception as exc:  # a lazy module that fails to import the class
            raise _untrusted.fail(
                index,
                "_class_name",
                message=f"the installed diffusers cannot import {title}, the pipeline it "
                f"names: {_untrusted.one_line(exc.__cause__ or exc)}; install what that "
                f"pipeline needs",
            ) from None

        def alone(part: _untrusted.FolderPart) -> object:
            name = part.name
            return _diffusers.plan(
                {name: models[name]}, config, platform, dtypes={name: choices[name]}
            )

        with _untrusted.naming_the_component(found, alone):
            planned = _diffusers.plan(
                models,
                config,
                platform,
                dtypes=choices,
                title=title,
                source=str(folder),
                caller=caller,
                sp=sp,
            )
        return attrs.evolve(planned, skipped=tuple(skipped))
    # a transformers model folder: diffusers need not be installed
    from attnres.integrations import transformers as _transformers

    described = {
        name: (name, choices[name], _transformers.describe_sites(model, name, choices[name].dtype))
        for name, model in models.items()
    }

    def plan_parts(parts: list[_untrusted.FolderPart]) -> PlanResult:
        return plan_sites(
            title=title,
            source=str(folder),
            components=[described[p.name] for p in parts],
            config=config,
            platform=platform,
        )

    with _untrusted.naming_the_component(found, lambda part: plan_parts([part])):
        planned = plan_parts(found)
    return attrs.evolve(planned, skipped=tuple(skipped))
