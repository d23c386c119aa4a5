"""What ``attnres plan DIR`` does with a folder it did not write: untrusted work.

A model folder is input: its ``model_index.json`` keys, its configs and its
safetensors headers are read through the one reader (:mod:`attnres._files`,
bounded, regular files only), checked here, and only then handed to diffusers
or transformers. Building a third-party model from a config is untrusted work:

1. every component key is a name, never a path (:func:`check_component_key`);
2. every value of a config is bounded (:func:`check_config`): nesting, list
   lengths, string lengths, integers (:data:`MAX_CONFIG_INT`), layer counts
   (:data:`MAX_CONFIG_LAYERS`), head counts and head sizes -- the message names
   the key, the value and the bound;
3. the build runs under a budget (:func:`build_part`): at most
   :data:`MAX_BUILD_TORCH_CALLS` torch calls, :data:`MAX_BUILD_SECONDS` seconds
   and :data:`MAX_BUILD_MEMORY_BYTES` of added peak memory, checked by a torch
   function mode on every torch call of the build (on the meta device). A
   third-party loop that makes no torch call is not seen by it; every model
   class builds its layers with torch calls;
4. whatever the build raises becomes attnres's own error
   (:class:`FolderBuildError`, a ``ValueError``) naming the component, the
   class and the file, in one line (C++ stack frames dropped).

Every error here is in the one format of every loader (:func:`_fail`, issue 21):
``FILE: WHERE: MESSAGE``, as a trace names its JSON path and a pipeline file its
component and layer.

The dtype a component's weights are stored in is read from the safetensors
headers of the files ``from_pretrained`` would load (:func:`dtype_from_weights`):
the default files, not the ``*.fp16.safetensors`` variants beside them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as metadata
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

from attrs import define

from attnres._codec import is_int, is_str_list, located
from attnres._files import read_json, read_safetensors_header
from attnres._torch_floor import MIN_TORCH, installed_torch
from attnres.errors import FolderBuildError
from attnres.integrations._plan import SUPPORTED_VERSIONS
from attnres.layer import MAX_HEAD_SIZE

__all__ = [
    "MAX_BUILD_MEMORY_BYTES",
    "MAX_BUILD_SECONDS",
    "MAX_BUILD_TORCH_CALLS",
    "MAX_CONFIG_HEADS",
    "MAX_CONFIG_INT",
    "MAX_CONFIG_LAYERS",
    "MAX_WEIGHT_FILES",
    "FolderBuildError",
    "build_part",
    "check_component_key",
    "check_config",
    "dtype_from_weights",
    "fail",
    "one_line",
]

#: The most layers (blocks) one config key may ask for; real models have < 200.
MAX_CONFIG_LAYERS: Final = 1024
#: The most attention heads one config key may ask for; real models have < 256.
MAX_CONFIG_HEADS: Final = 1024
#: The largest integer any config value may hold (sizes, vocabularies, positions).
MAX_CONFIG_INT: Final = 2**31 - 1
#: The longest list and string in a config.
MAX_CONFIG_ITEMS: Final = 4096
#: The torch calls building one component may make (FLUX.1-dev's transformer: ~6k).
MAX_BUILD_TORCH_CALLS: Final = 500_000
#: The seconds building one component may take (FLUX.1-dev's transformer: ~1.5 s).
MAX_BUILD_SECONDS: Final = 60.0
#: The memory building one component may add to the process's peak (FLUX.1-dev's
#: transformer on meta: well under 100 MiB).
MAX_BUILD_MEMORY_BYTES: Final = 4 << 30
#: The most safetensors files whose headers are read for one component.
MAX_WEIGHT_FILES: Final = 256

_T = TypeVar("_T")

# \Z, not $: "$" also matches before a final newline ("vae\n" passed; issue 32 item 16)
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\Z")
_LAYER_KEY = re.compile(r"(^|_)(layers|blocks|depth)(\Z|_)|layers_per_block|^n_layer")
_HEAD_KEY = re.compile(r"(^|_)heads?(\Z|_)|^n_head")
_HEAD_SIZE_KEY = re.compile(r"^(head_dim|d_kv|attention_head_dim|kv_channels|head_size)\Z")
#: the bound of a config key (lower-cased): the first pattern it matches, (pattern,
#: low, high, what)
_BOUNDS: Final = (
    (_HEAD_SIZE_KEY, 1, MAX_HEAD_SIZE, "a head size (attnres.layer.MAX_HEAD_SIZE)"),
    (_HEAD_KEY, 1, MAX_CONFIG_HEADS, "heads (MAX_CONFIG_HEADS)"),
    (_LAYER_KEY, 0, MAX_CONFIG_LAYERS, "layers (MAX_CONFIG_LAYERS)"),
)


def fail(source: object, *where: str, message: str) -> FolderBuildError:
    """The folder loader's error: ``source`` (the file, the folder, or the flag
    that names the component), where in it, and the message, in the one format
    of every loader (:func:`attnres._codec.located`)."""
    return FolderBuildError(
        located(str(source), *where, message=message),
        path=str(source),
        where=": ".join(where) or None,
    )


def _preview(text: str, limit: int) -> str:
    """``text``, cut to at most ``limit`` characters (ending ``...`` where cut)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, without C++ stack frames, at most ``limit``."""
    # torch appends "Exception raised from ... (most recent call first):" and frames
    text = re.split(r"\n|Exception raised from ", str(exc).strip(), maxsplit=1)[0].strip()
    return f"{type(exc).__name__}: {_preview(text, limit)}" if text else type(exc).__name__


def _read(read: Callable[[Path], _T], path: Path, cannot: str, invalid: str) -> _T:
    """``read(path)``, one of the one reader's functions: its refusal of the file
    (:class:`OSError`) says ``cannot``, of its content (:class:`ValueError`) ``invalid``."""
    try:
        return read(path)
    except OSError as exc:
        raise fail(path, message=f"{cannot}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise fail(path, message=f"{invalid}: {exc}") from None


def check_component_key(key: object, where: str) -> str:
    """``key`` if it names a component: a name, never a path (no ``/``, no ``..``);
    ``where`` is the file that names it, or the flag (``--component``)."""
    if not isinstance(key, str) or not _KEY_RE.match(key) or key.strip(".") == "":
        shown = _preview(repr(key), 60)
        raise fail(
            where,
            message=f"{shown} is not a component name (letters, digits, '_', '-', '.', at "
            f"most 100 characters, not starting with '.' or '-'); a component key names a "
            f"sub-folder of the pipeline folder, never a path",
        )
    return key


#: how :func:`check_config` names a value too long (any other: a list)
_SIZED: Final = ((str, "a string of {} characters"), (dict, "an object of {} keys"))


def check_config(config: Mapping[str, Any], where: str) -> None:
    """Refuse a config value a model build must not be asked for (see the module doc);
    ``config`` is :func:`read_config`'s, so NaN, infinities and nesting are refused there."""
    stack: list[tuple[str, Any]] = list(config.items())
    while stack:
        path, value = stack.pop()
        message = None
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            key = path.rsplit(".", 1)[-1].split("[", 1)[0].lower()
            bound = next((b for b in _BOUNDS if b[0].search(key)), None)
            if abs(value) > MAX_CONFIG_INT:
                message = (
                    f"{value} is out of bounds (a config value is at most "
                    f"{MAX_CONFIG_INT}, attnres.integrations._untrusted.MAX_CONFIG_INT)"
                )
            elif bound is not None and not bound[1] <= value <= bound[2]:
                _, low, high, what = bound
                message = f"{value} is out of bounds for {what}: attnres plans {low} to {high}"
        elif isinstance(value, str | list | tuple | dict) and len(value) > MAX_CONFIG_ITEMS:
            what = next((w for t, w in _SIZED if isinstance(value, t)), "a list of {} items")
            message = f"{what.format(len(value))} (at most {MAX_CONFIG_ITEMS})"
        if message is not None:
            raise fail(where, path, message=message)
        if isinstance(value, list | tuple):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}", v) for k, v in value.items())


class _BudgetExceeded(Exception):
    pass


def _peak_rss() -> int:
    """The process's peak resident memory in bytes (0 where it cannot be read)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _budget_mode(deadline: float) -> Any:
    from torch.overrides import TorchFunctionMode

    memory_limit = _peak_rss() + MAX_BUILD_MEMORY_BYTES

    class Budget(TorchFunctionMode):
        calls = 0

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            Budget.calls += 1
            over = None
            if Budget.calls > MAX_BUILD_TORCH_CALLS:
                over = f"{MAX_BUILD_TORCH_CALLS} torch calls (MAX_BUILD_TORCH_CALLS)"
            elif Budget.calls % 256 == 0 and time.monotonic() > deadline:
                over = f"{MAX_BUILD_SECONDS:g} s (MAX_BUILD_SECONDS)"
            elif Budget.calls % 256 == 0 and _peak_rss() > memory_limit:
                over = f"{MAX_BUILD_MEMORY_BYTES >> 30} GiB of memory (MAX_BUILD_MEMORY_BYTES)"
            if over is not None:
                raise _BudgetExceeded(f"over the budget of {over} for building one component")
            return func(*args, **(kwargs or {}))

    return Budget()


# =============================================================================
# The dtype the weights are stored in
# =============================================================================

_SAFETENSORS_DTYPES: Final[Mapping[str, str | None]] = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": None,  # storage only: layerwise casting computes in another dtype
    "F8_E5M2": None,
}


def _is_variant(path: Path) -> bool:
    """``model.fp16.safetensors``, ``model.fp16-00001-of-00002.safetensors``: a
    variant ``from_pretrained`` loads only when asked for it (``variant="fp16"``)."""
    return "." in path.name[: -len(".safetensors")]


def dtype_from_weights(folder: Path) -> tuple[str | None, str | None]:
    """The dtype most weight elements are stored in, from safetensors headers.

    Reads the files ``from_pretrained`` loads by default (variant files such as
    ``*.fp16.safetensors`` only when there is nothing else, and the detail says
    so). Returns ``(dtype, detail)``; ``dtype`` is None when no header names a
    compute dtype (``detail`` then says why, or is None when there are no files).
    """
    try:
        every = sorted(folder.glob("*.safetensors"))
    except OSError as exc:
        raise fail(folder, message=f"cannot list its files: {exc.strerror or exc}") from None
    if not every:
        return None, None
    default = [p for p in every if not _is_variant(p)]
    variants = len(every) - len(default)
    files = default or every
    notes = []
    if default and variants:
        notes.append(f"{variants} variant file(s) passed over, as from_pretrained does")
    if not default:
        notes.append("only variant files (from_pretrained loads them only with variant=)")
    if len(files) > MAX_WEIGHT_FILES:
        notes.append(f"the first {MAX_WEIGHT_FILES} of {len(files)} files read")
        files = files[:MAX_WEIGHT_FILES]
    counts: dict[str, int] = {}
    storage_only = 0
    for path in files:
        header = _read(read_safetensors_header, path, "cannot read it", "not a safetensors file")
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            tensor = f"tensor {key[:80]!r}"
            if not isinstance(entry, dict):
                raise fail(path, tensor, message="expected an object with dtype and shape")
            shape = entry.get("shape")
            if not isinstance(shape, list) or not all(
                is_int(d) and 0 <= d <= MAX_CONFIG_INT for d in shape
            ):
                shown = _preview(repr(shape), 80)
                message = f"shape must be a list of non-negative integers, got {shown}"
                raise fail(path, tensor, message=message)
            name = _SAFETENSORS_DTYPES.get(str(entry.get("dtype")), "")
            if name is None:
                storage_only += math.prod(shape)
            elif name:
                counts[name] = counts.get(name, 0) + math.prod(shape)
    if not counts:
        why = (
            "weights are stored in float8, which is not a compute dtype"
            if storage_only
            else "no floating-point tensors in the headers"
        )
        return None, "; ".join([why, *notes])
    best = max(sorted(counts), key=lambda k: counts[k])
    return best, "; ".join([f"{len(files)} safetensors file(s)", *notes])


# =============================================================================
# The folder: which components are models, and their configs
# =============================================================================

_CLASS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,99}\Z")
_LIBRARIES: Final = ("diffusers", "transformers")


def read_config(path: Path, what: str = "config file") -> dict[str, Any]:
    """A JSON object from ``path`` through the one reader; a :class:`FolderBuildError`
    naming the file says why it cannot be one."""
    doc = _read(
        lambda p: read_json(p, what=what), path, f"cannot read the {what}", f"not a valid {what}"
    )
    if not isinstance(doc, dict):
        raise fail(
            path, message=f"not a valid {what}: expected a JSON object, got a {type(doc).__name__}"
        )
    return doc


def _versions(library: str) -> str:
    """What is installed of ``library`` and torch against what attnres supports, and
    what to do: the tail of the error for a governed library that does not import."""
    try:
        found = f"{library} {metadata.version(library)}"
    except metadata.PackageNotFoundError:
        found = f"no {library}"
    low, high = SUPPORTED_VERSIONS[library]
    return (
        f"installed: {found}, torch {installed_torch() or 'none'}; attnres[{library}] "
        f"supports {library}>={low},<{high} with torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}: "
        f"install them with: pip install 'attnres[{library}]'"
    )


def model_class(library: str, class_name: object, component: str, where: str) -> type | None:
    """The model class ``library.class_name``, or ``None`` when it is exported but
    is not a model (a tokenizer, a scheduler, a feature extractor)."""
    named = f"component {component!r}"
    if not isinstance(class_name, str) or not _CLASS_RE.match(class_name):
        raise fail(where, named, message=f"{str(class_name)[:80]!r} is not a class name")
    try:
        module = importlib.import_module(library)
    except Exception as exc:  # absent, or broken at import (diffusers 0.42 on torch 2.5)
        raise fail(
            where,
            message=f"component {component!r} is a {library} {class_name}; planning it needs "
            f"{library}, which does not import here ({one_line(exc)}); {_versions(library)}",
        ) from None
    base = module.ModelMixin if library == "diffusers" else module.PreTrainedModel
    try:
        cls = getattr(module, class_name, None)
    except Exception as exc:  # a lazy module that fails to import the class
        raise fail(
            where, named, message=f"{library}.{class_name} does not import: {one_line(exc)}"
        ) from None
    if not isinstance(cls, type):
        raise fail(where, named, message=f"{library} has no class {class_name!r}")
    if not issubclass(cls, base):
        return None
    if cls is base or cls.__name__ in ("ModelMixin", "PreTrainedModel"):
        raise fail(
            where,
            named,
            message=f"{class_name} is the base class of every {library} model, not a model; "
            f"name the model's own class",
        )
    return cls


@define(eq=False)
class FolderPart:
    """One model component of a folder: its name, library, class, folder and config."""

    name: str
    library: str
    cls: type
    folder: Path
    config: dict[str, Any]
    where: str


def read_pipeline_index(
    folder: Path, index: Path
) -> tuple[str, list[FolderPart], list[tuple[str, str]]]:
    """A diffusers pipeline folder: its title, model components and what is skipped."""
    doc = read_config(index, "model_index.json")
    title = doc.get("_class_name")
    title = title if isinstance(title, str) and title else folder.resolve().name
    parts: list[FolderPart] = []
    skipped: list[tuple[str, str]] = []
    for key, value in doc.items():
        if isinstance(key, str) and key.startswith("_"):
            continue  # _class_name, _diffusers_version, _name_or_path: not components
        name = check_component_key(key, str(index))
        if value == [None, None]:
            skipped.append((name, "absent: null in model_index.json"))
            continue
        if not (is_str_list(value) and len(value) == 2):
            raise fail(
                index,
                repr(name),
                message="expected [LIBRARY, CLASS] (two strings, or [null, null] for an "
                f"absent component), got {_preview(json.dumps(value, default=str), 80)}",
            )
        library, class_name = value
        if library not in _LIBRARIES:
            why = "attnres plans diffusers and transformers models only"
            skipped.append((name, f"{library}.{class_name}: {why}"))
            continue
        cls = model_class(library, class_name, name, str(index))
        if cls is None:
            skipped.append((name, f"{class_name}, not a model"))
            continue
        sub = folder / name
        config = read_config(sub / "config.json")
        parts.append(FolderPart(name, library, cls, sub, config, str(sub / "config.json")))
    if not parts:
        raise fail(
            index,
            message="no model component to plan (a pipeline lists its models as "
            '"name": ["diffusers" or "transformers", "ClassName"])'
            + (f"; skipped: {', '.join(n for n, _ in skipped)}" if skipped else ""),
        )
    return title, parts, skipped


def read_model_folder(
    folder: Path, config_path: Path, component: str | None
) -> tuple[str, FolderPart]:
    """A single model folder (a ``config.json``): a transformers model naming its
    ``architectures``, or a diffusers model naming its ``_class_name``.

    The component is ``component`` when given; else, for a transformers model,
    what its class reads (``main_input_name``: token ids make a ``text_encoder``,
    pixels an ``image_encoder``), else the config's ``model_type``; for a
    diffusers model, the folder's own name. Never a folder name that is not a
    component name (a commit hash of the Hugging Face cache, ``.``).
    """
    config = read_config(config_path)
    where = str(config_path)
    if isinstance(config.get("_class_name"), str) and "_diffusers_version" in config:
        library, class_name = "diffusers", config["_class_name"]
    else:
        archs = config.get("architectures")
        if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
            raise fail(
                where,
                message="neither a transformers model config (no 'architectures' entry "
                "naming the model class) nor a diffusers model config (no '_class_name' "
                "and '_diffusers_version')",
            )
        library, class_name = "transformers", archs[0]
    label = component or "the model"
    cls = model_class(library, class_name, label, where)
    if cls is None:
        raise fail(where, message=f"{library}.{class_name} is not a model class")
    if component is None:
        component = _component_from(library, cls, config, folder, where)
    name = check_component_key(component, "--component")
    return class_name, FolderPart(name, library, cls, folder, config, where)


def _component_from(
    library: str, cls: type, config: Mapping[str, Any], folder: Path, where: str
) -> str:
    if library == "transformers":
        kind = {"input_ids": "text_encoder", "pixel_values": "image_encoder"}.get(
            str(getattr(cls, "main_input_name", ""))
        )
        if kind is not None:
            return kind
        model_type = config.get("model_type")
        if isinstance(model_type, str) and _KEY_RE.match(model_type):
            return model_type
    else:
        name = folder.resolve().name
        if _KEY_RE.match(name) and not re.fullmatch(r"[0-9a-f]{16,}", name):
            return name
    raise fail(
        where, message="cannot tell which component this model is; name it with --component NAME"
    )


def build_part(part: FolderPart) -> Any:
    """The model of ``part`` on the meta device, in eval mode, from its bounded
    config, under the budget; what the build raises becomes a
    :class:`FolderBuildError` naming the component, the class and the file."""
    check_config(part.config, part.where)
    import torch

    cls: Any = part.cls
    config = dict(part.config)
    deadline = time.monotonic() + MAX_BUILD_SECONDS
    # a build stopped half-way (its error, the budget) may skip the third-party
    # code that restores torch's global state: grad mode and the default dtype
    # are put back whatever happens (found by the budget test: grad stayed off)
    grad, default_dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    try:
        with torch.device("meta"), _budget_mode(deadline):
            if part.library == "diffusers":
                return cls.from_config(config).eval()
            # attnres decides the attention, and the dtype is chosen apart (plan_folder):
            # neither the config's attention nor its dtype ("auto", float8 storage) is built
            for key in ("_attn_implementation", "attn_implementation", "torch_dtype", "dtype"):
                config.pop(key, None)
            return cls._from_config(cls.config_class.from_dict(config)).eval()
    except (KeyboardInterrupt, SystemExit, GeneratorExit, FolderBuildError):
        raise
    except BaseException as exc:  # third-party code on hostile input: anything at all
        raise fail(
            part.where,
            message=f"cannot build {cls.__name__} for component {part.name!r} from this "
            f"config: {one_line(exc)}",
        ) from None
    finally:
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(default_dtype)


@contextlib.contextmanager
def naming_the_component(
    parts: list[FolderPart], plan_one: Callable[[FolderPart], object]
) -> Iterator[None]:
    """A ``ValueError`` raised while the built models are planned (a head size over
    the bound, computed from the config) names the component and its file: the
    culprit is found by planning each component alone, on the error path only."""
    try:
        yield
    except FolderBuildError:
        raise
    except ValueError as exc:
        for part in parts:
            try:
                plan_one(part)
            except ValueError:
                raise fail(
                    part.where, f"component {part.name!r} ({part.cls.__name__})", message=str(exc)
                ) from None
        raise
