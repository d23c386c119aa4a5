"""Every transformers model type with interface sites, run tiny on the CPU (issue 19, item 5).

``tests/test_integrations_coverage_hf.py`` plans every model type transformers
exports on the meta device; meta tensors cannot run, so outputs, ``remove``
and the real kernel calls are checked here, on the CPU, for every type whose
base model has a site on the route ``transformers attention interface`` --
enumerated as the coverage test does (``MODEL_MAPPING_NAMES``), never a
hand-picked list.

Each type is built tiny from its config (the default, or the values of
transformers' own model tester where the default does not construct, as the
coverage test does), with each stack cut to two layers and then shrunk
generically to ``CausalLMModelTester``'s sizes (``tests/runtime_hf.py``:
hidden 32, 4 heads over 2 kv heads of size 8, intermediate 37, vocabulary 99,
512 positions, in every sub-config). Where the shrunk config does not
construct, the config as the coverage test builds it is used if it is tiny
(under ``MAX_PARAMS`` parameters). Inputs come from the forward signature
(``tests/runtime_hf.py``: ``inputs``): a padded two-row prompt, else images
of the config's size, else raw audio. Then, per type:

- **no flag** (``apply(model, "text_encoder")``): the output is bit-identical,
  every interface site's call is the one the plan names with the heads, kv
  heads and head size it names (spied); ``remove`` restores the output, the
  state dict, the modules and the attention implementation exactly;
- **eager**, strict (``SelectionConfig(global_backend="eager")`` on
  ``"transformer"``): every interface site the inputs reach calls ``eager``
  with the plan's facts;
- **torch_sdpa**, strict: every interface site the inputs reach calls
  ``sdpa`` with the plan's facts, and the first output matches the untouched
  model's at the valid (unpadded) positions (relative error under
  ``SDPA_TOLERANCE``). A class that opts out of ``sdpa``
  (``_supports_sdpa = False``) is refused at apply with a typed error: that is
  its row, not a failure.

A type that cannot be built or run tiny generically is listed in
``_NOT_RUN`` with why; the test fails when that set changes.

**Cost.** By default every ``STRIDE``-th model type of the sorted enumeration
runs (chosen by position, not by hand) and its row is checked against the
table in ``docs/integrations.md``; ``ATTNRES_COVERAGE_FULL=1`` (``make
test-deep``) runs every type, and with ``--update-golden`` regenerates the
table (between the ``runtime-transformers`` markers).
"""

from __future__ import annotations

import gc
import logging
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers
from generated_docs import check_generated, pinned_release
from runtime_hf import SIZES, build, candidates, identical, required, shrink, tensors
from test_integrations_coverage_hf import (
    _TEST_CONFIGS,
    _TESTER_VALUES,
    _cut,
    _model_types,
    _same,
    _snapshot,
    _spying,
    _tester_config,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from attnres import SelectionConfig
from attnres.errors import IntegrationError
from attnres.integrations import transformers as itf

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
BEGIN, END = "<!-- runtime-transformers:begin -->", "<!-- runtime-transformers:end -->"
FULL = os.environ.get("ATTNRES_COVERAGE_FULL") == "1"
#: the default run takes every STRIDE-th type of the sorted enumeration
STRIDE = 24
#: the default run checks its types in CHUNKS tests, so that pytest-xdist spreads
#: them over its workers (one test was the suite's longest pole); the full sweep
#: is one test, as it writes the one table
CHUNKS = 1 if FULL else 4
#: a build over this many parameters is not tiny (memory on a shared machine)
MAX_PARAMS = 20_000_000
SDPA_TOLERANCE = 1e-4
#: what a site's error may name when a strict torch_sdpa is refused: a fact of
#: the kernel (attention sinks, a head size) or a class that opts out of it
KERNEL_LIMITS = {"not_in_supported_set", "requirement_unmet", "head_size", "dtype"}
EAGER = SelectionConfig(global_backend="eager")
SDPA = SelectionConfig(global_backend="torch_sdpa")

#: what a site's decided backend makes the attention interface call
_CALLED = {"torch_sdpa": "sdpa", "eager": "eager"}

#: model types with interface sites that are not run tiny, with why (the first
#: rung's failure, abridged; the table has it whole); the sweep fails when this
#: set changes
_NOT_RUN: dict[str, str] = {
    "align": "not tiny: over 20M parameters",
    "apertus1p5": "not tiny: over 20M parameters",
    "audio-spectrogram-transformer": "not run: RuntimeError: The size of tensor a (62) must match",
    "audioflamingo3_encoder": "not run: AttributeError: 'NoneType' object has no attribute 'sum'",
    "axk1": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "axk2": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "bailing_hybrid": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "blip-2": "not run: its forward requires 'input_ids'",
    "blip_2_qformer": "not run: its forward takes none of the generic inputs",
    "blt": "not tiny: over 20M parameters",
    "bridgetower": "not built: ValueError: embed_dim and num_heads must be greater than 0, got",
    "canary": "not run: ValueError: You must specify exactly one of input_ids or inputs_em",
    "clap": "not tiny: over 20M parameters",
    "cohere_asr": "not run: ValueError: You must specify exactly one of input_ids or inputs_em",
    "cohere_compass_vision": "not run: its forward takes none of the generic inputs",
    "conditional_detr": "not built: ImportError: TimmBackbone requires the timm library but it was",
    "cosmos3_edge_vision": "not run: its forward takes none of the generic inputs",
    "csm": "not built: ValueError: in_channels must be divisible by groups",
    "d_fine": "not tiny: over 20M parameters",
    "dab-detr": "not built: ImportError: TimmBackbone requires the timm library but it was n",
    "decision_transformer": "not run: its forward takes none of the generic inputs",
    "deepseek_v2": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "deepseek_v3": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "deepseek_v32": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "deformable_detr": "not built: ImportError: TimmBackbone requires the timm library but it was",
    "deimv2": "not tiny: over 20M parameters",
    "depth_pro": "not run: ValueError: Image size 384x384 is too small to be scaled with scal",
    "detr": "not built: ImportError: TimmBackbone requires the timm library but it was n",
    "dia": "not run: RuntimeError: shape '[2, 9, -1]' is invalid for input of size 8",
    "dinat": "not built: ImportError: DinatModel requires the natten library but it was n",
    "dots3_note": "not built: AmbiguousGlobalPerLayerAttributeError: 'num_attention_heads' is",
    "dots3_note_text": "not built: AmbiguousGlobalPerLayerAttributeError: 'num_attention_heads' is",
    "edgetam": "not built: ImportError: TimmWrapperModel requires the timm library but it w",
    "edgetam_video": "not tiny: over 20M parameters",
    "edgetam_vision_model": "not built: ImportError: TimmWrapperModel requires the timm library bu",
    "efficientloftr": "not run: its forward takes none of the generic inputs",
    "embedding_gemma2": "not built: AmbiguousGlobalPerLayerAttributeError: 'num_key_value_heads' i",
    "embedding_gemma2_text": "not built: AmbiguousGlobalPerLayerAttributeError: 'num_key_value_hea",
    "ernie4_5_vl_moe": "not built: RuntimeError: The expanded size of the tensor (4) must match th",
    "exaone4_5_vision": "not run: its forward takes none of the generic inputs",
    "fast_vlm": "not built: ImportError: TimmWrapperModel requires the timm library but it w",
    "florence2": "not tiny: over 20M parameters",
    "fun_asr_nano_encoder": "not run: its forward requires 'input_features_mask'",
    "gemma3n": "not built: ImportError: TimmWrapperModel requires the timm library but it w",
    "gemma3n_text": "not tiny: over 20M parameters",
    "gemma3n_vision": "not built: ImportError: TimmWrapperModel requires the timm library but it w",
    "gemma4": "not built: AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer",
    "gemma4_text": "not built: AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer",
    "gemma4_unified": "not built: AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer",
    "gemma4_unified_text": "not built: AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-",
    "gemma4_vision": "not run: its forward takes none of the generic inputs",
    "glm46v": "not tiny: over 20M parameters",
    "glm4v": "not tiny: over 20M parameters",
    "glm4v_moe": "not tiny: over 20M parameters",
    "glm4v_moe_text": "not run: RuntimeError: split_with_sizes expects split_sizes to sum exactly",
    "glm4v_moe_vision": "not tiny: over 20M parameters",
    "glm4v_text": "not run: RuntimeError: split_with_sizes expects split_sizes to sum exactly",
    "glm4v_vision": "not tiny: over 20M parameters",
    "glm5_next_vision": "not run: its forward takes none of the generic inputs",
    "glm_image": "not run: ValueError: You must specify exactly one of input_ids or inputs_em",
    "glm_image_text": "not run: RuntimeError: split_with_sizes expects split_sizes to sum exactly",
    "glm_image_vision": "not run: its forward requires 'grid_thw'",
    "glm_moe_dsa": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "glm_ocr": "not tiny: over 20M parameters",
    "glm_ocr_text": "not run: RuntimeError: split_with_sizes expects split_sizes to sum exactly",
    "glm_ocr_vision": "not tiny: over 20M parameters",
    "glmga": "not tiny: over 20M parameters",
    "granite_speech5_ctc": "not run: RuntimeError: mat1 and mat2 shapes cannot be multiplied (128x",
    "granite_speech5_encoder": "not run: RuntimeError: mat1 and mat2 shapes cannot be multiplied (",
    "grounding-dino": "not run: its forward requires 'input_ids'",
    "higgs_audio_v2_tokenizer": "not built: ImportError: HiggsAudioV2TokenizerModel requires the t",
    "hunyuan_vl_text": "not run: TypeError: object of type 'NoneType' has no len()",
    "hunyuan_vl_vision": "not run: its forward takes none of the generic inputs",
    "hy_v4": "not run: RuntimeError: The size of tensor a (4) must match the size of tens",
    "hy_v4_vl": "not run: RuntimeError: The size of tensor a (4) must match the size of tens",
    "hy_v4_vl_text": "not run: RuntimeError: The size of tensor a (4) must match the size of tens",
    "hy_v4_vl_vision": "not run: its forward takes none of the generic inputs",
    "idefics": "not run: AttributeError: 'NoneType' object has no attribute 'device'",
    "informer": "not run: its forward takes none of the generic inputs",
    "inkling2": "not tiny: over 20M parameters",
    "inkling2_vision": "not run: its forward takes none of the generic inputs",
    "inkling_mm_model": "not tiny: over 20M parameters",
    "instructblip": "not run: its forward requires 'qformer_input_ids'",
    "instructblipvideo": "not run: its forward requires 'qformer_input_ids'",
    "janus": "not tiny: over 20M parameters",
    "kimi_k25": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "kimi_k25_vision": "not run: its forward takes none of the generic inputs",
    "kolibri1_1": "not tiny: over 20M parameters",
    "kosmos-2": "not run: ValueError: You have to specify either input_ids or inputs_embeds",
    "kyutai_speech_to_text": "not run: RuntimeError: The size of tensor a (8) must match the size",
    "layoutlmv2": "not built: ImportError: LayoutLMv2Model requires the detectron2 library but",
    "layoutlmv3": "not run: RuntimeError: The size of tensor a (32) must match the size of ten",
    "lfm3_vl_vision": "not run: its forward takes none of the generic inputs",
    "lightglue": "not run: its forward takes none of the generic inputs",
    "llava_onevision1_5_vision": "not run: its forward takes none of the generic inputs",
    "longcat_flash": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "lw_detr": "not run: ValueError: torch.cat(): expected a non-empty list of Tensors",
    "mask2former": "not run: RuntimeError: shape '[128, 49, -1, 10]' is invalid for input of si",
    "mimi": "not built: ValueError: in_channels must be divisible by groups",
    "mimi_decoder": "not built: ValueError: in_channels must be divisible by groups",
    "mimi_encoder": "not run: ValueError: not enough values to unpack (expected 3, got 2)",
    "minicpm3": "not run: RuntimeError: The size of tensor a (4) must match the size of tens",
    "minicpm_ocr_vision": "not run: AttributeError: 'NoneType' object has no attribute 'device'",
    "minicpmv4_7_vision": "not run: AttributeError: 'NoneType' object has no attribute 'device'",
    "minimax_m3_vl": "not tiny: over 20M parameters",
    "mistral_large4": "not run: ValueError: You must specify exactly one of input_ids or inputs_em",
    "mistral_large4_text": "not run: RuntimeError: The size of tensor a (2) must match the size of",
    "mm-grounding-dino": "not run: its forward requires 'input_ids'",
    "moonshine": "not run: RuntimeError: shape '[2, 1, 2, 4]' is invalid for input of size 64",
    "moonshine_streaming": "not run: RuntimeError: shape '[2, -1, 80]' is invalid for input of siz",
    "moshi": "not run: RuntimeError: shape '[2, 8, 2, -1]' is invalid for input of size 5",
    "muse_glimmer": "not tiny: over 20M parameters",
    "muse_glimmer_assistant": "not run: its forward takes none of the generic inputs",
    "muse_glimmer_vision": "not run: its forward takes none of the generic inputs",
    "muse_spark": "not tiny: over 20M parameters",
    "muse_spark_text": "not tiny: over 20M parameters",
    "muse_spark_vision": "not run: its forward takes none of the generic inputs",
    "musicgen": "not run: RuntimeError: shape '[-1, 4, 8]' is invalid for input of size 16",
    "musicgen_melody": "not run: RuntimeError: shape '[-1, 4, 8]' is invalid for input of size 16",
    "nemotron3_5_asr": "not tiny: over 20M parameters",
    "nemotron3_5_transcribe_audio": "not run: RuntimeError: mat1 and mat2 shapes cannot be multipl",
    "nemotron3_5_transcribe_word_timestamp": "not run: its forward takes none of the generic input",
    "nemotron_asr_streaming": "not run: TypeError: embedding(): argument 'indices' (position 2) mu",
    "neomme": "not run: RuntimeError: stack expects each tensor to be equal size, but got",
    "neucodec": "not tiny: over 20M parameters",
    "omdet-turbo": "not built: ImportError: TimmBackbone requires the timm library but it was n",
    "omniasr_audio": "not run: RuntimeError: Given groups=1, weight of size [512, 1, 10], expecte",
    "omniasr_ctc": "not run: RuntimeError: Given groups=1, weight of size [512, 1, 10], expecte",
    "oneformer": "not run: its forward requires 'task_inputs'",
    "ovis2_5_vision": "not run: its forward requires 'grid_thw'",
    "paddleocr_vl": "not run: TypeError: embedding(): argument 'indices' (position 2) must be Te",
    "parakeet_rnnt": "not run: TypeError: embedding(): argument 'indices' (position 2) must be Te",
    "parakeet_tdt": "not run: TypeError: embedding(): argument 'indices' (position 2) must be Te",
    "patchtst": "not run: its forward takes none of the generic inputs",
    "pe_audio": "not tiny: over 20M parameters",
    "pe_audio_encoder": "not tiny: over 20M parameters",
    "pe_audio_video": "not built: ImportError: TimmWrapperForImageClassification requires the timm",
    "pe_audio_video_encoder": "not built: ImportError: TimmWrapperForImageClassification requires",
    "pe_video": "not built: ImportError: TimmWrapperForImageClassification requires the timm",
    "pe_video_encoder": "not built: ImportError: TimmWrapperForImageClassification requires the ti",
    "perception_lm": "not built: ImportError: TimmWrapperModel requires the timm library but it w",
    "pi0": "not run: its forward requires 'action_embeds'",
    "pi05": "not run: its forward requires 'action_embeds'",
    "pocket_tts_audio_tokenizer": "not built: ValueError: in_channels must be divisible by groups",
    "pocket_tts_audio_tokenizer_decoder": "not built: ValueError: in_channels must be divisible by",
    "pocket_tts_audio_tokenizer_encoder": "not run: ValueError: not enough values to unpack (expec",
    "pp_doclayout_v3": "not tiny: over 20M parameters",
    "pp_doclayout_v4": "not tiny: over 20M parameters",
    "qwen2_5_omni_thinker": "not run: TypeError: embedding(): argument 'indices' (position 2) must",
    "qwen2_5_vl": "not run: RuntimeError: split_with_sizes expects split_sizes to sum exactly",
    "qwen2_5_vl_text": "not run: RuntimeError: split_with_sizes expects split_sizes to sum exactly",
    "qwen2_5_vl_vision": "not run: its forward takes none of the generic inputs",
    "qwen2_vl": "not run: RuntimeError: split_with_sizes expects split_sizes to sum exactly",
    "qwen2_vl_text": "not run: RuntimeError: split_with_sizes expects split_sizes to sum exactly",
    "qwen3_5_moe_vision": "not run: its forward takes none of the generic inputs",
    "qwen3_5_vision": "not run: its forward takes none of the generic inputs",
    "qwen3_asr_encoder": "not run: its forward requires 'input_features_mask'",
    "qwen3_omni_moe_thinker": "not run: TypeError: embedding(): argument 'indices' (position 2) mu",
    "qwen3_vl_moe_vision": "not run: its forward takes none of the generic inputs",
    "qwen3_vl_vision": "not run: its forward takes none of the generic inputs",
    "qwen4_exp": "not run: RuntimeError: shape '[1, 2, 8]' is invalid for input of size 32",
    "qwen4_exp_vision": "not run: its forward takes none of the generic inputs",
    "rf_detr": "not run: RuntimeError: shape '[2, 4, 9, 4, 9, -1]' is invalid for input of",
    "rt_detr": "not tiny: over 20M parameters",
    "rt_detr_v2": "not tiny: over 20M parameters",
    "sam": "not run: RuntimeError: The size of tensor a (256) must match the size of te",
    "sam2": "not tiny: over 20M parameters",
    "sam2_hiera_det_model": "not tiny: over 20M parameters",
    "sam2_video": "not tiny: over 20M parameters",
    "sam2_vision_model": "not tiny: over 20M parameters",
    "sam3": "not run: ValueError: You must specify exactly one of input_ids or text_embe",
    "sam3_lite_text": "not run: ValueError: You must specify exactly one of input_ids or text_embe",
    "sam3_tracker": "not run: RuntimeError: Given groups=1, weight of size [4, 32, 1, 1], expect",
    "sam3_tracker_video": "not run: its forward takes none of the generic inputs",
    "sam3_video": "not run: its forward takes none of the generic inputs",
    "sam_hq": "not run: RuntimeError: Given transposed=1, weight of size [32, 8, 2, 2], ex",
    "sapiens2": "not run: RuntimeError: The size of tensor a (4) must match the size of tens",
    "sarvam_mla": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "seamless_m4t": "not tiny: over 20M parameters",
    "seamless_m4t_v2": "not tiny: over 20M parameters",
    "segformer": "not run: its forward takes none of the generic inputs",
    "siglip": "not run: ValueError: You have to specify input_ids",
    "siglip2": "not run: AttributeError: 'NoneType' object has no attribute 'to'",
    "siglip2_vision_model": "not run: its forward takes none of the generic inputs",
    "speech_to_text": "not run: its forward takes none of the generic inputs",
    "step3p7": "not run: TypeError: embedding(): argument 'indices' (position 2) must be Te",
    "swin": "not run: RuntimeError: shape '[128, 49, -1, 10]' is invalid for input of si",
    "t5gemma": "not run: RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x32 and",
    "table-transformer": "not built: ImportError: TimmBackbone requires the timm library but it wa",
    "time_series_transformer": "not run: its forward takes none of the generic inputs",
    "timesfm": "not run: its forward takes none of the generic inputs",
    "timesfm2_5": "not run: its forward takes none of the generic inputs",
    "timm_backbone": "not built: ImportError: TimmBackbone requires the timm library but it was n",
    "timm_wrapper": "not built: ImportError: TimmWrapperModel requires the timm library but it w",
    "udop": "not run: ValueError: You must specify exactly one of input_ids or inputs_em",
    "vibevoice": "not tiny: over 20M parameters",
    "vibevoice_asr": "not tiny: over 20M parameters",
    "video_llama_3_vision": "not run: its forward takes none of the generic inputs",
    "videomae": "not run: ValueError: not enough values to unpack (expected 5, got 4)",
    "videoprism": "not run: its forward requires 'pixel_values_videos'",
    "videoprism_vision_model": "not run: its forward takes none of the generic inputs",
    "vision-text-dual-encoder": "not run: ValueError: You must specify exactly one of input_ids or",
    "vit_mae": "not run: its output is not deterministic",
    "vivit": "not run: ValueError: not enough values to unpack (expected 5, got 4)",
    "vjepa2": "not tiny: over 20M parameters",
    "voxtral_realtime": "not run: ValueError: You must specify exactly one of input_ids or inputs_",
    "voxtral_realtime_text": "not built: transformers exports no VoxtralRealtimeTextModel",
    "wav2vec2-bert": "not run: its forward takes none of the generic inputs",
    "whisper": "not run: ValueError: Whisper expects the mel input features to be of length",
    "xclip": "not run: ValueError: not enough values to unpack (expected 5, got 4)",
    "xcodec": "not tiny: over 20M parameters",
    "xcodec2": "not tiny: over 20M parameters",
    "xmod": "not run: ValueError: Input language unknown",
    "youtu": "not run: RuntimeError: The size of tensor a (2) must match the size of tens",
    "zamba": "not run: RuntimeError: The size of tensor a (7424) must match the size of t",
    "zamba2": "not run: RuntimeError: shape '[2, 8, 8, 640]' is invalid for input of size",
}

#: what differs from _NOT_RUN on an older transformers the extras admit (make
#: test-oldest), keyed by its version: a type not run there, with why, or None for
#: a type _NOT_RUN lists that runs there
_NOT_RUN_ON: dict[str, dict[str, str | None]] = {
    "5.0.0": {
        "apertus": "not built: NotImplementedError: Cannot copy out of meta tensor; ",
        "blip_2_qformer": None,
        "d_fine": None,
        "exaone4": "not built: AttributeError: 'Exaone4Config' object has no attribu",
        "glm4_moe_lite": "not run: RuntimeError: The size of tensor a (4) must match the s",
        "granitemoehybrid": "not built: TypeError: 'NoneType' object is not subscriptable",
        "jamba": "not run: ValueError: Fast Mamba kernels are not available",
        "jetmoe": "not built: AttributeError: 'JetMoeConfig' object has no attribut",
        "kyutai_speech_to_text": None,
        "layoutlmv3": None,
        "mask2former": None,
        "mimi": None,
        "moshi": None,
        "oneformer": None,
        "phi": "not built: AttributeError: 'PhiConfig' object has no attribute '",
        "phi4_multimodal": "not built: AttributeError: 'NoneType' object has no attribute 'i",
        "qwen3_vl_moe": "not built: AttributeError: 'Qwen3VLMoeTextConfig' object has no ",
        "qwen3_vl_moe_text": "not built: AttributeError: 'Qwen3VLMoeTextConfig' object has no ",
        "rt_detr": None,
        "rt_detr_v2": None,
        "sam3_vision_model": "not built: ModuleNotFoundError: Could not import module 'Sam3Vis",
        "sam3_vit_model": "not built: ModuleNotFoundError: Could not import module 'Sam3ViT",
        "seamless_m4t": None,
        "seamless_m4t_v2": None,
        "segformer": None,
        "stablelm": "not built: AttributeError: 'StableLmConfig' object has no attrib",
        "swin": None,
        "tvp": "not built: AttributeError: 'TvpConfig' object has no attribute '",
        "udop": None,
        "wav2vec2-bert": None,
    },
}

#: model types whose run found a problem in attnres, with what it is; the sweep
#: fails when one closes (drop its entry) or a type not listed here has one
_INPUT_ATTENTION = (
    "its input-attention sites (attention_input, mlp_input, final_input) are planned with the "
    "text model's heads and head size (4, 4, 8); they call with (8, 8, 32)"
)
_FINDINGS: dict[str, str] = {
    "inkling2_loop": _INPUT_ATTENTION,
    "inkling2_loop_text": _INPUT_ATTENTION,
    "inkling2_text": _INPUT_ATTENTION,
    "jetmoe": (
        "planned 2 kv heads (the config's); the call carries 4 (JetMoE's mixture of attention "
        "heads expands its keys before the interface call)"
    ),
}


@attrs.frozen
class Row:
    model_type: str
    sites: int | None  # interface sites of the plan with no flag (None: not known)
    cells: tuple[str, str, str, str]  # no flag, eager, sdpa, why not run / note
    problems: tuple[str, ...] = ()

    def line(self) -> str:
        sites = "?" if self.sites is None else self.sites
        return f"| {self.model_type} | {sites} | " + " | ".join(self.cells) + " |"


#: the configs tried in order, the first whose model builds and runs is used:
#: shrunk; shrunk with as many kv heads as heads (a site that reads its kv heads
#: from elsewhere); the config as the coverage test builds it, if tiny
_RUNGS: tuple[int | None, ...] = (SIZES["num_key_value_heads"], SIZES["num_attention_heads"], None)


def _config(model_type: str, kv_heads: int | None) -> Any:
    if model_type in _TEST_CONFIGS or model_type in _TESTER_VALUES:
        config = _tester_config(model_type)
    else:
        config = CONFIG_MAPPING[model_type]()
        _cut(config)
    if kv_heads is not None:
        shrink(config, kv_heads)
    return config


def _interface(plan: Any) -> dict[str, Any]:
    return {s.name: s for s in plan.sites if s.route == itf.ROUTE}


def _calls_match(plan: Any, seen: list[Any], function: str | None) -> tuple[int, list[str]]:
    """(interface sites called, what differs from the plan): each call of an
    interface site is the function its decided backend makes the interface call
    (``function`` where given), with the heads, kv heads and head size the plan
    names (a site decided at its first call: the function only)."""
    sites = _interface(plan)
    wrong: list[str] = []
    called = set()
    for name, label, heads, kv_heads, head_size in seen:
        site = sites.get(name)
        if site is None:
            continue
        called.add(name)
        if site.backend is None and not site.pending:
            # no decision: only a site left on its own code path (no flag, where a plan
            # check fails: Gemma 2 on transformers 5.0.0, whose sdpa ignores its softcap)
            # may be called, and with what it ran before apply
            own = _CALLED.get(site.current.name) if site.current is not None else None
            if label != own:
                wrong.append(f"{name}: called {label} at a site with no decision")
                continue
        want = function or _CALLED.get(site.backend.name, "attnres") if site.backend else None
        # a backend the class does not offer natively runs through attnres's function
        # (registered as ``attnres``, or ``attnres_eager_masks`` for a class written
        # for transformers' eager masks)
        if want is not None and label != want and not label.startswith("attnres"):
            wrong.append(f"{name}: called {label}, planned {want}")
        if not site.pending and (heads, kv_heads, head_size) != (
            site.heads,
            site.kv_heads,
            site.spec.head_size,
        ):
            wrong.append(
                f"{name}: called with heads/kv/size {(heads, kv_heads, head_size)}, planned "
                f"{(site.heads, site.kv_heads, site.spec.head_size)}"
            )
    return len(called), sorted(set(wrong))


def _forward(model: Any, given: dict[str, Any]) -> list[torch.Tensor]:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's and transformers' own, about the tiny sizes
        return tensors(model(**given))


def _why(exc: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(exc)).strip().split(". ")[0][:90].replace("|", "/")
    return f"{type(exc).__name__}: {text}"


@attrs.frozen
class Tiny:
    model: Any
    sites: int
    given: dict[str, Any]
    valid: torch.Tensor | None
    before: list[torch.Tensor]


def _tiny(model_type: str, class_name: str) -> Tiny | tuple[int | None, str] | None:
    """The model built tiny on the CPU with inputs it runs on, its interface sites,
    and its untouched output; or (its interface sites, why not); ``None``: no
    interface site."""
    try:
        cls = getattr(transformers, class_name, None)
    except Exception as exc:  # named, but its module does not import here (an optional package)
        return None, f"not built: {_why(exc)}"
    if cls is None:  # as in the coverage table: the class transformers names is not exported
        return None, f"not built: transformers exports no {class_name}"
    failures: list[str] = []
    count = 0
    for kv_heads in _RUNGS:
        try:
            config = _config(model_type, kv_heads)
            meta = build(cls, config, "meta")
        except Exception as exc:
            failures.append(f"not built: {_why(exc)}")
            continue
        params = sum(p.numel() for p in meta.parameters())
        count = len(_interface(itf.plan(meta, "transformer")))
        del meta
        if count == 0:
            return None
        if params > MAX_PARAMS:
            failures.append(f"not tiny: {params / 1e6:.0f}M parameters")
            continue
        torch.manual_seed(0)
        try:
            model = build(cls, config, "cpu")
        except Exception as exc:
            failures.append(f"not built: {_why(exc)}")
            continue
        ran = _first_run(model)
        if isinstance(ran, str):
            failures.append(ran)
            del model
            continue
        return Tiny(model, count, *ran)
    return count, failures[0]


def _implementations(model: Any) -> list[tuple[Any, Any]]:
    """Each config of ``model``'s modules with the attention implementation it holds."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    return [(c, getattr(c, "_attn_implementation_internal", None)) for c in configs.values()]


def _first_run(model: Any) -> tuple[dict[str, Any], torch.Tensor | None, list[torch.Tensor]] | str:
    """The first generic inputs the model runs on, deterministically and with
    transformers' own ``eager`` too (an explicit ``eager`` must be able to run);
    or why none."""
    why = "not run: its forward takes none of the generic inputs"
    for given, valid in candidates(model):
        missing = required(model, given)
        if missing is not None:
            why = f"not run: its forward requires {missing!r}"
            continue
        try:
            before = _forward(model, given)
        except Exception as exc:
            why = f"not run: {_why(exc)}"
            continue
        held = _implementations(model)
        try:
            model.set_attn_implementation("eager")
            _forward(model, given)
        except Exception as exc:
            return f"not run: transformers' own eager raises {_why(exc)}"
        finally:
            # each config back as it was: a model whose sub-configs differ (MaskFormer:
            # an eager backbone, an sdpa decoder) is not restored by setting one value
            for config, implementation in held:
                config._attn_implementation_internal = implementation
        if not identical(_forward(model, given), before):
            return "not run: its output is not deterministic"
        return given, valid, before
    return why


def _row(model_type: str, class_name: str) -> Row | None:
    """The type's row (``None``: its base model has no interface site)."""
    built = _tiny(model_type, class_name)
    if built is None:
        return None
    if isinstance(built, tuple):
        return Row(model_type, built[0], ("-", "-", "-", built[1]))
    try:
        return _checks(model_type, built)
    except Exception as exc:  # a crash of the sweep itself is a finding too
        return Row(model_type, built.sites, ("-", "-", "-", ""), (f"crashed: {_why(exc)}",))
    finally:
        del built
        gc.collect()


def _checks(model_type: str, tiny: Tiny) -> Row:
    problems: list[str] = []
    model, given, valid, before, count = tiny.model, tiny.given, tiny.valid, tiny.before, tiny.sites
    untouched = _snapshot(model)
    # (a) no flag: bit-identical, the calls the plan's, remove exact
    try:
        plan = itf.apply(model, "text_encoder")
        with _spying(model) as seen:
            after = _forward(model, given)
    except Exception as exc:
        itf.remove(model)
        return Row(model_type, count, ("RAISED", "-", "-", ""), (f"no flag: raised {_why(exc)}",))
    removed = itf.remove(model)
    reached, wrong = _calls_match(plan, seen, None)
    same = identical(after, before)
    restored = _same(_snapshot(model), untouched) and identical(_forward(model, given), before)
    problems += [f"no flag: {w}" for w in wrong]
    if not same:
        problems.append("no flag: output not bit-identical")
    if not restored:
        problems.append(f"no flag: remove ({removed}) did not restore the model")
    no_flag = (
        f"{'bit-identical' if same else 'DIFFERS'}, {reached} called"
        + (" (WRONG CALLS)" if wrong else "")
        + (", restored" if restored else ", NOT RESTORED")
    )
    # (b) an explicit eager, strict
    eager = _explicit(model, given, EAGER, "eager", untouched, problems)
    # (c) torch_sdpa, strict: the calls the plan's, the output close on valid positions
    sdpa = _explicit(model, given, SDPA, "sdpa", untouched, problems, before[0], valid)
    return Row(model_type, count, (no_flag, eager, sdpa, ""), tuple(problems))


def _explicit(
    model: Any,
    given: dict[str, Any],
    config: SelectionConfig,
    function: str,
    untouched: Any,
    problems: list[str],
    reference: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> str:
    try:
        plan = itf.apply(model, "transformer", config)
    except IntegrationError as exc:
        errors = [s.error for s in exc.plan.sites if s.error] if exc.plan else []
        codes = sorted({e.code for e in errors})
        # a class that opts out of other attention functions keeps its own (the
        # error names the flag); anything else refused is a finding
        if function == "eager" or not errors or not set(codes) <= KERNEL_LIMITS:
            problems.append(f"{function}: refused at apply: {_why(exc)}")
        opt_out = {
            m.group(0) for e in errors if (m := re.search(r"_supports_\w+ = False", e.message))
        }
        return f"refused ({', '.join(sorted(opt_out)) or ', '.join(codes) or 'no site error'})"
    try:
        with _spying(model) as seen:
            out = _forward(model, given)
    except Exception as exc:
        problems.append(f"{function}: the forward raised {_why(exc)}")
        return "RAISED"
    finally:
        itf.remove(model)
    reached, wrong = _calls_match(plan, seen, function)
    problems += [f"{function}: {w}" for w in wrong]
    if not _same(_snapshot(model), untouched):
        problems.append(f"{function}: remove did not restore the model")
    cell = f"{reached} {function}" + (" (WRONG CALLS)" if wrong else "")
    if reference is not None:
        got, want = out[0], reference
        if valid is not None and tuple(got.shape[:2]) == tuple(valid.shape):
            got, want = got[valid], want[valid]
        got, want = got.double(), want.double()
        error = float((got - want).norm() / want.norm().clamp_min(1e-12))
        if not error < SDPA_TOLERANCE:
            problems.append(f"sdpa: output differs (relative error {error:.1e})")
        cell += ", matches" if error < SDPA_TOLERANCE else f", DIFFERS ({error:.0e})"
    return cell


def _selected() -> list[tuple[str, str]]:
    types = _model_types()
    return types if FULL else types[::STRIDE]


def _rows(types: list[tuple[str, str]]) -> Iterator[Row]:
    logging.disable(logging.WARNING)
    try:
        for model_type, class_name in types:
            row = _row(model_type, class_name)
            if row is not None:
                yield row
    finally:
        logging.disable(logging.NOTSET)


def _table(rows: list[Row]) -> str:
    ran = [r for r in rows if not r.cells[3]]
    return "\n".join(
        [
            f"transformers {transformers.__version__}: {len(rows)} model types whose base "
            f"model has interface sites (of {len(_model_types())} in `MODEL_MAPPING_NAMES`), "
            f"{len(ran)} built tiny and run on the CPU, {len(rows) - len(ran)} not (why: "
            f"the last column); *called*: the interface sites the inputs reach.",
            "",
            "| model type | interface sites | no flag | eager, strict | torch_sdpa, strict | "
            "not run: why |",
            "|---|---|---|---|---|---|",
            *(r.line() for r in rows),
        ]
    )


def _table_version(block: str) -> str:
    """The transformers the generated table ``block`` was made with (its first
    line says so)."""
    found = re.match(r"\s*transformers (\S+):", block)
    assert found, f"{DOC.name}: the generated table starts with the transformers version"
    return found.group(1)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_model_type_with_interface_sites_runs_tiny_as_planned(
    update_golden: Any, chunk: int
) -> None:
    types = _selected()[chunk::CHUNKS]
    rows = list(_rows(types))
    # the table is the newest transformers'; on an older one the extras admit (make
    # test-oldest) every row is still checked below, but not against the table
    block = DOC.read_text(encoding="utf-8").partition(BEGIN)[2].partition(END)[0]
    tabled = transformers.__version__ == _table_version(block)
    if FULL and (tabled or update_golden):
        # written first, so that a failure below can be read in the table; with
        # --update-golden on another release too (how the pin moves to it)
        check_generated(DOC, BEGIN, END, _table(rows), update_golden)
    names = {t for t, _ in types}
    problems = {r.model_type: r.problems for r in rows if r.problems}
    assert {t: p for t, p in problems.items() if t not in _FINDINGS} == {}
    ran = {r.model_type for r in rows if not r.cells[3]}
    closed = (set(_FINDINGS) & ran) - set(problems)
    assert closed == set(), "findings that no longer are: drop them from _FINDINGS"
    not_run = {r.model_type: r.cells[3] for r in rows if r.cells[3]}
    older = _NOT_RUN_ON.get(transformers.__version__, {})
    expected = {t for t in (set(_NOT_RUN) | set(older)) if older.get(t, "") is not None}
    assert set(not_run) == expected & names, (
        "the types not run changed: update _NOT_RUN (or _NOT_RUN_ON for an older version): "
        f"not run now but not listed {sorted(set(not_run) - expected)}, listed but run now "
        f"{sorted((expected & names) - set(not_run))}"
    )
    if FULL or not tabled:
        return
    # the default run checks its rows against the table the full sweep generated
    table = {line.split("|")[1].strip(): line for line in block.splitlines() if "|" in line}
    assert [r.line() for r in rows] == [table.get(r.model_type) for r in rows]
    # a type the subset takes that is not in the table has no interface site
    assert {t for t in names if t in table} == {r.model_type for r in rows}


def test_the_runtime_table_is_the_tested_transformers() -> None:
    # the table a default run checks its rows against is the release make setup
    # installs (tests/tested-versions.txt): moving one moves the other
    block = DOC.read_text(encoding="utf-8").partition(BEGIN)[2].partition(END)[0]
    assert _table_version(block) == pinned_release("transformers")
