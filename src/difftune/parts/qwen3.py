"""Qwen3 as a text encoder: the Qwen3-4B config, its checkpoint names and a config read off the weights. Only the
backbone (transformers' `Qwen3Model`) is loaded: the causal LM's head is never read by a prompt encoder."""

from __future__ import annotations

QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# Qwen/Qwen3-0.6B's config.json (the backbone a 1024-wide text encoder is).
QWEN3_06B_CONFIG = {**QWEN3_4B_CONFIG, "hidden_size": 1024, "intermediate_size": 3072, "max_window_layers": 28,
                    "num_attention_heads": 16, "num_hidden_layers": 28}
# Tensors that mark Qwen3's backbone (the q/k norms tell it from Qwen2).
QWEN3_MARKER_KEYS = ("embed_tokens.weight", "norm.weight", "layers.0.self_attn.q_norm.weight")


# Qwen's chat tokens: every Qwen3 tokenizer has them, as single tokens; another model's tokenizer spells them out
QWEN_CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def qwen3_tokenizer_problem(tokenizer, encoder) -> str | None:
    """What does not fit when `tokenizer` serves `encoder`, if `encoder` is a Qwen3 (None for another model): a
    tokenizer without Qwen's chat tokens is another model's (FLUX.2-dev's Mistral tokenizer fits the size of a
    Qwen3's embedding, and reads a prompt as other words)."""
    if getattr(getattr(encoder, "config", None), "model_type", None) != "qwen3":
        return None
    vocab = tokenizer.get_vocab()
    missing = [t for t in QWEN_CHAT_TOKENS if t not in vocab]
    if missing:
        return (f"it has no {' / '.join(missing)} token, which every Qwen3 tokenizer has: it is another model's "
                f"tokenizer")
    return None


def qwen3_key(key: str) -> str:
    """A causal-LM file holds the backbone as `model.*`; `Qwen3Model` is that backbone (at 4B the LM head alone is
    389M parameters, never read)."""
    return key[len("model."):] if key.startswith("model.") else key


def drop_lm_head(state: dict) -> dict:
    """A causal-LM file that stores its (untied) LM head: the backbone's tensors only."""
    if not any(k.startswith("layers.") for k in state):
        raise KeyError("not a Qwen3 checkpoint")
    return {k: v for k, v in state.items() if not k.startswith("lm_head.")}


def qwen3_config_from_weights(shapes: dict, base: dict = QWEN3_4B_CONFIG) -> dict | None:
    """A Qwen3 causal LM of any size from its weights (head size from the q/k norms); the rest as `base`."""
    if "layers.0.self_attn.q_norm.weight" not in shapes:
        return None
    vocab, hidden = shapes["embed_tokens.weight"]
    head = shapes["layers.0.self_attn.q_norm.weight"][0]
    layers = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
    return {**base, "vocab_size": vocab, "hidden_size": hidden, "head_dim": head,
            "num_hidden_layers": layers,
            "intermediate_size": shapes["layers.0.mlp.gate_proj.weight"][0],
            "num_attention_heads": shapes["layers.0.self_attn.q_proj.weight"][0] // head,
            "num_key_value_heads": shapes["layers.0.self_attn.k_proj.weight"][0] // head}


__all__ = ["QWEN3_06B_CONFIG", "QWEN3_4B_CONFIG", "QWEN3_MARKER_KEYS", "QWEN_CHAT_TOKENS", "drop_lm_head", "qwen3_config_from_weights",
           "qwen3_key", "qwen3_tokenizer_problem"]
