"""CLIP text encoders (OpenAI's ViT-L/14 text model, OpenCLIP's ViT-bigG/14 one): the official configs, their key
names in the released files, and prompts as CLIP reads them (77 tokens, padded to that length).

transformers >= 5 names `CLIPTextModel`'s tensors without the `text_model.` level the released files have, while
`CLIPTextModelWithProjection` keeps it; `clip_text_key` and `clip_projection_key` map either layout to the class's."""

from __future__ import annotations

import torch

from ..errors import UserError

MAX_LENGTH = 77

# openai/clip-vit-large-patch14's text model (FLUX.1's text_encoder/, SD 1.5's and SDXL's text_encoder/).
CLIP_L_TEXT_CONFIG = {
    "architectures": ["CLIPTextModel"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "projection_dim": 768,
    "vocab_size": 49408,
}

# laion/CLIP-ViT-bigG-14's text model with its projection (SDXL's text_encoder_2/).
CLIP_BIGG_TEXT_CONFIG = {
    **CLIP_L_TEXT_CONFIG,
    "architectures": ["CLIPTextModelWithProjection"],
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "projection_dim": 1280,
}

CLIP_TEXT_MARKER_KEYS = ("embeddings.token_embedding.weight", "final_layer_norm.weight")
CLIP_PROJECTION_MARKER_KEYS = ("text_model.embeddings.token_embedding.weight", "text_model.final_layer_norm.weight",
                               "text_projection.weight")


def clip_text_key(key: str) -> str:
    """A released CLIPTextModel key (`text_model.*`) -> transformers 5's name (no such level)."""
    return key[len("text_model."):] if key.startswith("text_model.") else key


def clip_projection_key(key: str) -> str:
    """A CLIPTextModelWithProjection key without the `text_model.` level (a file saved by a CLIPTextModel of
    transformers 5) -> the class's name (with it)."""
    if key.startswith(("text_model.", "text_projection.")):
        return key
    return "text_model." + key


def clip_from_prefix(prefix: str):
    """The converter of a CLIP-L text model stored in a single checkpoint behind `prefix` (SD 1.x's
    `cond_stage_model.transformer.`, SDXL's `conditioner.embedders.0.transformer.`): its tensors in CLIPTextModel's
    names; nothing from a file without them."""
    def convert(state: dict) -> dict:
        return {clip_text_key(k[len(prefix):]): v for k, v in state.items()
                if k.startswith(prefix) and not k.endswith("position_ids")}  # a buffer older saves kept

    return convert


def open_clip_from_prefix(prefix: str):
    """The converter of an OpenCLIP text tower stored behind `prefix` (SDXL's `conditioner.embedders.1.model.`: fused
    in_proj, resblocks, ln_final, a (hidden, projection) text_projection) in CLIPTextModelWithProjection's names, by
    diffusers' own converter; nothing from a file without it."""
    def convert(state: dict) -> dict:
        if f"{prefix}token_embedding.weight" not in state:
            return {}
        from types import SimpleNamespace

        from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

        width = int(state[f"{prefix}token_embedding.weight"].shape[1])
        part = {k: v for k, v in state.items() if k.startswith(prefix)}
        return convert_open_clip_checkpoint(SimpleNamespace(config=SimpleNamespace(hidden_size=width)), part, prefix)

    return convert


def token_ids(tokenizer, prompts: list[str], device, missing: str = "no CLIP tokenizer") -> torch.Tensor:
    """Prompts padded / truncated to the tokenizer's 77 tokens (diffusers' CLIP prompt encoding); `missing` is the
    message where there is no tokenizer (the family's, naming its flag)."""
    if tokenizer is None:
        raise UserError(missing)
    return tokenizer(prompts, padding="max_length", max_length=min(tokenizer.model_max_length, MAX_LENGTH),
                     truncation=True, return_tensors="pt").input_ids.to(device)


__all__ = ["CLIP_BIGG_TEXT_CONFIG", "CLIP_L_TEXT_CONFIG", "CLIP_PROJECTION_MARKER_KEYS", "CLIP_TEXT_MARKER_KEYS",
           "MAX_LENGTH", "clip_from_prefix", "clip_projection_key", "clip_text_key", "open_clip_from_prefix",
           "token_ids"]
