"""Build any transformers model type tiny on the CPU and run it (issue 19, item 5).

Shared by ``tests/test_integrations_runtime_hf.py``: the generic shrink of a
config to the sizes of transformers' ``CausalLMModelTester``, the inputs made
from a model's forward signature, and the flattening of its outputs.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from typing import Any

import torch
from transformers import PretrainedConfig

#: CausalLMModelTester's sizes (huggingface/transformers, tests/causal_lm_tester.py),
#: with 4 heads over 2 kv heads of size 8 (32 / 4), as its multi-head testers use
SIZES: dict[str, int] = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 37,
    "vocab_size": 99,
    "max_position_embeddings": 512,
    "moe_intermediate_size": 12,  # its expert width
    "latent_part": 4,
}
#: the same sizes under the other names configs give them (an int key matching
#: a pattern takes the size named); ``attribute_map`` aliases are set through the
#: canonical name above
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"(encoder|decoder|text|vision|audio)_attention_heads|n_heads?|num_heads"),
        "num_attention_heads",
    ),
    (re.compile(r"(.+_)?(key_value_heads|kv_heads)"), "num_key_value_heads"),
    # multi-head latent attention: a query/key head is its nope and rope parts
    (re.compile(r"qk_(nope|rope)_head_dim"), "latent_part"),
    (re.compile(r"(.+_)?head_dim|rotary_dim|rope_dim"), "head_dim"),
    (re.compile(r"(.*_)?(moe|expert)(_.*)?_intermediate_size"), "moe_intermediate_size"),
    (
        re.compile(r"(encoder|decoder)_ffn_dim|ffn_dim|(.+_)?intermediate_size"),
        "intermediate_size",
    ),
    (re.compile(r"d_model|n_embd|hidden_dim|embed_dim|hidden_size_.+"), "hidden_size"),
    (re.compile(r"vocab_size_.+"), "vocab_size"),
)
#: a token id the config names is kept out of the prompt (an image token with
#: no image is an error) and inside the vocabulary
_TOKEN = re.compile(r".*_(token_id|token_index|index_id)")

SEQ = 8  # prompt length; the second row's last two positions are padding
#: the largest image side a tiny model takes: a larger one (Swin's 384, SAM 3's
#: 1008) is cut to it, as the tester sizes cut widths. 256 keeps a patch grid
#: that a 4x pixel shuffle divides (16-pixel patches: Granite Docling's vision
#: tower), which ViT's 224 does not
IMAGE = 256
#: a per-stage list of stack depths (Swin's ``depths``): one layer a stage
_DEPTHS = re.compile(r"(.+_)?depths")
#: a hybrid stack that places a kind of layer every ``period`` from ``offset``
#: (Jamba, Zamba): cut to the shortest stack holding every kind
_PERIOD = re.compile(r"(.+)_period")


def _sub_configs(config: PretrainedConfig) -> list[PretrainedConfig]:
    out = [config]
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            out.extend(_sub_configs(value))
    return out


def token_ids(config: PretrainedConfig) -> set[int]:
    """Every token id the config (and its sub-configs) names."""
    ids: set[int] = set()
    for node in _sub_configs(config):
        for key, value in vars(node).items():
            if _TOKEN.fullmatch(key) and isinstance(value, int) and not isinstance(value, bool):
                ids.add(value)
            elif _TOKEN.fullmatch(key) and isinstance(value, (list, tuple)):
                ids |= {v for v in value if isinstance(v, int)}
    return ids


def _has(config: PretrainedConfig, key: str) -> bool:
    return key in vars(config) or key in getattr(type(config), "attribute_map", {})


def shrink(config: PretrainedConfig, kv_heads: int = SIZES["num_key_value_heads"]) -> None:
    """Set CausalLMModelTester's sizes wherever ``config`` or a sub-config has the
    key (an int: a list such as per-stage sizes is kept), and a vocabulary that
    holds every token id the config names."""
    sizes = {**SIZES, "num_key_value_heads": kv_heads}
    if any(
        re.search("expert", k) and v for node in _sub_configs(config) for k, v in vars(node).items()
    ):
        # a model with experts: every width is the tester's expert width (a
        # grouped_mm over 37 floats is not 16-byte aligned: torch refuses it on
        # the CPU)
        sizes["intermediate_size"] = sizes["moe_intermediate_size"]
    for node in _sub_configs(config):
        for key, size in sizes.items():
            if _has(node, key):
                value = getattr(node, key, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    _set(node, key, size)
        for key, value in list(vars(node).items()):
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            for pattern, size in _PATTERNS:
                if pattern.fullmatch(key):
                    _set(node, key, sizes[size])
                    break
        _rope_sections(node)
        _stages(node)
        if _has(node, "vocab_size") and isinstance(getattr(node, "vocab_size", None), int):
            named = [i for i in token_ids(node) if i >= 0]
            node.vocab_size = max([SIZES["vocab_size"], *(i + 1 for i in named)])


def _stages(node: PretrainedConfig) -> None:
    """One layer a stage, images no larger than :data:`IMAGE`, and a periodic
    hybrid stack cut to the layers that hold each of its kinds once."""
    values = vars(node)
    for key, value in list(values.items()):
        if (
            _DEPTHS.fullmatch(key)
            and isinstance(value, list)
            and all(isinstance(v, int) and v > 0 for v in value)
        ):
            _set(node, key, [1] * len(value))
        elif key == "image_size" and isinstance(value, int) and value > IMAGE:
            _set(node, key, IMAGE)
        elif (
            key == "image_size"
            and isinstance(value, (list, tuple))
            and all(isinstance(v, int) for v in value)
            and max(value, default=0) > IMAGE
        ):
            _set(node, key, type(value)(min(v, IMAGE) for v in value))
    ends = [
        values[f"{m[1]}_offset"] + 1
        for key in values
        if (m := _PERIOD.fullmatch(key)) and isinstance(values.get(f"{m[1]}_offset"), int)
    ]
    count = values.get("num_hidden_layers")
    if ends and isinstance(count, int) and max(ends) < count:
        _set(node, "num_hidden_layers", max(2, *ends))


def _set(node: PretrainedConfig, key: str, value: Any) -> None:
    """Set ``key``, unless the config refuses it (a per-layer attribute that
    cannot be set for every layer at once is left as it is)."""
    with contextlib.suppress(Exception):
        setattr(node, key, value)


def _rope_sections(node: PretrainedConfig) -> None:
    """Multimodal rope splits each head's rotary half into sections (``mrope_section``,
    summing to half the head size): spread the shrunk half over as many sections."""
    half = getattr(node, "head_dim", None)
    if not isinstance(half, int) and isinstance(getattr(node, "hidden_size", None), int):
        heads = getattr(node, "num_attention_heads", None)
        half = node.hidden_size // heads if isinstance(heads, int) and heads else None
    for params in (vars(node).get("rope_parameters"), vars(node).get("rope_scaling")):
        if not isinstance(params, dict) or not isinstance(half, int):
            continue
        for where in (params, *(v for v in params.values() if isinstance(v, dict))):
            sections = where.get("mrope_section")
            if isinstance(sections, list) and 0 < len(sections) <= half // 2:
                spread = [1] * len(sections)
                spread[0] += half // 2 - len(sections)
                where["mrope_section"] = spread


def _image_size(config: PretrainedConfig) -> tuple[int, int, int] | None:
    """(channels, height, width) of the images a config takes, if it says."""
    for node in _sub_configs(config):
        size = vars(node).get("image_size")
        if isinstance(size, int):
            size = (size, size)
        if (
            isinstance(size, (list, tuple))
            and len(size) == 2
            and all(isinstance(s, int) for s in size)
        ):
            channels = vars(node).get("num_channels", 3)
            return int(channels), int(size[0]), int(size[1])
    return None


def candidates(model: Any) -> list[tuple[dict[str, Any], torch.Tensor | None]]:
    """Inputs from ``model.forward``'s signature, each with the padding mask whose
    valid positions the first output's are (``None``: no padding); the first
    that runs is used.

    Text: ``input_ids`` (ids the config names as special kept out) with an
    ``attention_mask`` whose second row ends in two padded positions, and
    ``decoder_input_ids`` where the forward takes them; then the same with
    ``pixel_values`` of the config's image size (a model of both); images
    alone; audio: ``input_values`` as raw samples, or ``input_features`` /
    ``input_values`` as a spectrogram of the config's mel bins (either layout)."""
    params = inspect.signature(model.forward).parameters
    config = model.config
    gen = torch.Generator().manual_seed(3)
    special = token_ids(config)
    pool = [i for i in range(3, SIZES["vocab_size"]) if i not in special]
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -2:] = 0
    found: list[tuple[dict[str, Any], torch.Tensor | None]] = []
    image = _image_size(config)
    pixels = None if image is None else torch.randn(2, *image, generator=gen)
    if "input_ids" in params:
        ids = torch.tensor(pool)[torch.randint(0, len(pool), (2, SEQ), generator=gen)]
        text: dict[str, Any] = {"input_ids": ids}
        valid: torch.Tensor | None = None
        if "attention_mask" in params:
            text["attention_mask"] = mask
            valid = mask.bool()
        if "decoder_input_ids" in params:
            text["decoder_input_ids"] = ids[:, :4]
            valid = None  # the first output is the decoder's (unpadded)
        found.append((text, valid))
        if "pixel_values" in params and pixels is not None:
            found.append(({**text, "pixel_values": pixels}, valid))
    if "pixel_values" in params and pixels is not None:
        found.append(({"pixel_values": pixels}, None))
    audio = mask.repeat_interleave(128, dim=1)  # 1024 samples, the second row's last 256 padded
    if "input_values" in params:
        raw: dict[str, Any] = {"input_values": torch.randn(2, 1024, generator=gen)}
        if "attention_mask" in params:
            raw["attention_mask"] = audio
        found.append((raw, None))
    mel = next(
        (
            v
            for node in _sub_configs(config)
            for k, v in vars(node).items()
            if k in ("num_mel_bins", "feature_size", "n_mels") and isinstance(v, int)
        ),
        None,
    )
    for key in ("input_features", "input_values"):
        if key in params and mel is not None:
            frames = 2 * int(vars(config).get("max_source_positions", 32))
            for shape in ((2, mel, frames), (2, frames, mel)):
                found.append(({key: torch.randn(*shape, generator=gen)}, None))
    for given, _ in found:
        if "use_cache" in params:
            given["use_cache"] = False
    return found


def required(model: Any, given: dict[str, Any]) -> str | None:
    """The first argument ``model.forward`` requires that ``given`` lacks."""
    for name, param in inspect.signature(model.forward).parameters.items():
        if (
            name not in given
            and param.default is inspect.Parameter.empty
            and param.kind
            not in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            )
        ):
            return name
    return None


def tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor an output holds, in order (a cache and other objects skipped)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in tensors(v)]
    if isinstance(output, (list, tuple)):
        return [t for v in output for t in tensors(v)]
    return []


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit-identical (NaN where NaN)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        same = (x == y) | (x.isnan() & y.isnan()) if x.is_floating_point() else x == y
        if not bool(same.all()):
            return False
    return True


def build(cls: type, config: PretrainedConfig, device: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device(device):
            return cls(config).eval()
