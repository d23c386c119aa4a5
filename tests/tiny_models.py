"""Tiny CPU builds of the diffusers model classes, and inputs to run them (issue 19, item 5).

Where a model class's tiny config and inputs come from, in order:

1. ``tests/data/diffusers_tiny_models.json``: the ``init`` dict and dummy
   inputs of diffusers' own model test for the class (read by
   ``scripts/extract_diffusers_test_configs.py``; each entry names its test);
   the inputs are rebuilt here from their recipes (shape, dtype, and the
   values where they matter).
2. ``_INPUTS_HERE``: where the installed diffusers takes an input in another
   form than the test the entry came from (the reason is said per entry).
3. For a class diffusers' model tests do not build, the same file's
   ``from_pipeline_tests``: the constructor call of a pipeline test's
   ``get_dummy_components`` (read with ``ast``; each entry names its file and
   line). A pipeline test passes the model no inputs of its own, so they are
   made here (``_PIPELINE_INPUTS``), from the built model's config, in the
   form the pipeline named per entry passes them.

4. A wrapper of several models (``MultiControlNetModel``, ...) whose model has a
   tiny config: two of them, with the model's inputs given once per model.

A class with none of these cannot be run here; :func:`build` raises
:class:`CannotBuild` with the reason, and the sweep lists it.
"""

from __future__ import annotations

import ast
import inspect
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


def _pipeline_entries() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DATA.read_text(encoding="utf-8"))
    return data.get("from_pipeline_tests", {})


def _r(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen)


_Inputs = Callable[[Any, torch.Generator], dict[str, Any]]


def _unet(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # StableDiffusionPipeline: unet(latents, t, encoder_hidden_states=prompt_embeds)
    cross = cfg.cross_attention_dim
    cross = cross[-1] if isinstance(cross, (list, tuple)) else cross
    return {
        "sample": _r(gen, 1, cfg.in_channels, 16, 16),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": _r(gen, 1, 4, cross),
    }


def _controlnet(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # StableDiffusionControlNetPipeline: the control image at the output size, which
    # the conditioning embedding brings down to the latent's (one halving per block
    # after its first); AnimateDiffSparseControlNetPipeline passes frames (batch,
    # channels, frames, h, w) and a mask of the conditioned frames
    out = _unet(cfg, gen)
    size = 16 * 2 ** (len(cfg.conditioning_embedding_out_channels) - 1)
    if "use_simplified_condition_embedding" in cfg:
        frames = 2
        out["sample"] = _r(gen, 1, cfg.in_channels, frames, 16, 16)
        out["encoder_hidden_states"] = out["encoder_hidden_states"].repeat(frames, 1, 1)
        out["controlnet_cond"] = _r(gen, 1, cfg.conditioning_channels, frames, size, size)
        out["conditioning_mask"] = torch.ones(1, 1, frames, size, size)
        return out
    out["controlnet_cond"] = _r(gen, 1, cfg.conditioning_channels, size, size)
    return out


def _vae(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # a pipeline decodes with vae.decode; forward encodes and decodes a sample:
    # an image (batch, channels, h, w), or a video (batch, channels, frames, h, w)
    # for the video VAEs (frames 1 + the temporal compression)
    channels = cfg.get("in_channels", 3)
    temporal = cfg.get("temporal_compression_ratio")
    if temporal is not None:
        return {"sample": _r(gen, 1, channels, temporal + 1, 32, 32)}
    if "temperal_downsample" in cfg:  # Qwen-Image's (Wan-style) causal video VAE
        return {"sample": _r(gen, 1, 3, 1, 32, 32)}
    size = min(cfg.get("sample_size", 32), 32)
    return {"sample": _r(gen, 1, channels, size, size)}


def _flux_controlnet(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # FluxControlNetPipeline: packed latents and a packed control image, text ids
    image, text = 16, 8
    return {
        "hidden_states": _r(gen, 1, image, cfg.in_channels),
        "controlnet_cond": _r(gen, 1, image, cfg.in_channels),
        "encoder_hidden_states": _r(gen, 1, text, cfg.joint_attention_dim),
        "pooled_projections": _r(gen, 1, cfg.pooled_projection_dim),
        "timestep": torch.tensor([1.0]),
        "img_ids": _r(gen, image, 3),
        "txt_ids": torch.zeros(text, 3),
    }


def _sd3_controlnet(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # StableDiffusion3ControlNetInpaintingPipeline: the control image's latents plus
    # the mask channel (extra_conditioning_channels)
    size = 8
    return {
        "hidden_states": _r(gen, 1, cfg.in_channels, size, size),
        "controlnet_cond": _r(
            gen, 1, cfg.in_channels + cfg.extra_conditioning_channels, size, size
        ),
        "encoder_hidden_states": _r(gen, 1, 6, cfg.joint_attention_dim),
        "pooled_projections": _r(gen, 1, cfg.pooled_projection_dim),
        "timestep": torch.tensor([1.0]),
    }


def _qwen_controlnet(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # QwenImageControlNetPipeline: packed latents (4 x 4 patches of 2 x 2), the
    # prompt and its mask, img_shapes
    text = 8
    return {
        "hidden_states": _r(gen, 1, 16, cfg.in_channels),
        "controlnet_cond": _r(gen, 1, 16, cfg.in_channels),
        "encoder_hidden_states": _r(gen, 1, text, cfg.joint_attention_dim),
        "encoder_hidden_states_mask": torch.ones(1, text, dtype=torch.long),
        "timestep": torch.tensor([1.0]),
        "img_shapes": [(1, 4, 4)],
    }


def _sana_controlnet(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # SanaControlNetPipeline: latents, the control image's latents, the prompt
    size = 8
    return {
        "hidden_states": _r(gen, 1, cfg.in_channels, size, size),
        "encoder_hidden_states": _r(gen, 1, 8, cfg.caption_channels),
        "timestep": torch.tensor([10]),
        "controlnet_cond": _r(gen, 1, cfg.in_channels, size, size),
    }


def _hunyuandit_controlnet(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # HunyuanDiTControlNetPipeline: as HunyuanDiT2DModel's model test, plus the control
    # image's latents; prompts of the lengths the model is configured for
    size, text, text_t5 = 8, cfg.text_len, cfg.text_len_t5
    return {
        "hidden_states": _r(gen, 1, cfg.in_channels, size, size),
        "timestep": torch.tensor([10.0]),
        "controlnet_cond": _r(gen, 1, cfg.in_channels, size, size),
        "encoder_hidden_states": _r(gen, 1, text, cfg.cross_attention_dim),
        "text_embedding_mask": torch.ones(1, text),
        "encoder_hidden_states_t5": _r(gen, 1, text_t5, cfg.cross_attention_dim_t5),
        "text_embedding_mask_t5": torch.ones(1, text_t5),
        "image_meta_size": torch.tensor([[size * 8, size * 8, size * 8, size * 8, 0, 0]]),
        "style": torch.tensor([0]),
    }


def _hunyuan_image(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # HunyuanImagePipeline: latents, both prompts and their masks
    text = 6
    return {
        "hidden_states": _r(gen, 1, cfg.in_channels, 8, 8),
        "timestep": torch.tensor([10.0]),
        "encoder_hidden_states": _r(gen, 1, text, cfg.text_embed_dim),
        "encoder_attention_mask": torch.ones(1, text, dtype=torch.long),
        "encoder_hidden_states_2": _r(gen, 1, text, cfg.text_embed_2_dim),
        "encoder_attention_mask_2": torch.ones(1, text, dtype=torch.long),
    }


def _kandinsky3(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # Kandinsky3Pipeline: unet(latents, t, encoder_hidden_states, encoder_attention_mask)
    text = 4
    return {
        "sample": _r(gen, 1, cfg.in_channels, 16, 16),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": _r(gen, 1, text, cfg.encoder_hid_dim),
        "encoder_attention_mask": torch.ones(1, text, dtype=torch.long),
    }


def _kandinsky5(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # Kandinsky5T2VPipeline: latents (batch, frames, h, w, channels), rope positions
    # as ranges over the latent grid and the prompt
    frames, h, w, text = 1, 4, 4, 4
    return {
        "hidden_states": _r(gen, 1, frames, h, w, cfg.in_visual_dim),
        "encoder_hidden_states": _r(gen, 1, text, cfg.in_text_dim),
        "timestep": torch.tensor([10.0]),
        "pooled_projections": _r(gen, 1, cfg.in_text_dim2),
        "visual_rope_pos": [torch.arange(frames), torch.arange(h // 2), torch.arange(w // 2)],
        "text_rope_pos": torch.arange(text),
    }


def _stable_audio(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # StableAudioPipeline: latents, the text and duration embeddings, and a rotary
    # embedding of half the head size over latents plus the global tokens
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    length = 8
    rotary = get_1d_rotary_pos_embed(
        cfg.attention_head_dim // 2, length + 1, use_real=True, repeat_interleave_real=False
    )
    return {
        "hidden_states": _r(gen, 1, cfg.in_channels, length),
        "timestep": torch.tensor([10.0]),
        "encoder_hidden_states": _r(gen, 1, 4, cfg.cross_attention_input_dim),
        "global_hidden_states": _r(gen, 1, 1, cfg.global_states_input_dim),
        "rotary_embedding": rotary,
    }


def _stable_cascade(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # StableCascadePriorPipeline: prior(sample, timestep_ratio, clip_text_pooled,
    # clip_text, clip_img)
    return {
        "sample": _r(gen, 1, cfg.in_channels, 8, 8),
        "timestep_ratio": torch.tensor([0.5]),
        "clip_text_pooled": _r(gen, 1, 1, cfg.clip_text_pooled_in_channels),
        "clip_text": _r(gen, 1, 4, cfg.clip_text_in_channels),
        "clip_img": _r(gen, 1, 1, cfg.clip_image_in_channels),
    }


def _ace_detokenizer(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # AceStepPipeline: audio_token_detokenizer(quantized) (batch, tokens, hidden size)
    return {"hidden_states": _r(gen, 1, 4, cfg.hidden_size)}


def _ace_tokenizer(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # AceStepAudioTokenizer.tokenize: (batch, patches, pool window, acoustic dim)
    return {"hidden_states": _r(gen, 1, 4, cfg.pool_window_size, cfg.audio_acoustic_hidden_dim)}


def _ace_condition(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # AceStepPipeline: condition_encoder(text, lyric, packed reference audio)
    return {
        "text_hidden_states": _r(gen, 1, 6, cfg.text_hidden_dim),
        "text_attention_mask": torch.ones(1, 6),
        "lyric_hidden_states": _r(gen, 1, 8, cfg.text_hidden_dim),
        "lyric_attention_mask": torch.ones(1, 8),
        "refer_audio_acoustic_hidden_states_packed": _r(gen, 1, 10, cfg.timbre_hidden_dim),
        "refer_audio_order_mask": torch.tensor([0]),
    }


def _uvit2d(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # AmusedPipeline: masked latent token ids (batch, h, w), the prompt, its pooled
    # embedding and 5 micro-conditions (size, crop, aesthetic score)
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (1, 4, 4), generator=gen),
        "encoder_hidden_states": _r(gen, 1, 4, cfg.encoder_hidden_size),
        "pooled_text_emb": _r(gen, 1, cfg.cond_embed_dim),
        "micro_conds": torch.tensor([[32.0, 32.0, 0.0, 0.0, 6.0]]),
    }


def _i2vgen_xl(cfg: Any, gen: torch.Generator) -> dict[str, Any]:
    # I2VGenXLPipeline: latents (batch, channels, frames, h, w), fps, the first
    # frame's latents with the frame-position mask over every frame, its image
    # embedding (one token) and the prompt
    frames, size = 2, 8
    return {
        "sample": _r(gen, 1, cfg.in_channels, frames, size, size),
        "timestep": torch.tensor([10]),
        "fps": torch.tensor([16]),
        "image_latents": _r(gen, 1, cfg.in_channels, frames, size, size),
        "image_embeddings": _r(gen, 1, 1, cfg.cross_attention_dim),
        "encoder_hidden_states": _r(gen, 1, 4, cfg.cross_attention_dim),
    }


#: inputs for the classes built from a pipeline test's config, in the form the
#: pipeline named in each builder passes them
_PIPELINE_INPUTS: dict[str, _Inputs] = {
    "AceStepAudioTokenDetokenizer": _ace_detokenizer,
    "AceStepAudioTokenizer": _ace_tokenizer,
    "AceStepConditionEncoder": _ace_condition,
    "AudioLDM2UNet2DConditionModel": _unet,
    "AutoencoderKLAllegro": _vae,
    "AutoencoderKLFlux2": _vae,
    "AutoencoderKLHunyuanImage": _vae,
    "AutoencoderKLHunyuanVideo15": _vae,
    "AutoencoderKLQwenImage": _vae,
    "ControlNetModel": _controlnet,
    "DreamLiteUNetModel": _unet,
    "FluxControlNetModel": _flux_controlnet,
    "HunyuanDiT2DControlNetModel": _hunyuandit_controlnet,
    "HunyuanImageTransformer2DModel": _hunyuan_image,
    "Kandinsky3UNet": _kandinsky3,
    "Kandinsky5Transformer3DModel": _kandinsky5,
    "QwenImageControlNetModel": _qwen_controlnet,
    "SD3ControlNetModel": _sd3_controlnet,
    "SanaControlNetModel": _sana_controlnet,
    "SparseControlNetModel": _controlnet,
    "StableAudioDiTModel": _stable_audio,
    "StableCascadeUNet": _stable_cascade,
    "I2VGenXLUNet": _i2vgen_xl,
    "UVit2DModel": _uvit2d,
}


def input_names(name: str) -> set[str]:
    """The names of the inputs the class is run with (a pipeline test's class:
    built to make them)."""
    entry = _entries().get(name)
    if entry is not None:
        return set(entry["inputs"])
    return set(build(name)[1]())


def _child(name: str) -> str | None:
    """The model a wrapper of several (``MultiControlNetModel``, ...) holds, where
    that model has a tiny config here: the class it is named after."""
    import diffusers

    child = name.replace("Multi", "", 1)
    if "Multi" not in name or not hasattr(diffusers, child):
        return None
    return child if child in {*_entries(), *_pipeline_entries()} else None


def names() -> list[str]:
    """The classes with a tiny config here (from a model test or a pipeline test),
    and the wrappers of two of such a model."""
    import diffusers

    own = {*_entries(), *_pipeline_entries()}
    wrappers = {n for n in dir(diffusers) if "Multi" in n and _child(n) is not None}
    return sorted(own | wrappers)


def source(name: str) -> str:
    """The test of diffusers' own that the class's config and inputs come from."""
    child = _child(name)
    if child is not None:
        return f"two {child}s: {source(child)}"
    entry = _entries().get(name) or _pipeline_entries()[name]
    return str(entry["test"])


def _wrapped(name: str, child: str) -> tuple[torch.nn.Module, Callable[[], dict[str, Any]]]:
    # a wrapper takes the child's inputs with one control image, scale (and Flux's
    # mode: 0 for a ControlNet that is not a union) per child, as its pipelines pass
    # them (StableDiffusionControlNetPipeline with a list of ControlNets)
    import diffusers

    first, inputs = build(child)
    second, _ = build(child)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(diffusers, name)([first, second]).eval()
    takes = inspect.signature(model.forward).parameters

    def wrapped() -> dict[str, Any]:
        out = inputs()
        out["controlnet_cond"] = [out["controlnet_cond"]] * 2
        out["conditioning_scale"] = [1.0, 1.0]
        if "controlnet_mode" in takes:
            out["controlnet_mode"] = [torch.zeros(1, dtype=torch.long)] * 2
        return out

    wrapped()
    return model, wrapped


def build_model(name: str) -> torch.nn.Module:
    """The tiny model of ``name`` (eval mode, seeded weights), from its recorded config."""
    import diffusers

    if _child(name) is not None:
        return build(name)[0]

    entry = _entries().get(name) or _pipeline_entries()[name]
    init = {k: _value(r, torch.Generator()) for k, r in entry["init"].items()}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' own deprecation notes
        return getattr(diffusers, name)(**init).eval()


def build(name: str) -> tuple[torch.nn.Module, Callable[[], dict[str, Any]]]:
    """The tiny model (eval mode, seeded weights) and a function giving fresh inputs."""
    child = _child(name)
    if child is not None:
        return _wrapped(name, child)
    entry = _entries().get(name) or _pipeline_entries().get(name)
    if entry is None:
        raise CannotBuild("no tiny config (diffusers has no model or pipeline test for it)")
    model = build_model(name)
    if "inputs" not in entry:  # a pipeline test's config: inputs made here
        make = _PIPELINE_INPUTS.get(name)
        if make is None:
            raise CannotBuild(f"no inputs for it here (its config: {entry['test']})")

        def inputs() -> dict[str, Any]:
            return make(model.config, torch.Generator().manual_seed(0))

        inputs()
        return model, inputs
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
