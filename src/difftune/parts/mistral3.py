"""Mistral-3 as a text encoder: its language models' configs, the key layouts its files come in, and a config read
off the weights.

Two releases use it: ERNIE-Image (PaddlePaddle/ERNIE-Image `text_encoder/`, a `Mistral3Model` around Ministral-3 3B,
which diffusers' pipeline reads the second-to-last hidden state of) and FLUX.2-dev (`text_encoder/`, a
`Mistral3ForConditionalGeneration` around Mistral-Small-3.1 24B). A prompt encoder only runs the language model, so
that backbone alone (transformers' `Ministral3Model` / `MistralModel`) is what `text_key` + `drop_non_text` load; the
vision tower, projector and LM head are never read. Its hidden states equal the multimodal model's for text input.

Files come in three layouts: transformers 4's (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*`, both official files), transformers 5's `Mistral3Model` (`language_model.*`) and
`Mistral3ForConditionalGeneration` (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`).
"""

from __future__ import annotations

import math

# PaddlePaddle/ERNIE-Image text_encoder: the text config of Ministral-3 3B (tied embeddings, YaRN RoPE).
MINISTRAL3_3B_TEXT_CONFIG = {
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 262144,
    "model_type": "ministral3",
    "num_attention_heads": 32,
    "num_hidden_layers": 26,
    "num_key_value_heads": 8,
    "pad_token_id": 11,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16384,
                        "rope_theta": 1000000.0, "rope_type": "yarn"},
    "sliding_window": None,
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": 131072,
}

# black-forest-labs/FLUX.2-dev text_encoder: Mistral-Small-3.1 24B's text config.
MISTRAL_SMALL_3_1_TEXT_CONFIG = {
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 32768,
    "max_position_embeddings": 131072,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000000.0,
    "sliding_window": None,
    "use_cache": True,
    "vocab_size": 131072,
}
PIXTRAL_VISION_CONFIG = {
    "attention_dropout": 0.0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "image_size": 1540,
    "initializer_range": 0.02,
    "intermediate_size": 4096,
    "model_type": "pixtral",
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 24,
    "patch_size": 14,
    "rope_theta": 10000.0,
}
# The whole FLUX.2-dev text_encoder/config.json (for a caller that loads the multimodal model).
MISTRAL3_24B_CONFIG = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "image_token_index": 10,
    "model_type": "mistral3",
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "text_config": MISTRAL_SMALL_3_1_TEXT_CONFIG,
    "vision_config": PIXTRAL_VISION_CONFIG,
    "vision_feature_layer": -1,
}

# The backbone's tensors (after `text_key`); Mistral has neither Qwen3's q/k norms nor Qwen2's q/k/v biases.
MISTRAL3_TEXT_MARKER_KEYS = ("embed_tokens.weight", "norm.weight", "layers.0.self_attn.o_proj.weight",
                             "layers.0.mlp.gate_proj.weight")
# Tensors outside the language model's backbone.
NON_TEXT_PREFIXES = ("vision_tower.", "multi_modal_projector.", "lm_head.")

_TO_TEXT = (("model.language_model.", ""), ("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
            ("language_model.", ""), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("model.", ""))


def text_key(key: str) -> str:
    """Any of the three layouts (or a text-only causal LM's `model.*`) -> the backbone's names; tensors of the
    vision tower, projector and LM head keep a prefix naming them (`drop_non_text` drops them). Idempotent."""
    for old, new in _TO_TEXT:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def drop_non_text(state: dict) -> dict:
    """The language model's backbone only (a whole Mistral-3 file holds a vision tower, a projector, an LM head)."""
    if not any(k.startswith("layers.") for k in state):
        raise KeyError("not a Mistral-3 checkpoint")
    return {k: v for k, v in state.items() if not k.startswith(NON_TEXT_PREFIXES)}


def conditional_generation_key(key: str) -> str:
    """Any layout -> transformers 5's `Mistral3ForConditionalGeneration` names (the whole multimodal model)."""
    k = text_key(key)
    if k.startswith("lm_head."):
        return k
    if k.startswith(("vision_tower.", "multi_modal_projector.")):
        return "model." + k
    return "model.language_model." + k


def mistral3_model_key(key: str) -> str:
    """Any layout -> transformers 5's `Mistral3Model` names (no LM head: the caller drops `lm_head.*`)."""
    k = text_key(key)
    if k.startswith(NON_TEXT_PREFIXES):
        return k
    return "language_model." + k


def text_config_from_weights(shapes: dict, base: dict) -> dict | None:
    """A language model of `base`'s kind at any size from its backbone's weights (after `text_key`). The head size
    is not in the weights: 128 (every official Mistral-3) where it divides both projections, else the widest that
    does (tiny test models)."""
    if not all(k in shapes for k in MISTRAL3_TEXT_MARKER_KEYS) or "layers.0.self_attn.q_proj.bias" in shapes:
        return None
    if "layers.0.self_attn.q_norm.weight" in shapes:
        return None  # Qwen3
    vocab, hidden = shapes["embed_tokens.weight"]
    q_out = shapes["layers.0.self_attn.q_proj.weight"][0]
    kv_out = shapes["layers.0.self_attn.k_proj.weight"][0]
    head = 128 if q_out % 128 == 0 and kv_out % 128 == 0 else math.gcd(q_out, kv_out)
    layers = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
    return {**base, "vocab_size": vocab, "hidden_size": hidden, "head_dim": head, "num_hidden_layers": layers,
            "intermediate_size": shapes["layers.0.mlp.gate_proj.weight"][0],
            "num_attention_heads": q_out // head, "num_key_value_heads": kv_out // head}


__all__ = ["MINISTRAL3_3B_TEXT_CONFIG", "MISTRAL3_24B_CONFIG", "MISTRAL3_TEXT_MARKER_KEYS",
           "MISTRAL_SMALL_3_1_TEXT_CONFIG", "NON_TEXT_PREFIXES", "PIXTRAL_VISION_CONFIG", "conditional_generation_key",
           "drop_non_text", "mistral3_model_key", "text_config_from_weights", "text_key"]
