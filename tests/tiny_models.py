"""Tiny CPU builds of the diffusers model classes, and inputs to run them (issue 19, item 5).

Where a model class's tiny config and inputs come from, in order:

1. ``tests/data/diffusers_tiny_models.json``: the ``init`` dict and dummy
   inputs of diffusers' own model test for the class (read by
   ``scripts/extract_diffusers_test_configs.py``; each entry names its test);
   the inputs are rebuilt here from their recipes (shape, dtype, and the
   values where they matter).
2. ``_INPUTS_HERE``: where the installed diffusers takes an input in another
   form than the test the entry came from (the reason is said per entry).

A class with neither cannot be run here; :func:`build` raises
:class:`CannotBuild` with the reason, and the sweep lists it.
"""

from __future__ import annotations

import ast
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parent / "data" / "diffusers_tiny_models.json"


class CannotBuild(Exception):
    """A class this file has no tiny build or no inputs for (the message says why)."""


def _entries() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DATA.read_text(encoding="utf-8"))
    return data["models"]


def _value(recipe: dict[str, Any], gen: torch.Generator) -> Any:
    if "python" in recipe:
        return ast.literal_eval(recipe["python"])
    if "generator" in recipe:
        return torch.Generator().manual_seed(recipe["generator"])
    if "list" in recipe:
        return [_value(r, gen) for r in recipe["list"]]
    if "dict" in recipe:
        return {k: _value(r, gen) for k, r in recipe["dict"].items()}
    if "unsupported" in recipe:
        raise CannotBuild(f"an input of type {recipe['unsupported']} has no recipe")
    dtype = getattr(torch, recipe["dtype"])
    if "value" in recipe:
        return torch.tensor(recipe["value"], dtype=dtype).reshape(recipe["shape"])
    if not dtype.is_floating_point:
        raise CannotBuild(f"an integer input of shape {recipe['shape']} has no values")
    return torch.randn(recipe["shape"], generator=gen).to(dtype)


#: inputs the installed diffusers (0.42.1) takes in another form than the test
#: the entry came from: name -> a function of the inputs built from the recipes
def _chroma_mask(inputs: dict[str, Any]) -> dict[str, Any]:
    # diffusers' test passes no prompt mask; ChromaPipeline does: the prompt's
    # padding mask extended with ones over the image tokens, in the prompt's dtype
    # (pipelines/chroma/pipeline_chroma.py, ``_prepare_attention_mask``)
    prompt = inputs["encoder_hidden_states"]
    image = inputs["hidden_states"].shape[1]
    mask = torch.ones(prompt.shape[0], prompt.shape[1] + image, dtype=prompt.dtype)
    return {**inputs, "attention_mask": mask}


_INPUTS_HERE: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "ChromaTransformer2DModel": _chroma_mask,
}


def padded(inputs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``inputs`` with real padding in every prompt mask (a 2-D 0/1 input whose
    name ends in ``mask``): in the first row, the last quarter of the prompt's
    positions masked out (the prompt comes first: Chroma's mask goes on over the
    image tokens); and the names of the inputs changed."""
    out, changed = dict(inputs), []
    text = inputs.get("encoder_hidden_states")
    prompt = text.shape[1] if isinstance(text, torch.Tensor) and text.dim() == 3 else None
    for key, value in inputs.items():
        if not (key.endswith("mask") and isinstance(value, torch.Tensor) and value.dim() == 2):
            continue
        if not bool(((value == 0) | (value == 1)).all()) or value.shape[1] < 4:
            continue
        value = value.clone()
        end = min(value.shape[1], prompt or value.shape[1])
        value[0, end - end // 4 : end] = 0
        out[key] = value
        changed.append(key)
    return out, changed


def names() -> list[str]:
    """The classes with a tiny config here."""
    return sorted(_entries())


def source(name: str) -> str:
    """The test of diffusers' own that the class's config and inputs come from."""
    return str(_entries()[name]["test"])


def build(name: str) -> tuple[torch.nn.Module, Callable[[], dict[str, Any]]]:
    """The tiny model (eval mode, seeded weights) and a function giving fresh inputs."""
    import diffusers

    entry = _entries().get(name)
    if entry is None:
        raise CannotBuild("no tiny config (diffusers has no model test for it)")
    init = {k: _value(r, torch.Generator()) for k, r in entry["init"].items()}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' own deprecation notes
        model = getattr(diffusers, name)(**init).eval()
    adjust = _INPUTS_HERE.get(name, lambda x: x)

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(0)
        return adjust({k: _value(r, gen) for k, r in entry["inputs"].items()})

    inputs()  # a recipe it cannot rebuild is a CannotBuild now, not at the first run
    return model, inputs


def _video_self_attention(inputs: dict[str, Any]) -> torch.Tensor | None:
    # LTX-2's IC-LoRA mask: (B, T, T) strengths over the video tokens, built by the
    # pipeline's own builder (a reference group, the last quarter, at strength 0.5)
    from diffusers import LTX2InContextPipeline

    states = inputs.get("hidden_states")
    if not isinstance(states, torch.Tensor) or states.dim() != 3:
        return None
    batch, tokens = states.shape[:2]
    mask = LTX2InContextPipeline._build_video_self_attention_mask(
        num_noisy_tokens=tokens - tokens // 4, num_prefix_tokens=tokens - tokens // 4,
        extras_cross_masks=[torch.full((1, tokens // 4), 0.5)], device=states.device,
    )  # fmt: skip
    return mask.expand(batch, -1, -1)


def _keyframes(inputs: dict[str, Any]) -> torch.Tensor | None:
    # LTX-2's per-video-token keyframe marker, (B, T, 1): the first frame's tokens
    states = inputs.get("hidden_states")
    if not isinstance(states, torch.Tensor) or states.dim() != 3:
        return None
    marker = torch.zeros(*states.shape[:2], 1)
    marker[:, : max(1, states.shape[1] // 4)] = 1
    return marker


def _no_perturbation(inputs: dict[str, Any]) -> torch.Tensor | None:
    # LTX-2's STG blend weight per batch row (1: not perturbed), not an attention mask
    states = inputs.get("hidden_states")
    return None if not isinstance(states, torch.Tensor) else torch.ones(states.shape[0], 1, 1)


#: mask arguments whose shape no name tells (the argument -> a builder of it)
_MASK_BUILDERS: dict[str, Callable[[dict[str, Any]], torch.Tensor | None]] = {
    "video_self_attention_mask": _video_self_attention,
    "video_keyframes_mask": _keyframes,
    "perturbation_mask": _no_perturbation,
}


def mask_input(argument: str, inputs: dict[str, Any]) -> torch.Tensor | None:
    """A mask for a forward ``argument`` the test inputs lack (issue 22): a builder
    above, else an all-valid 2-D 0/1 mask over the tokens of the 3-D input it is
    named after (``encoder_attention_mask_2`` -> ``encoder_hidden_states_2``,
    ``encoder_hidden_states_mask`` -> ``encoder_hidden_states``,
    ``attention_mask`` -> ``hidden_states``, or the prompt's ``encoder_hidden_states``
    where ``hidden_states`` are latents, not tokens: the prompt mask UnCLIP's and
    Kandinsky's prior pipelines pass as ``attention_mask``), which :func:`padded`
    then pads; ``None`` where neither tells its shape."""
    builder = _MASK_BUILDERS.get(argument)
    if builder is not None:
        return builder(inputs)
    stem, _, tail = argument.partition("mask")
    stem = stem.removesuffix("_").removesuffix("attention").removesuffix("_")
    named = f"{stem}_hidden_states{tail}" if stem else f"hidden_states{tail}"
    prompt = [] if stem else [f"encoder_hidden_states{tail}"]
    for key in (named, f"{stem}{tail}", *prompt):
        value = inputs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 3:
            return torch.ones(value.shape[0], value.shape[1], dtype=torch.long)
    return None
