"""Qwen3-VL as a text encoder: the 4B and 8B Instruct configs, their checkpoint names, a config read off the weights
and the ComponentSpec. The model is transformers' `Qwen3VLModel` (the backbone with its vision tower, no LM head),
as diffusers' pipelines hold it: they read hidden states of several decoder layers, never the head's logits."""

from __future__ import annotations

from ..models.detect import ComponentSpec

_TEXT_COMMON = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 262144,
    "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "use_cache": True, "vocab_size": 151936,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_theta": 5000000,
                        "rope_type": "default"},
}
_VISION_COMMON = {
    "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "initializer_range": 0.02, "model_type": "qwen3_vl",
    "num_heads": 16, "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
_TOP_COMMON = {"model_type": "qwen3_vl", "image_token_id": 151655, "video_token_id": 151656,
               "vision_start_token_id": 151652, "vision_end_token_id": 151653}

# Qwen/Qwen3-VL-4B-Instruct's config.json.
QWEN3_VL_4B_CONFIG = {
    **_TOP_COMMON, "architectures": ["Qwen3VLForConditionalGeneration"], "tie_word_embeddings": True,
    "text_config": {**_TEXT_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "vision_config": {**_VISION_COMMON, "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_size": 1024,
                      "intermediate_size": 4096, "out_hidden_size": 2560},
}
# Qwen/Qwen3-VL-8B-Instruct's config.json.
QWEN3_VL_8B_CONFIG = {
    **_TOP_COMMON, "architectures": ["Qwen3VLForConditionalGeneration"], "tie_word_embeddings": False,
    "text_config": {**_TEXT_COMMON, "hidden_size": 4096, "intermediate_size": 12288},
    "vision_config": {**_VISION_COMMON, "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_size": 1152,
                      "intermediate_size": 4304, "out_hidden_size": 4096},
}

# Normalised names every Qwen3-VL checkpoint has; the vision tower's learned position table and the text layers'
# q/k norms tell it from Qwen2.5-VL (whose names normalise to `model.language_model.*` anyway).
QWEN3_VL_MARKER_KEYS = ("language_model.embed_tokens.weight", "language_model.layers.0.self_attn.q_norm.weight",
                        "visual.pos_embed.weight")


def qwen3_vl_key(key: str) -> str:
    """Checkpoint names -> `Qwen3VLModel` names. The official files store the causal LM (`model.language_model.*`,
    `model.visual.*`, `lm_head.*`); a saved `Qwen3VLModel` (diffusers' pipelines) stores the backbone's own names."""
    return key[len("model."):] if key.startswith(("model.language_model.", "model.visual.")) else key


def drop_lm_head(state: dict) -> dict:
    """The backbone's tensors of a causal-LM file (the untied LM head of the 8B is 622M parameters, never read)."""
    if not any(k.startswith("language_model.") for k in state):
        raise KeyError("not a Qwen3-VL checkpoint")
    return {k: v for k, v in state.items() if not k.startswith("lm_head.")}


def _count(shapes: dict, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})


def qwen3_vl_config_from_weights(shapes: dict) -> dict | None:
    """A Qwen3-VL of any size from its (normalised) weights. The sizes of both towers show in the weights; the
    vision tower's head count and which blocks feed the deepstack mergers do not, and are taken from the official
    config of the same depth (else spread evenly): neither changes a prompt's encoding, which never runs the tower."""
    if not all(k in shapes for k in QWEN3_VL_MARKER_KEYS):
        return None
    vocab, hidden = shapes["language_model.embed_tokens.weight"]
    head = shapes["language_model.layers.0.self_attn.q_norm.weight"][0]
    text = {**_TEXT_COMMON, "vocab_size": vocab, "hidden_size": hidden, "head_dim": head,
            "num_hidden_layers": _count(shapes, "language_model.layers."),
            "intermediate_size": shapes["language_model.layers.0.mlp.gate_proj.weight"][0],
            "num_attention_heads": shapes["language_model.layers.0.self_attn.q_proj.weight"][0] // head,
            "num_key_value_heads": shapes["language_model.layers.0.self_attn.k_proj.weight"][0] // head}
    v_hidden, channels, temporal, patch, _ = shapes["visual.patch_embed.proj.weight"]
    depth = _count(shapes, "visual.blocks.")
    n_deep = _count(shapes, "visual.deepstack_merger_list.")
    official = next((c["vision_config"] for c in (QWEN3_VL_4B_CONFIG, QWEN3_VL_8B_CONFIG)
                     if c["vision_config"]["depth"] == depth and len(c["vision_config"]["deepstack_visual_indexes"])
                     == n_deep), None)
    merge = round((shapes["visual.merger.linear_fc1.weight"][1] // v_hidden) ** 0.5)
    vision = {**_VISION_COMMON, "depth": depth, "hidden_size": v_hidden, "in_channels": channels,
              "temporal_patch_size": temporal, "patch_size": patch, "spatial_merge_size": merge,
              "intermediate_size": shapes["visual.blocks.0.mlp.linear_fc1.weight"][0],
              "out_hidden_size": shapes["visual.merger.linear_fc2.weight"][0],
              "num_position_embeddings": shapes["visual.pos_embed.weight"][0],
              "num_heads": official["num_heads"] if official else max(1, v_hidden // 64),
              "deepstack_visual_indexes": (official["deepstack_visual_indexes"] if official
                                           else [(i + 1) * depth // (n_deep + 1) - 1 for i in range(n_deep)])}
    if official is None and v_hidden % vision["num_heads"]:
        vision["num_heads"] = 1
    return {**_TOP_COMMON, "architectures": ["Qwen3VLModel"], "text_config": text, "vision_config": vision,
            "tie_word_embeddings": False}


def qwen3_vl_spec(name: str = "text_encoder", description: str = "Qwen3-VL text encoder") -> ComponentSpec:
    """The ComponentSpec of a Qwen3-VL text encoder: the official 4B/8B files (causal LM, LM head left aside), a
    saved `Qwen3VLModel`, or weights of any size."""
    return ComponentSpec(
        name=name, library="transformers", class_name="Qwen3VLModel", config_class_name="Qwen3VLConfig",
        known_configs={"Qwen/Qwen3-VL-4B-Instruct": QWEN3_VL_4B_CONFIG,
                       "Qwen/Qwen3-VL-8B-Instruct": QWEN3_VL_8B_CONFIG},
        marker_keys=QWEN3_VL_MARKER_KEYS, normalize_key=qwen3_vl_key, convert_state_dict=drop_lm_head,
        foreign_config_classes=("Qwen3VLForConditionalGeneration",), infer_config=qwen3_vl_config_from_weights,
        description=description)


__all__ = ["QWEN3_VL_4B_CONFIG", "QWEN3_VL_8B_CONFIG", "QWEN3_VL_MARKER_KEYS", "drop_lm_head",
           "qwen3_vl_config_from_weights", "qwen3_vl_key", "qwen3_vl_spec"]
