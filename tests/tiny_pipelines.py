"""Tiny offline diffusers pipelines (small configs, tokenizers built in memory).

Shared by the integration tests and benchmarks; nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch


def _tokenizer(fast_cls: Any, **special: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["a", "cat", "dog", "on", "the", "mat", "red", "blue"]
    specials = list(dict.fromkeys(special.values()))
    vocab = {w: i for i, w in enumerate([*specials, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return fast_cls(tokenizer_object=tok, **special)


def clip_text_encoder(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = CLIPTextConfig(
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=77,
        projection_dim=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = CLIPTextModel(config).eval().to(dtype)
    tok = _tokenizer(
        PreTrainedTokenizerFast,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        unk_token="<unk>",
    )
    tok.model_max_length = 77
    return model, tok


def t5_text_encoder(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    torch.manual_seed(1)
    config = T5Config(
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_heads=4,
        num_layers=2,
        vocab_size=64,
        relative_attention_num_buckets=8,
    )
    model = T5EncoderModel(config).eval().to(dtype)
    tok = _tokenizer(
        PreTrainedTokenizerFast, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tok.model_max_length = 512
    return model, tok


def flux(
    head_dim: int = 16, dtype: torch.dtype = torch.float32, vae_dtype: torch.dtype = torch.float32
) -> Any:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    text, tok = clip_text_encoder(dtype)
    t5, tok2 = t5_text_encoder(dtype)
    torch.manual_seed(2)
    rope = [head_dim // 4, head_dim // 4, head_dim // 2]
    transformer = (
        FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=head_dim,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=rope,
        )
        .eval()
        .to(dtype)
    )
    torch.manual_seed(3)
    vae = (
        AutoencoderKL(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            block_out_channels=(4,),
            layers_per_block=1,
            latent_channels=1,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
        .eval()
        .to(vae_dtype)
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=tok2,
        transformer=transformer,
        vae=vae,
    )


def run_flux(pipe: Any) -> torch.Tensor:
    out = pipe(
        prompt="a red cat",
        num_inference_steps=2,
        guidance_scale=3.5,
        height=16,
        width=16,
        max_sequence_length=16,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    )
    return out.images


def flux_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, 16, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": True,
    }


def sd3() -> dict[str, Any]:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(4)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    ).eval()
    return {"transformer": transformer}


def sd3_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(1, 6, 32, generator=g),
        "pooled_projections": torch.randn(1, 64, generator=g),
        "timestep": torch.tensor([10]),
    }


def unet() -> Any:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(5)
    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=2,
        norm_num_groups=32,
        mid_block_type=None,
    ).eval()


def unet_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "sample": torch.randn(1, 4, 8, 8, generator=g),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 6, 32, generator=g),
    }


def wan() -> dict[str, Any]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(6)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()
    text = UMT5EncoderModel(
        UMT5Config(
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_heads=4,
            num_layers=2,
            vocab_size=64,
            relative_attention_num_buckets=8,
        )
    ).eval()
    return {"text_encoder": text, "transformer": transformer, "vae": vae}


def wan_vae_input() -> torch.Tensor:
    return torch.randn(1, 3, 1, 16, 16, generator=torch.Generator().manual_seed(0))


# --- issue 22: whole pipelines and DiTs that pass a text-padding mask ---------

#: the words of QwenImagePipeline's prompt template (diffusers 0.42.1) and of the
#: test prompts; the tokenizer splits on spaces, newlines and punctuation, so the
#: template's system part is 34 tokens, as ``prompt_template_encode_start_idx``
#: expects of the real Qwen2 tokenizer
_QWEN_WORDS = (
    "system Describe the image by detailing color shape size texture quantity text "
    "spatial relationships of objects and background user assistant a cat dog on mat red blue"
)


def qwen_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    words = dict.fromkeys([*specials, "\n", ",", ":", *_QWEN_WORDS.split()])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" +"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Punctuation("isolated"),
    ])  # fmt: skip
    return Qwen2TokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
        eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )  # fmt: skip


def qwen_image_transformer() -> Any:
    """The tiny Qwen-Image DiT of diffusers' own pipeline test (below)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )  # fmt: skip


def qwen_image(dtype: torch.dtype = torch.bfloat16) -> Any:
    """A whole tiny ``QwenImagePipeline``: the components and configs of
    diffusers' own pipeline test (huggingface/diffusers,
    tests/pipelines/qwenimage/test_qwenimage.py, ``get_dummy_components``), with
    the tokenizer built in memory and the vocabulary cut to it."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer()
    transformer = qwen_image_transformer()
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
        temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )  # fmt: skip
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                             "type": "default"},
            "rope_theta": 1000000.0,
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16,
                       "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16, vocab_size=len(tokenizer), vision_end_token_id=151653,
        vision_start_token_id=151652, vision_token_id=151654,
    )  # fmt: skip
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval().to(dtype),
        text_encoder=text_encoder.eval().to(dtype), tokenizer=tokenizer,
        transformer=transformer.eval().to(dtype),
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_qwen_image(pipe: Any) -> torch.Tensor:
    """Two prompts of different lengths (6 and 2 words): a padded batch."""
    out = pipe(
        prompt=["a red cat on the mat", "a dog"], num_inference_steps=2, true_cfg_scale=1.0,
        height=32, width=32, max_sequence_length=16, output_type="pt",
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    return out.images


#: two prompts of 6 and 3 tokens, padded to 8 on the right (as the pipelines'
#: tokenizers pad)
def _text_mask() -> torch.Tensor:
    return torch.tensor([[1] * 6 + [0] * 2, [1] * 3 + [0] * 5])


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def hunyuan_video(dtype: torch.dtype = torch.bfloat16) -> Any:
    """A whole tiny ``HunyuanVideoPipeline``: the components and configs of
    huggingface/diffusers, tests/pipelines/hunyuan_video/test_hunyuan_video.py
    (``get_dummy_components``), with tokenizers built in memory; DiT and text
    encoders in ``dtype``, the VAE in float32."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        LlamaConfig,
        LlamaModel,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(0)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, act_fn="silu", norm_num_groups=4, scaling_factor=0.476986,
        spatial_compression_ratio=8, temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = LlamaModel(LlamaConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=16, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, pad_token_id=1, vocab_size=64,
        hidden_act="gelu",
    ))  # fmt: skip
    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=8, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, pad_token_id=1, vocab_size=64,
        hidden_act="gelu", projection_dim=32,
    ))  # fmt: skip
    tok = _tokenizer(PreTrainedTokenizerFast, bos_token="<s>", pad_token="<pad>",
                     eos_token="</s>", unk_token="<unk>")  # fmt: skip
    tok2 = _tokenizer(PreTrainedTokenizerFast, bos_token="<s>", eos_token="</s>",
                      pad_token="</s>", unk_token="<unk>")  # fmt: skip
    tok2.model_max_length = 77
    pipe = HunyuanVideoPipeline(
        transformer=transformer.eval().to(dtype), vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=llama.eval().to(dtype), text_encoder_2=clip.eval().to(dtype),
        tokenizer=tok, tokenizer_2=tok2,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_hunyuan_video(pipe: Any) -> torch.Tensor:
    """Two prompts of different lengths, padded to 16 tokens (with the prompt
    template of diffusers' own test: the prompt alone)."""
    out = pipe(
        prompt=["a red cat on the mat", "a dog"],
        prompt_template={"template": "{}", "crop_start": 0}, num_inference_steps=2,
        guidance_scale=4.5, height=16, width=16, num_frames=1, max_sequence_length=16,
        output_type="pt", generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    return out.frames


def ltx2(dtype: torch.dtype = torch.bfloat16, side: int = 4) -> tuple[Any, dict[str, Any]]:
    """A tiny LTX-2 audio-video DiT (``get_init_dict`` of huggingface/diffusers,
    tests/models/transformers/test_models_transformer_ltx2.py) and a batch of
    two padded prompts (8 tokens) for video (2 x side x side tokens) and audio."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
        audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=16, rope_double_precision=False,
    ).eval().to(dtype)  # fmt: skip
    inputs = {
        "hidden_states": _randn(2, 2 * side * side, 4, seed=1).to(dtype),
        "audio_hidden_states": _randn(2, 5, 4, seed=2).to(dtype),
        "encoder_hidden_states": _randn(2, 8, 16, seed=3).to(dtype),
        "audio_encoder_hidden_states": _randn(2, 8, 16, seed=4).to(dtype),
        "timestep": torch.tensor([500.0, 500.0]),
        "encoder_attention_mask": _text_mask().bool(),
        "audio_encoder_attention_mask": _text_mask().bool(),
        "num_frames": 2, "height": side, "width": side, "audio_num_frames": 5, "fps": 25.0,
        "return_dict": False,
    }  # fmt: skip
    return model, inputs


def ltx2_connectors(
    registers: int | None, dtype: torch.dtype = torch.bfloat16
) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    """LTX-2's prompt connectors (the ``LTX2TextConnectors`` config of
    huggingface/diffusers, tests/pipelines/ltx2/testing_utils.py, for a 32-wide text
    encoder of 2 layers) and two padded prompts' stacked hidden states and mask."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    torch.manual_seed(0)
    model = LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=3, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=registers,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=registers,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split",
    ).eval().to(dtype)  # fmt: skip
    return model, (_randn(2, 8, 32, 3, seed=5).to(dtype), _text_mask())


def chroma(dtype: torch.dtype = torch.bfloat16) -> Any:
    """A whole tiny ``ChromaPipeline``: the DiT of huggingface/diffusers,
    tests/models/transformers/test_models_transformer_chroma.py, the tiny T5 and VAE
    above."""
    from diffusers import (
        AutoencoderKL,
        ChromaPipeline,
        ChromaTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )

    t5, tok = t5_text_encoder(dtype)
    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8],
    ).eval().to(dtype)  # fmt: skip
    torch.manual_seed(3)
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
        layers_per_block=1, latent_channels=1, norm_num_groups=1,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()  # fmt: skip
    return ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=t5,
        tokenizer=tok,
        transformer=transformer,
        vae=vae,
    )


def gemma_tokenizer() -> Any:
    """A Gemma tokenizer built in memory: the special tokens of the Gemma3 config
    below at its ids (pad 0, bos 1, eos 2; image 4, begin/end of image 5/6), then
    the test words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GemmaTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<image_soft_token>", "<start_of_image>",
                "<end_of_image>"]  # fmt: skip
    words = ["a", "cat", "dog", "on", "the", "mat", "red", "blue"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*specials, *words])},
                                     unk_token="<unk>"))  # fmt: skip
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return GemmaTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>",
    )  # fmt: skip


def gemma3_text_encoder() -> Any:
    """A tiny ``Gemma3ForConditionalGeneration``: the text config of transformers'
    own Gemma3 tests (huggingface/transformers, tests/models/gemma3/
    test_modeling_gemma3.py: ``Gemma3ModelTester`` is ``GemmaModelTester``, whose
    values are ``CausalLMModelTester``'s defaults in tests/causal_lm_tester.py) and
    the vision config and image tokens of its ``Gemma3Vision2TextModelTester``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config={
            "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 37, "hidden_act": "gelu", "max_position_embeddings": 512,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        },
        vision_config={
            "image_size": 20, "patch_size": 5, "num_channels": 3, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37,
        },
        image_token_index=4, boi_token_index=5, eoi_token_index=6, mm_tokens_per_image=2,
    )  # fmt: skip
    return Gemma3ForConditionalGeneration(config)


def ltx2_pipeline(dtype: torch.dtype = torch.bfloat16) -> Any:
    """A whole tiny ``LTX2Pipeline``: the components and configs of diffusers' own
    pipeline test (huggingface/diffusers, tests/pipelines/ltx2/testing_utils.py,
    ``get_ltx2_dummy_components``), with the Gemma3 text encoder that test loads
    from the hub (hf-internal-testing/tiny-gemma3) built from transformers' own
    Gemma3 test config instead (:func:`gemma3_text_encoder`), and its tokenizer in
    memory. The DiT, the connectors and the text encoder run in ``dtype``."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    text_encoder = gemma3_text_encoder()
    width = text_encoder.config.text_config.hidden_size
    layers = text_encoder.config.text_config.num_hidden_layers
    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
        audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=width, rope_double_precision=False, rope_type="split",
    )  # fmt: skip
    connectors, _ = ltx2_connectors(None, dtype)
    assert connectors.config.caption_channels == width
    assert connectors.config.text_proj_in_factor == layers + 1
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
        decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )  # fmt: skip
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(0)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1,
        attn_resolutions=None, in_channels=2, resolution=32, latent_channels=2,
        norm_type="pixel", causality_axis="height", dropout=0.0, mid_block_add_attention=False,
        sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    )  # fmt: skip
    torch.manual_seed(0)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    )  # fmt: skip
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), audio_vae=audio_vae.eval(),
        text_encoder=text_encoder.eval().to(dtype), tokenizer=gemma_tokenizer(),
        connectors=connectors, transformer=transformer.eval().to(dtype),
        vocoder=vocoder.eval(),
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_ltx2_pipeline(pipe: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of different lengths (6 and 2 words), left-padded to 16 tokens by
    the pipeline; the sampling knobs of diffusers' own test (``get_dummy_inputs``)."""
    out = pipe(
        prompt=["a red cat on the mat", "a dog"], negative_prompt=["", ""],
        num_inference_steps=2, guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0,
        guidance_rescale=0.0, audio_guidance_scale=1.0, audio_stg_scale=0.0,
        audio_modality_scale=1.0, audio_guidance_rescale=0.0,
        spatio_temporal_guidance_blocks=None, use_cross_timestep=False, height=32, width=32,
        num_frames=5, frame_rate=25.0, max_sequence_length=16, output_type="pt",
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    return out.frames, out.audio
