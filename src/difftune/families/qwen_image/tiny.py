"""A tiny, randomly initialised Qwen-Image in the official layout: the model `difftune example-workspace` writes
(where the reference's command lines find `Qwen/Qwen-Image`) and the starting point of the demo's bundled model
(scripts/make_base_model.py). The tests build their tiny repositories with it too (tests/support/qwen_image/)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The official Qwen/Qwen-Image scheduler/scheduler_config.json.
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>"]

# Where the example workspace puts the model: the hub id the reference's commands name, under models/.
EXAMPLE_MODEL_ID = "Qwen/Qwen-Image"


@dataclass
class TinyQwenImageSpec:
    """Sizes of a tiny Qwen-Image. Defaults are the smallest that keep every architectural feature."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple = (8, 4, 4)  # sums to attention_head_dim
    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_intermediate: int = 64
    mrope_section: tuple = (2, 3, 3)  # sums to text head_dim / 2
    vae_base_dim: int = 8
    vae_dim_mult: tuple = (1, 1, 1, 1)  # 4 entries -> x8 spatial downsampling, as the real VAE
    vae_num_res_blocks: int = 1
    zero_cond_t: bool = False
    layered: bool = False  # Qwen-Image-Layered: the "is RGB" embedding, layer-3D RoPE, an RGBA VAE
    seed: int = 0
    extra: dict = field(default_factory=dict)


def qwen_tokenizer():
    """A byte-level Qwen2 tokenizer with no merges (one token per byte) and the Qwen special tokens.

    Hand-built, so its vocabulary is identical in every process (trained tokenizers are not).
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tok.model_max_length = 2048
    return tok


def tiny_qwen_transformer(spec: TinyQwenImageSpec):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(spec.seed)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=spec.num_layers,
        attention_head_dim=spec.attention_head_dim, num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.text_hidden, guidance_embeds=False, axes_dims_rope=tuple(spec.axes_dims_rope),
        zero_cond_t=spec.zero_cond_t, use_additional_t_cond=spec.layered, use_layer3d_rope=spec.layered,
    )


def tiny_qwen_vae(spec: TinyQwenImageSpec):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(spec.seed + 1)
    return AutoencoderKLQwenImage(base_dim=spec.vae_base_dim, z_dim=16, dim_mult=list(spec.vae_dim_mult),
                                  num_res_blocks=spec.vae_num_res_blocks, temperal_downsample=[False, True, True],
                                  input_channels=4 if spec.layered else 3)


def tiny_qwen_text_encoder(spec: TinyQwenImageSpec, tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(spec.seed + 2)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads, num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(spec.mrope_section)},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=tok.pad_token_id),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=spec.text_hidden,
                           fullatt_block_indexes=[1], window_size=112),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def write_tiny_qwen_image(path: str | os.PathLike, spec: TinyQwenImageSpec | None = None, *, edit: bool = False,
                          shard: bool = True, edit_plus: bool = False) -> Path:
    """Write a tiny Qwen-Image (or Qwen-Image-Edit with `edit=True`, Qwen-Image-Edit-2509 with `edit_plus=True`;
    -2511 is that with `TinyQwenImageSpec(zero_cond_t=True)`) repository to `path`.

    Layout, as on the hub: `model_index.json`, `scheduler/`, `tokenizer/`, `transformer/` (sharded
    `diffusion_pytorch_model-0000N-of-0000M.safetensors` + index), `text_encoder/` (sharded
    `model-0000N-of-0000M.safetensors` + index), `vae/diffusion_pytorch_model.safetensors`, and for the
    edit model `processor/`.
    """
    spec = spec or TinyQwenImageSpec()
    edit = edit or edit_plus
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = qwen_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    transformer = tiny_qwen_transformer(spec)
    text_encoder = tiny_qwen_text_encoder(spec, tok)
    vae = tiny_qwen_vae(spec)
    # Small shard sizes force several shards, as in the real repositories.
    transformer.save_pretrained(root / "transformer", max_shard_size="100KB" if shard else "10GB")
    text_encoder.save_pretrained(root / "text_encoder", max_shard_size="100KB" if shard else "10GB")
    vae.save_pretrained(root / "vae")
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_IMAGE_SCHEDULER_CONFIG, indent=2))
    index = {
        "_class_name": "QwenImageEditPlusPipeline" if edit_plus else "QwenImageEditPipeline" if edit else
                       "QwenImageLayeredPipeline" if spec.layered else "QwenImagePipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    if edit:
        # The official processor/ folder holds the Qwen2-VL image processor config and the tokenizer.
        # Written piecewise: transformers' Qwen2VLProcessor also wants a video processor (torchvision).
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil().save_pretrained(root / "processor")
        tok.save_pretrained(root / "processor")
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    (root / "difftune_tiny_spec.json").write_text(json.dumps(spec.__dict__, indent=2, default=list))
    return root


def write_example_model(models: str | os.PathLike) -> Path:
    """The example workspace's model: a tiny Qwen-Image at `<models>/Qwen/Qwen-Image`, where the hub id resolves."""
    return write_tiny_qwen_image(Path(models) / EXAMPLE_MODEL_ID)
