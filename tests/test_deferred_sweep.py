"""Every transformers model type with softmax attention by hand, run tiny (issue 19).

What is enumerated: every entry of transformers' ``MODEL_MAPPING_NAMES`` whose
base model, built on the meta device as tests/test_integrations_coverage_hf.py
builds it, has at least one site whose route reads "softmax by hand" (the
deferred-scores route, :mod:`attnres.integrations._deferred`) -- read from
what is installed, never a hand-picked list. Each is built again tiny on the
CPU (the config of transformers' own model tester where the coverage test
uses one, else the library's default config; hidden sizes, heads, layers,
vocabulary and image sizes shrunk, per type where the defaults need it:
``_SMALL``, values from transformers' model testers,
tests/models/<type>/test_modeling_<type>.py), given real inputs (token ids
with a padded second row where the model takes an attention mask, pixel
values, audio features, ...), and checked:

- (a) ``apply`` with no flag installs nothing at a by-hand site, and the
  output is bit-identical;
- (b) under a global ``torch_sdpa`` on a component that may fall back, the
  output matches the untouched model's (relative norm), and every by-hand
  attention the code computes either ran the kernel (spied at
  ``_route.get_kernel``) or is a first call whose ``changed`` names why it did
  not (own math and what the code did, a mask kind, a dtype ...);
- (c) ``remove`` restores: the output is bit-identical again.

Per type it collects how many by-hand attentions were read as one kernel call
and how many ran their own math, with the reasons: the table in
docs/integrations.md (between the ``deferred-sweep`` markers), written by
``pytest tests/test_deferred_sweep.py --update-golden``.

A type that cannot be built or run tiny is listed in ``_CANNOT_RUN`` with
why; the sweep fails when that set changes.

**Cost.** The enumeration plans every model type on meta (as the coverage
test does) and the sweep builds and runs each type tiny: the whole runs with
``ATTNRES_DEFERRED_FULL=1`` (``make test-deep``, ``make test-deferred``). By
default the sweep runs the types in ``_DEFAULT`` (one per reading form the
route knows, and one of each kind of own math) and checks their rows against
the table.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from generated_docs import check_generated
from test_integrations_coverage_hf import _build, _cut, _model_types, _tester_config
from test_integrations_coverage_hf import _TEST_CONFIGS, _TESTER_VALUES
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from attnres import SelectionConfig
from attnres.integrations import _route
from attnres.integrations import transformers as itf

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
BEGIN, END = "<!-- deferred-sweep:begin -->", "<!-- deferred-sweep:end -->"
FULL = os.environ.get("ATTNRES_DEFERRED_FULL") == "1"
SDPA = SelectionConfig(global_backend="torch_sdpa")
BY_HAND = "softmax by hand"


def by_hand_types() -> dict[str, str]:
    """model type -> base class, for every type whose base model (built on meta as
    the coverage test builds it) has a by-hand site."""
    found = {}
    logging.disable(logging.WARNING)
    try:
        for model_type, class_name in _model_types():
            try:
                model = _build(model_type, class_name)
            except Exception:  # noqa: BLE001 - the coverage test lists those
                continue
            sites = itf.describe_sites(model, "transformer")
            if any(BY_HAND in s.route for s in sites):
                found[model_type] = class_name
    finally:
        logging.disable(logging.NOTSET)
    return found


# =============================================================================
# Tiny builds
# =============================================================================

#: shrunk wherever a config holds them as a number
_SHRINK: dict[str, int] = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "emb_dim": 32,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "num_heads": 2,
    "encoder_attention_heads": 2, "decoder_attention_heads": 2, "attention_heads": 2,
    "intermediate_size": 37, "ffn_dim": 37, "d_inner": 37, "encoder_ffn_dim": 37,
    "decoder_ffn_dim": 37, "d_ff": 37, "n_inner": 37,
    "vocab_size": 99, "image_size": 32,
}  # fmt: skip

#: per type, the values its tiny build takes (from transformers' model tester of
#: that type, tests/models/<type>/test_modeling_<type>.py, where the shrunk
#: defaults do not build or run), given over the shrunk config
_SWIN = {"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4,
         "hidden_size": 32, "image_size": 32, "patch_size": 4}  # fmt: skip
#: four stages (Grounding DINO takes the last three)
_SWIN4 = {**_SWIN, "embed_dim": 8, "depths": [1] * 4, "num_heads": [1, 1, 2, 2],
          "hidden_size": 64}  # fmt: skip
_SMALL: dict[str, dict[str, Any]] = {
    "clap": {"audio_config": {"depths": [1, 1], "num_attention_heads": [2, 2],
                              "patch_embeds_hidden_size": 16, "hidden_size": 32,
                              "spec_size": 32, "num_mel_bins": 16, "window_size": 4}},
    "donut-swin": _SWIN,
    "evolla": {"num_key_value_heads": 2, "resampler_heads": 2, "resampler_dim_head": 16,
               "resampler_num_latents": 4, "resampler_depth": 1},
    "grounding-dino": {"num_queries": 4, "backbone_config": _SWIN4},
    "mm-grounding-dino": {"num_queries": 4, "backbone_config": _SWIN4},
    "oneformer": {"decoder_layers": 3},
    "mask2former": {"decoder_layers": 3},
    "lxmert": {"visual_feat_dim": 16, "visual_pos_dim": 4},
    "mgp-str": {"image_size": [16, 32]},
    "seggpt": {"image_size": [64, 16], "patch_size": 8},
    "timesformer": {"num_frames": 2},
    "tvp": {"max_img_size": 128, "visual_prompt_size": 4, "num_frames": 2},
}  # fmt: skip


#: types built at their default sizes (their layers cut): sizes that shrinking
#: one key at a time cannot keep consistent (CLVP's rotary dimensions, the
#: WavTokenizer codebook that must be as wide as its hidden size)
_DEFAULT_SIZES = frozenset({"clvp", "tvp", "wavtokenizer"})


def _shrink(config: PretrainedConfig) -> None:
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _shrink(value)
        elif key in _SHRINK and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, key, min(value, _SHRINK[key]))
    vocab = getattr(config, "vocab_size", None)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id"):
        value = getattr(config, key, None)
        if isinstance(vocab, int) and isinstance(value, int) and value >= vocab:
            setattr(config, key, min(1, vocab - 1))


def _set(config: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        part = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(part, PretrainedConfig):
            _set(part, value)
        else:
            setattr(config, key, value)


def tiny(model_type: str, class_name: str) -> Any:
    if model_type in _TEST_CONFIGS or model_type in _TESTER_VALUES:
        config = _tester_config(model_type)
    else:
        config = CONFIG_MAPPING[model_type]()
    _cut(config, 1)
    if model_type not in _DEFAULT_SIZES:
        _shrink(config)
    _set(config, _SMALL.get(model_type, {}))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, class_name)(config).eval()


# =============================================================================
# Real inputs
# =============================================================================

IDS = torch.tensor([[2, 5, 9, 4, 7, 6, 3, 8], [3, 8, 6, 5, 4, 7, 1, 1]])
PAD = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])


def _get(config: Any, *keys: str, default: Any = None) -> Any:
    for part in (config, *(v for v in vars(config).values() if isinstance(v, PretrainedConfig))):
        for key in keys:
            value = getattr(part, key, None)
            if value is not None:
                return value
    return default


def inputs(model: Any, model_type: str) -> dict[str, Any]:
    params = inspect.signature(type(model).forward).parameters
    config = model.config
    gen = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {}
    if "input_ids" in params:
        out["input_ids"] = IDS
        if "attention_mask" in params:
            out["attention_mask"] = PAD
    if "pixel_values" in params:
        size = _get(config, "image_size", default=32)
        size = size if isinstance(size, int) else size[0]
        channels = _get(config, "num_channels", default=3)
        out["pixel_values"] = torch.randn(2, channels, size, size, generator=gen)
    if "decoder_input_ids" in params:
        out["decoder_input_ids"] = IDS[:, :5]
    if "input_features" in params:
        bins = _get(config, "num_mel_bins", "feature_size", "input_feat_per_channel", default=80)
        out["input_features"] = torch.randn(2, bins, 16, generator=gen)
    if "input_values" in params:
        out["input_values"] = torch.randn(2, 1024, generator=gen)
    if model_type in _PARTS:
        out = {}
    return {**out, **_extra(model, model_type, gen)}


#: the part of a model whose forward reaches its by-hand sites, where the base
#: model's own forward does not (a VLM's image tokenizer, Bark's sub-models)
_PARTS = {
    "bark": "semantic",
    "apertus1p5": "vision_tokenizer.encoder",
    "chameleon": "vqmodel.encode",
    "janus": "vqmodel.encode",
    "got_ocr2": "vision_tower",
}


def _part(model: Any) -> Any:
    path = _PARTS.get(model.config.model_type)
    target = model
    for name in () if path is None else path.split("."):
        target = getattr(target, name)
    return target


def _extra(model: Any, model_type: str, gen: torch.Generator) -> dict[str, Any]:
    """What a type's forward takes that the generic inputs do not give."""
    config = model.config
    hidden = getattr(config, "hidden_size", 32)
    if model_type in _PARTS and model_type != "bark":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}
    if model_type == "bark":
        return {"input_ids": IDS, "attention_mask": PAD}
    if model_type == "gemma3n_audio":
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[1, 12:] = True  # True: padding
        return {"audio_mel": torch.randn(2, 16, 128, generator=gen), "audio_mel_mask": mask}
    if model_type == "gemma4_audio":
        mask = torch.ones(2, 16, dtype=torch.bool)
        mask[1, 12:] = False
        return {"input_features": torch.randn(2, 16, 128, generator=gen), "attention_mask": mask}
    if model_type == "timesformer":
        return {"pixel_values": torch.randn(2, 2, 3, 32, 32, generator=gen)}
    if model_type == "tvp":
        return {"pixel_values": torch.randn(2, 2, 3, 128, 128, generator=gen)}
    if model_type == "wavtokenizer":
        return {"input_values": torch.randn(2, 1, 1024, generator=gen)}
    if model_type == "clap":
        return {"input_features": torch.randn(2, 1, 32, 16, generator=gen)}
    if model_type == "informer":
        past = config.context_length + max(config.lags_sequence)
        feats = config.num_time_features
        return {"past_values": torch.randn(2, past, generator=gen),
                "past_time_features": torch.randn(2, past, feats, generator=gen),
                "past_observed_mask": torch.ones(2, past),
                "future_values": torch.randn(2, config.prediction_length, generator=gen),
                "future_time_features": torch.randn(2, config.prediction_length, feats,
                                                    generator=gen)}  # fmt: skip
    if model_type == "speecht5":
        return {"input_values": torch.randn(2, 8, hidden, generator=gen), "attention_mask": PAD,
                "decoder_input_values": torch.randn(2, 5, hidden, generator=gen)}  # fmt: skip
    if model_type == "lxmert":
        return {"visual_feats": torch.randn(2, 3, 16, generator=gen),
                "visual_pos": torch.rand(2, 3, 4, generator=gen)}  # fmt: skip
    if model_type == "evolla":
        return {"protein_input_ids": IDS, "protein_attention_mask": PAD}
    if model_type == "seggpt":
        pixels = torch.randn(2, 3, 32, 16, generator=gen)
        return {"pixel_values": pixels, "prompt_pixel_values": pixels.flip(0),
                "prompt_masks": pixels.flip(1)}  # fmt: skip
    if model_type == "mgp-str":
        return {"pixel_values": torch.randn(2, 3, 16, 32, generator=gen)}
    if model_type == "oneformer":
        return {"task_inputs": torch.randint(1, 50, (2, config.task_seq_len), generator=gen)}
    return {}


def _tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a model's output, in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _forward(model: Any, given: dict[str, Any]) -> list[torch.Tensor]:
    torch.manual_seed(0)  # VITS draws noise in its forward
    with torch.no_grad():
        return _tensors(_part(model)(**given))


# =============================================================================
# One type
# =============================================================================


class Row:
    """What the sweep found for one model type."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
        self.sites = 0  # by-hand sites
        self.read: Counter[str] = Counter()  # site -> attentions read as one kernel call
        self.own: Counter[str] = Counter()  # why -> own-math attentions
        self.unexplained: list[str] = []  # by-hand sites neither run by the kernel nor recorded
        self.problems: list[str] = []
        #: the largest relative difference under torch_sdpa: from the same plan with
        #: the by-hand attentions left to their own math, and from the untouched model
        self.error = 0.0
        self.untouched = 0.0

    def line(self) -> str:
        own = sum(self.own.values())
        why = "; ".join(f"{n}x {w}" for w, n in sorted(self.own.items())) or "-"
        sites_read = len(self.read)
        return (
            f"| {self.model_type} | {self.sites} | {sites_read} ({sum(self.read.values())}) | "
            f"{own} | {why} |"
        )


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        a, b = a.double(), b.double()
        keep = torch.isfinite(b)
        if not bool((torch.isfinite(a) == keep).all()):
            return float("inf")
        norm = float(b[keep].norm())
        diff = float((a[keep] - b[keep]).norm())
        worst = max(worst, diff / norm if norm else diff)
    return worst


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num())
        for a, b in zip(got, want, strict=True)
    )


def sweep(model_type: str, class_name: str, monkeypatch: pytest.MonkeyPatch) -> Row:
    row = Row(model_type)
    model = tiny(model_type, class_name)
    given = inputs(model, model_type)
    want = _forward(model, given)
    if not want:
        row.problems.append("the forward returned no floating tensor")
        return row
    # (a) no flag: nothing installed at a by-hand site, bit-identical
    plain = itf.apply(model, "text_encoder")
    hand = {s.name for s in plain.sites if BY_HAND in s.route}
    row.sites = len(hand)
    wrapped = {key.split("/", 1)[1] for key in itf.routes(model)}
    if hand & wrapped:
        row.problems.append(f"no flag: a route installed at {sorted(hand & wrapped)[:2]}")
    if not _same(_forward(model, given), want):
        row.problems.append("no flag: the output changed")
    itf.remove(model)
    # (b) torch_sdpa, may fall back: the kernel, or a first call saying why not
    ran: list[str] = []
    real = _route.get_kernel("torch_sdpa")

    def spy(q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: Any) -> Any:
        ran.append("kernel")
        return real(q, k, v, mask, causal, scale)

    run_deferred = _route.GenericRoute.run_deferred

    def recorded(route: Any, found: Any, probs: Any) -> Any:
        before = len(ran)
        out = run_deferred(route, found, probs)
        if len(ran) > before:
            row.read[route.name] += 1
        return out

    with monkeypatch.context() as patch:
        patch.setattr(_route, "get_kernel", lambda n: spy if n == "torch_sdpa" else _kernel(n))
        patch.setattr(_route.GenericRoute, "run_deferred", recorded)
        itf.apply(model, "text_encoder", SDPA)
        try:
            got = _forward(model, given)
            routes = {key.split("/", 1)[1]: r for key, r in itf.routes(model).items()}
        finally:
            itf.remove(model)
        # the same plan with every by-hand attention left to its own math: what the
        # kernel's output is compared with (the other sites run what they were decided)
        patch.setattr(_route.GenericRoute, "run_deferred", lambda route, found, probs: None)
        itf.apply(model, "text_encoder", SDPA)
        try:
            own = _forward(model, given)
        finally:
            itf.remove(model)
    for name in sorted(hand):
        route = routes.get(name)
        firsts = [] if route is None else route.first_calls
        for first in firsts:
            if first.backend is None or first.backend.name != "torch_sdpa":
                row.own.update(first.changed)
        if not row.read[name] and not any(first.changed for first in firsts):
            row.unexplained.append(name)
    row.read = Counter({n: c for n, c in row.read.items() if c})
    row.error = _relative(got, own)
    row.untouched = _relative(got, want)
    if row.error > 1e-3:
        row.problems.append(f"torch_sdpa: relative difference {row.error:.2e}")
    if len(ran) != sum(row.read.values()):
        row.problems.append(f"kernel calls {len(ran)} for {sum(row.read.values())} read")
    # (c) remove restores
    if not _same(_forward(model, given), want):
        row.problems.append("remove: the output is not the untouched model's")
    return row


def _kernel(name: str) -> Any:
    from attnres.kernels import get_kernel

    return get_kernel(name)
