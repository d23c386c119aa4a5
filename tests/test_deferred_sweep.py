"""Every transformers model type with softmax attention by hand, run tiny (issue 19).

What is enumerated: every entry of transformers' ``MODEL_MAPPING_NAMES`` whose
base model, built on the meta device as tests/test_integrations_coverage_hf.py
builds it, has at least one site whose route reads "softmax by hand" (the
deferred-scores route, :mod:`attnres.integrations._deferred`) -- read from
what is installed, never a hand-picked list. Each is built again tiny on the
CPU: the config of transformers' own model tester where the coverage test
builds from one (its ``_TESTER_VALUES``), else the library's default config;
its stacks cut to one layer, and hidden sizes, heads, vocabulary and image
sizes shrunk wherever the config holds them as numbers (``_SHRINK``); where
that does not build or run, the values in ``_SMALL`` (chosen for this sweep:
Swin-like stages, query counts, ...) or the default sizes (``_DEFAULT_SIZES``).
It is given real inputs (token ids with a padded second row where the model
takes an attention mask, pixel values, audio features, ...; ``runs``), and
checked (``sweep``):

- (a) ``apply`` with no flag keeps every by-hand site to its own code
  (nothing installed, except at a site decided at its first call: a VQ block
  that holds no head facts), and the output is bit-identical;
- (b) under a global ``torch_sdpa`` on a component that may fall back, every
  by-hand attention the forwards compute either runs the kernel (spied at
  ``_route.get_kernel``: as many calls as attentions read; the output matches
  the same plan with every by-hand attention left to its own math, and
  halving the kernel's output changes the model's) or its site records a
  first call whose ``changed`` names why not (own math and what the code did,
  a mask kind, ...); a site the forwards never call is listed in
  ``_NOT_CALLED``; the output's difference from the untouched model's is
  small, except for the types in ``_OTHER_SITES_DIFFER`` (sites that are not
  by hand, with why);
- (c) ``remove`` restores: the output is bit-identical again.

Per type it collects how many by-hand sites ran the kernel and how many ran
their own math, with the reasons: the table in docs/integrations.md (between
the ``deferred-sweep`` markers), written by the whole sweep with
``--update-golden``. A type that cannot be built or run tiny would be listed in
``_CANNOT_RUN`` with why (none in transformers 5.24); the sweep fails when
that set changes.

**Cost.** The enumeration plans every model type on meta (as the coverage
test does; about 40 s) and the whole sweep builds and runs each type tiny
(several minutes on the 2-core machine): it runs with
``ATTNRES_DEFERRED_FULL=1`` (``make test-deferred``, ``make test-deep``). By
default the sweep runs the twelve types in ``_DEFAULT`` (one per reading form
the route knows, and one of each kind of own math; about 20 s) and checks
their rows against the table.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from generated_docs import check_generated
from test_integrations_coverage_hf import (
    _TEST_CONFIGS,
    _TESTER_VALUES,
    _build,
    _cut,
    _model_types,
    _tester_config,
)
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
            except Exception:
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

#: per type, the values its tiny build takes where the shrunk defaults do not build
#: or run (chosen for this sweep, small and consistent: not a tester's), given over
#: the shrunk config
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
    "swinv2": _SWIN,
    "reformer": {"axial_pos_embds_dim": (16, 16), "axial_pos_shape": (4, 8)},
    "squeezebert": {"embedding_size": 32, "intermediate_size": 64},
    "hiera": {"image_size": [64, 64], "embed_dim": 8, "depths": [1, 1, 1, 1]},
    "swin2sr": {"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4},
    "evolla": {"num_key_value_heads": 2, "resampler_heads": 2, "resampler_dim_head": 16,
               "resampler_num_latents": 4, "resampler_depth": 1},
    "grounding-dino": {"num_queries": 4, "backbone_config": _SWIN4},
    "mm-grounding-dino": {"num_queries": 4, "backbone_config": _SWIN4},
    "oneformer": {"decoder_layers": 3},
    "pegasus_x": {"encoder_layers": 2},
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
        model = getattr(transformers, class_name)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and float(param.abs().max()) < 1e-6:
                # an init that leaves weights (nearly) zero (BLIP's vision tower):
                # drawn, so what an attention computes reaches the output
                param.normal_(0.0, 0.02)
    return model


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


#: a model's forward: the path of the part that runs ("" for the model) and its inputs
Run = tuple[str, dict[str, Any]]


def runs(model: Any, model_type: str) -> list[Run]:
    """The forwards that reach a type's by-hand sites, with real inputs: the
    model's own, from the names its forward takes (token ids with a padded
    second row and their mask, pixel values, audio features, ...), where no
    type-specific ones are given (:func:`_extra`)."""
    gen = torch.Generator().manual_seed(3)
    special = _extra(model, model_type, gen)
    if isinstance(special, list):
        return special
    params = inspect.signature(type(model).forward).parameters
    config = model.config
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
    return [("", {**out, **special})]


def _extra(model: Any, model_type: str, gen: torch.Generator) -> dict[str, Any] | list[Run]:
    """What a type's forward takes that the generic inputs do not give, or the
    forwards of the parts that reach its by-hand sites where the base model's own
    forward does not (Bark's sub-models; a VLM's image tokenizer or tower)."""
    config = model.config
    hidden = getattr(config, "hidden_size", 32)
    pixels = {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}
    if model_type == "bark":
        text = {"input_ids": IDS, "attention_mask": PAD}
        codes = torch.randint(0, 99, (2, 8, config.fine_acoustics_config.n_codes_total),
                              generator=gen)  # fmt: skip
        return [("semantic", text), ("coarse_acoustics", text),
                ("fine_acoustics", {"codebook_idx": 2, "input_ids": codes})]  # fmt: skip
    if model_type == "clvp":
        text = {"input_ids": IDS, "attention_mask": PAD}
        mel = {"input_features": torch.randn(2, 80, 16, generator=gen), "input_ids": IDS}
        return [("text_encoder_model", text), ("speech_encoder_model", text),
                ("conditioning_encoder", mel), ("speech_decoder_model", text)]  # fmt: skip
    if model_type == "apertus1p5":
        return [("vision_tokenizer.encoder", pixels)]
    if model_type in ("chameleon", "janus"):
        return [("vqmodel.encode", pixels)]
    if model_type == "got_ocr2":
        return [("vision_tower", pixels)]
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
    if model_type == "tvp":  # one clip: TvpVisualInputEmbedding views its column
        # embeddings as (batch_size, 1, width, hidden), which holds for one only
        return [("", {"input_ids": IDS[1:], "attention_mask": PAD[1:],
                      "pixel_values": torch.randn(1, 2, 3, 128, 128, generator=gen)})]  # fmt: skip
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


def _forward(model: Any, given: list[Run]) -> list[torch.Tensor]:
    out = []
    for path, kwargs in given:
        target = model
        for name in path.split(".") if path else ():
            target = getattr(target, name)
        torch.manual_seed(0)  # VITS and Informer draw noise in their forward
        with torch.no_grad():
            out += _tensors(target(**kwargs))
    return out


# =============================================================================
# One type
# =============================================================================


class Row:
    """What the sweep found for one model type."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
        self.sites: set[str] = set()  # by-hand sites
        #: by-hand site -> attentions of the forward read as one kernel call
        self.read: Counter[str] = Counter()
        #: by-hand site -> why its own math ran (the first calls' ``changed``)
        self.own: dict[str, set[str]] = {}
        self.not_called: set[str] = set()  # by-hand sites the forwards never call
        self.problems: list[str] = []
        #: the largest relative difference under torch_sdpa: from the same plan with
        #: the by-hand attentions left to their own math, and from the untouched model
        self.error = 0.0
        self.untouched = 0.0

    def line(self) -> str:
        whys = Counter(w for ws in self.own.values() for w in ws)
        why = "; ".join(f"{w} ({n})" for w, n in sorted(whys.items())) or "-"
        not_called = f"{len(self.not_called)}: {_NOT_CALLED[self.model_type]}" if (
            self.not_called
        ) else "-"  # fmt: skip
        return (
            f"| {self.model_type} | {len(self.sites)} | {len(self.read)} "
            f"({sum(self.read.values())}) | {len(self.own)} | {why.replace('|', '/')} | "
            f"{not_called} |"
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


def _kernel(name: str) -> Any:
    from attnres.kernels import get_kernel

    return get_kernel(name)


def sweep(model_type: str, class_name: str, monkeypatch: pytest.MonkeyPatch) -> Row:
    """Build ``model_type`` tiny on the CPU and check (a), (b), (c) (the module
    docstring); what it found is the row."""
    row = Row(model_type)
    model = tiny(model_type, class_name)
    given = runs(model, model_type)
    want = _forward(model, given)
    assert want, "the forwards return no floating tensor"
    # (a) no flag: the site's own code, bit-identical; a route is installed only
    # where the site is decided at its first call (no head facts held: a VQ block)
    plain = itf.apply(model, "text_encoder")
    row.sites = {s.name for s in plain.sites if BY_HAND in s.route}
    pending = {s.name for s in plain.sites if s.pending}
    wrapped = {key.split("/", 1)[1] for key in itf.routes(model)}
    if (row.sites & wrapped) - pending:
        row.problems.append(f"no flag: a route at {sorted((row.sites & wrapped) - pending)[:2]}")
    if any(s.backend is not None and s.backend.name != "eager" for s in plain.sites
           if s.name in row.sites):  # fmt: skip
        row.problems.append("no flag: a by-hand site not kept to its own math")
    if not _same(_forward(model, given), want):
        row.problems.append("no flag: the output changed")
    itf.remove(model)
    # (b) torch_sdpa, a component that may fall back: each by-hand attention runs
    # the kernel (spied), or its site recorded a first call saying why not
    ran: list[str] = []
    real = _kernel("torch_sdpa")
    factor = [1.0]

    def spy(q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: Any) -> Any:
        ran.append("kernel")
        return real(q, k, v, mask, causal, scale) * factor[0]

    run_deferred = _route.GenericRoute.run_deferred

    def recorded(route: Any, found: Any, probs: Any) -> Any:
        before = len(ran)
        out = run_deferred(route, found, probs)
        if len(ran) > before and factor[0] == 1.0:
            row.read[route.name] += 1
        return out

    with monkeypatch.context() as patch:
        patch.setattr(_route, "get_kernel", lambda n: spy if n == "torch_sdpa" else _kernel(n))
        patch.setattr(_route.GenericRoute, "run_deferred", recorded)
        itf.apply(model, "text_encoder", SDPA)
        try:
            got = _forward(model, given)
            routes = {key.split("/", 1)[1]: r for key, r in itf.routes(model).items()}
            calls = len(ran)
        finally:
            itf.remove(model)
        if row.read:  # the kernel's output is what reaches the model's output
            factor[0] = 0.5
            itf.apply(model, "text_encoder", SDPA)
            try:
                if _same(_forward(model, given), got):
                    row.problems.append("the kernel's output does not reach the output")
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
    for name in sorted(row.sites):
        firsts = routes[name].first_calls if name in routes else []
        whys = {
            why
            for first in firsts
            if first.backend is None or first.backend.name != "torch_sdpa"
            for why in first.changed
        }
        if whys:
            row.own[name] = whys
        if not row.read[name] and not whys:
            row.not_called.add(name)
    row.read = Counter({n: c for n, c in row.read.items() if c})
    row.error = _relative(got, own)
    row.untouched = _relative(got, want)
    if row.error > 1e-4:
        row.problems.append(f"torch_sdpa: relative difference {row.error:.1e}")
    if calls != sum(row.read.values()):
        row.problems.append(f"{calls} kernel calls for {sum(row.read.values())} read")
    # (c) remove restores
    if not _same(_forward(model, given), want):
        row.problems.append("remove: the output is not the untouched model's")
    return row


# =============================================================================
# What the sweep expects
# =============================================================================

#: types that cannot be built or run tiny, with why; the sweep fails when the set changes
_CANNOT_RUN: dict[str, str] = {}  # none in transformers 5.24

#: by-hand sites that the sweep's forwards do not call, per type, with why
_NOT_CALLED: dict[str, str] = {
    "janus": "the VQ decoder's blocks: only image generation decodes (JanusVQVAE.decode "
    "takes the 576 image tokens of the default 384-pixel config)",
}

#: types whose output under a global torch_sdpa differs from the untouched
#: model's because of sites that are not by hand (relative difference > 1e-4):
#: found by this sweep, with why; the sweep fails when the set changes
_OTHER_SITES_DIFFER: dict[str, str] = {
    # none since attnres's function gives a class that does not declare
    # _supports_sdpa transformers' eager masks (_hf_attention.name_for): BigBirdPegasus,
    # Informer and LongT5 differed by 6%, 0.4% and 42% under sdpa's boolean masks
}

#: the types the default run sweeps: one of each reading form the route knows
#: and of each kind of own math (the whole with ``ATTNRES_DEFERRED_FULL=1``)
_DEFAULT = (
    "bigbird_pegasus",  # a boolean mask added to the scores (its values)
    "bloom",  # baddbmm: ALiBi as an additive bias, the scale as its alpha
    "chameleon",  # a VQ block decided at its first call (one head over the channels)
    "cpmant",  # probabilities of masked positions set to zero
    "gemma4_audio",  # own math: no attention the route could read (logit cap)
    "grounding-dino",  # own math: a clamp of the scores at +-50000
    "hiera",  # 5-D scores (mask units)
    "longt5",  # einsum with an ellipsis over the blocks, a bias added in place
    "openai-gpt",  # GPT-1's w * b + -1e4 * (1 - b)
    "seggpt",  # scores viewed apart for a decomposed position bias, viewed back
    "swinv2",  # a positive logit scale per head, folded into the query
    "xlnet",  # einsum with the batch letters permuted
)

_ROW = re.compile(r"^\| (\S+) \|")


def _sweep(
    types: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Row], dict[str, str]]:
    rows, failed = [], {}
    logging.disable(logging.WARNING)
    try:
        for model_type, class_name in types.items():
            try:
                rows.append(sweep(model_type, class_name, monkeypatch))
            except Exception as exc:
                failed[model_type] = f"{type(exc).__name__}: {exc}"[:120]
    finally:
        logging.disable(logging.NOTSET)
    return rows, failed


def _check(rows: list[Row], failed: dict[str, str]) -> None:
    assert {t: w for t, w in failed.items() if t not in _CANNOT_RUN} == {}
    problems = {r.model_type: r.problems for r in rows if r.problems}
    assert problems == {}
    not_called = {r.model_type for r in rows if r.not_called}
    assert not_called == set(_NOT_CALLED) & {r.model_type for r in rows}
    differ = {r.model_type for r in rows if r.untouched > 1e-4}
    assert differ == set(_OTHER_SITES_DIFFER) & {r.model_type for r in rows}


def _table(rows: list[Row], types: dict[str, str]) -> str:
    lines = [r.line() for r in rows]
    lines += [f"| {t} | cannot run tiny: {why} | | | | |" for t, why in sorted(_CANNOT_RUN.items())]
    lines.sort(key=lambda line: line.split("|")[1])
    hand = sum(len(r.sites) for r in rows)
    read = sum(len(r.read) for r in rows)
    own = sum(len(r.own) for r in rows)
    return "\n".join(
        [
            f"transformers {transformers.__version__}: {len(types)} model types have a "
            f"by-hand site (their base model, `MODEL_MAPPING_NAMES`, planned on meta); "
            f"{len(rows)} built tiny on the CPU and run: {hand} by-hand sites, {read} run by "
            f"the kernel, {own} their own math; {len(_CANNOT_RUN)} cannot run tiny.",
            "",
            "| model type | by-hand sites | run by the kernel: sites (attentions) | "
            "own math: sites | why (sites) | not called by the sweep |",
            "|---|---|---|---|---|---|",
            *lines,
        ]
    )


def test_every_model_type_with_softmax_by_hand_runs_the_kernel_or_says_why(
    update_golden: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if FULL:
        types = by_hand_types()
        assert set(_DEFAULT) <= set(types)
    else:
        every = dict(_model_types())
        types = {t: every[t] for t in _DEFAULT}
    rows, failed = _sweep(types, monkeypatch)
    _check(rows, failed)
    if FULL:
        assert set(failed) == set(_CANNOT_RUN)
        check_generated(DOC, BEGIN, END, _table(rows, types), update_golden)
        return
    # the default run: its rows are the table's (which the whole sweep writes)
    text = DOC.read_text(encoding="utf-8")
    table = text.partition(BEGIN)[2].partition(END)[0]
    written = {m.group(1): line for line in table.splitlines() if (m := _ROW.match(line))}
    stale = {r.model_type: r.line() for r in rows if written.get(r.model_type) != r.line()}
    assert stale == {}, (
        "the deferred-sweep table is stale: `make test-deferred PYTEST_ARGS=--update-golden`"
    )
