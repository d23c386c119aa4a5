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
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=64, max_position_embeddings=77, projection_dim=32,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    model = CLIPTextModel(config).eval().to(dtype)
    tok = _tokenizer(PreTrainedTokenizerFast, bos_token="<s>", eos_token="</s>",
                     pad_token="</s>", unk_token="<unk>")
    tok.model_max_length = 77
    return model, tok


def t5_text_encoder(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    torch.manual_seed(1)
    config = T5Config(d_model=32, d_kv=8, d_ff=37, num_heads=4, num_layers=2,
                      vocab_size=64, relative_attention_num_buckets=8)
    model = T5EncoderModel(config).eval().to(dtype)
    tok = _tokenizer(PreTrainedTokenizerFast, pad_token="<pad>", eos_token="</s>",
                     unk_token="<unk>")
    tok.model_max_length = 512
    return model, tok


def flux(head_dim: int = 16, dtype: torch.dtype = torch.float32,
         vae_dtype: torch.dtype = torch.float32) -> Any:
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
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=head_dim, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=rope,
    ).eval().to(dtype)
    torch.manual_seed(3)
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
        layers_per_block=1, latent_channels=1, norm_num_groups=1,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
        scaling_factor=1.5035,
    ).eval().to(vae_dtype)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=text, tokenizer=tok,
        text_encoder_2=t5, tokenizer_2=tok2, transformer=transformer, vae=vae,
    )


def run_flux(pipe: Any) -> torch.Tensor:
    out = pipe(
        prompt="a red cat", num_inference_steps=2, guidance_scale=3.5, height=16, width=16,
        max_sequence_length=16, output_type="pt",
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
        sample_size=8, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=4,
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
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=2, norm_num_groups=32, mid_block_type=None,
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
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()
    text = UMT5EncoderModel(UMT5Config(d_model=32, d_kv=8, d_ff=37, num_heads=4,
                                       num_layers=2, vocab_size=64,
                                       relative_attention_num_buckets=8)).eval()
    return {"text_encoder": text, "transformer": transformer, "vae": vae}


def wan_vae_input() -> torch.Tensor:
    return torch.randn(1, 3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
