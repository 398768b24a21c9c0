"""Tiny builders for the shared parts `difftune.parts.qwen3_vl` (Qwen3-VL text encoder) and
`difftune.parts.qwen_image_vae` (the Qwen-Image VAE), in the layouts of their hub repositories: Qwen/Qwen3-VL-*-Instruct
keeps its causal LM (`model.language_model.*`, `model.visual.*`, config.json) and its tokenizer at the repository
root; Qwen/Qwen-Image keeps the VAE in `vae/`. Seeded: two processes write identical files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .common import quiet_hf

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>"]


@dataclass
class TinyQwen3VLSpec:
    hidden: int = 64
    layers: int = 4
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 32
    intermediate: int = 128
    vision_hidden: int = 32
    vision_depth: int = 2
    tie_word_embeddings: bool = True  # the 4B ties its head; the 8B stores one
    seed: int = 0


def qwen3_vl_tokenizer():
    """A byte-level Qwen2 tokenizer with no merges (one token per byte), the Qwen special tokens and
    `<|endoftext|>` as padding, as Qwen3-VL's. Hand-built, so identical in every process."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tok.pad_token = "<|endoftext|>"
    tok.model_max_length = 4096
    return tok


def tiny_qwen3_vl(spec: TinyQwen3VLSpec | None = None, vocab_size: int = 300):
    """transformers' Qwen3VLForConditionalGeneration (what the official files hold) at tiny sizes, every part kept
    (interleaved mRoPE, q/k norms, the vision tower with a deepstack merger)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    spec = spec or TinyQwen3VLSpec()
    half = spec.head_dim // 2
    section = [half - 2 * (half // 4), half // 4, half // 4]
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000, "mrope_section": section,
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden,
                           intermediate_size=2 * spec.vision_hidden, num_heads=2, out_hidden_size=spec.hidden,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        tie_word_embeddings=spec.tie_word_embeddings)
    torch.manual_seed(spec.seed)
    return Qwen3VLForConditionalGeneration(config).eval()


def write_tiny_qwen3_vl(folder: str | os.PathLike, spec: TinyQwen3VLSpec | None = None) -> Path:
    """A tiny Qwen/Qwen3-VL-*-Instruct repository: config.json, model.safetensors (causal-LM names) and the
    tokenizer files at the root."""
    quiet_hf()
    folder = Path(folder)
    tok = qwen3_vl_tokenizer()
    model = tiny_qwen3_vl(spec, vocab_size=len(tok))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_qwen_image_vae(seed: int = 1, base_dim: int = 8):
    """diffusers' AutoencoderKLQwenImage at a tiny width: x8 down (four levels), 16 latent channels, the official
    latent statistics."""
    from diffusers import AutoencoderKLQwenImage

    from difftune.parts.qwen_image_vae import QWEN_IMAGE_VAE_CONFIG

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(base_dim=base_dim, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                  temperal_downsample=[False, True, True],
                                  latents_mean=QWEN_IMAGE_VAE_CONFIG["latents_mean"],
                                  latents_std=QWEN_IMAGE_VAE_CONFIG["latents_std"])


def write_tiny_qwen_image_vae(folder: str | os.PathLike, seed: int = 1, base_dim: int = 8) -> Path:
    """`vae/` of a tiny Qwen/Qwen-Image: config.json + diffusion_pytorch_model.safetensors."""
    quiet_hf()
    folder = Path(folder)
    tiny_qwen_image_vae(seed, base_dim).save_pretrained(folder)
    return folder


__all__ = ["QWEN_SPECIAL_TOKENS", "TinyQwen3VLSpec", "qwen3_vl_tokenizer", "tiny_qwen3_vl", "tiny_qwen_image_vae",
           "write_tiny_qwen3_vl", "write_tiny_qwen_image_vae"]
