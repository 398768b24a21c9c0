"""Recognition of Wan2.2-S2V's weights: its DiT's released config and shapes, and its wav2vec2 audio encoder
(the released file's older weight-norm names converted)."""

from __future__ import annotations

import torch

from ....models.detect import ComponentSpec
from .model import S2V_INJECT_LAYERS, WanModel_S2V

S2V_14B_CONFIG = {"_class_name": "WanModel_S2V", "dim": 5120, "in_dim": 16, "ffn_dim": 13824, "out_dim": 16,
                  "text_dim": 4096, "freq_dim": 256, "eps": 1e-6, "patch_size": [1, 2, 2], "num_heads": 40,
                  "num_layers": 40, "cond_dim": 16, "audio_dim": 1024, "num_audio_token": 4, "audio_layers": 25,
                  "enable_adain": True, "audio_inject_layers": S2V_INJECT_LAYERS, "enable_framepack": True,
                  "framepack_drop_mode": "padd", "zero_timestep": True}


def infer_s2v_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A bare S2V DiT's config from its shapes (width, depth, audio sizes). The heads and the injected blocks do
    not show in shapes: 128-channel heads (Wan's), and the injectors after blocks 0, 4, 8, ... spread as the
    released list is (for 40 blocks exactly the released list)."""
    try:
        dim, in_dim = shapes["patch_embedding.weight"][:2]
        blocks = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        injectors = 1 + max((int(k.split(".")[2]) for k in shapes if k.startswith("audio_injector.injector.")),
                            default=-1)
        enc = shapes["casual_audio_encoder.encoder.conv1_local.conv.weight"]
        config = dict(S2V_14B_CONFIG, dim=dim, in_dim=in_dim, ffn_dim=shapes["blocks.0.ffn.0.weight"][0],
                      out_dim=shapes["head.head.weight"][0] // 4, text_dim=shapes["text_embedding.0.weight"][1],
                      freq_dim=shapes["time_embedding.0.weight"][1], num_layers=blocks,
                      num_heads=max(1, dim // 128), audio_dim=enc[1], num_audio_token=enc[0] // (dim // 4),
                      audio_layers=shapes["casual_audio_encoder.weights"][1],
                      cond_dim=shapes["cond_encoder.weight"][1] if "cond_encoder.weight" in shapes else 0,
                      enable_adain="casual_audio_encoder.encoder.final_linear.weight" in shapes,
                      enable_framepack="frame_packer.proj.weight" in shapes)
    except (KeyError, IndexError, ValueError):
        return None
    config["audio_inject_layers"] = S2V_INJECT_LAYERS if (blocks, injectors) == (40, 12) else \
        [round(i * (blocks - 1) / max(injectors - 1, 1)) for i in range(injectors)]
    return config


S2V_DIT = ComponentSpec(
    name="dit", library=WanModel_S2V.__module__, class_name="WanModel_S2V",
    known_configs={"Wan2.2-S2V-14B": S2V_14B_CONFIG},
    marker_keys=("casual_audio_encoder.weights", "audio_injector.injector.0.q.weight", "blocks.0.self_attn.q.weight"),
    infer_config=infer_s2v_config,
    description="Wan2.2-S2V DiT (speech-to-video; Wan-AI's layout, diffusion_pytorch_model*.safetensors)")


# -- the audio encoder: transformers' wav2vec2 -------------------------------------------------------------

# facebook/wav2vec2-large-xlsr-53 fine-tuned for English (Wan-AI/Wan2.2-S2V-14B/wav2vec2-large-xlsr-53-english/)
WAV2VEC2_XLSR_CONFIG = {
    "architectures": ["Wav2Vec2ForCTC"], "model_type": "wav2vec2", "activation_dropout": 0.05,
    "apply_spec_augment": True, "attention_dropout": 0.1, "bos_token_id": 1, "conv_bias": True,
    "conv_dim": [512] * 7, "conv_kernel": [10, 3, 3, 3, 3, 2, 2], "conv_stride": [5, 2, 2, 2, 2, 2, 2],
    "ctc_loss_reduction": "mean", "ctc_zero_infinity": True, "do_stable_layer_norm": True, "eos_token_id": 2,
    "feat_extract_activation": "gelu", "feat_extract_dropout": 0.0, "feat_extract_norm": "layer",
    "feat_proj_dropout": 0.05, "final_dropout": 0.0, "hidden_act": "gelu", "hidden_dropout": 0.05,
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096, "layer_norm_eps": 1e-5,
    "layerdrop": 0.05, "mask_time_length": 10, "mask_time_prob": 0.05, "num_attention_heads": 16,
    "num_conv_pos_embedding_groups": 16, "num_conv_pos_embeddings": 128, "num_feat_extract_layers": 7,
    "num_hidden_layers": 24, "pad_token_id": 0, "vocab_size": 33}


def wav2vec2_from_file(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released wav2vec2 file (older transformers' weight-norm names) -> transformers 5's names."""
    rename = {"weight_g": "parametrizations.weight.original0", "weight_v": "parametrizations.weight.original1"}
    out = {}
    for key, value in state.items():
        head, _, leaf = key.rpartition(".")
        out[f"{head}.{rename[leaf]}" if "pos_conv_embed.conv" in head and leaf in rename else key] = value
    return out


AUDIO_ENCODER = ComponentSpec(
    name="audio_encoder", library="transformers", class_name="Wav2Vec2ForCTC", config_class_name="Wav2Vec2Config",
    known_configs={"wav2vec2-large-xlsr-53": WAV2VEC2_XLSR_CONFIG},
    marker_keys=("wav2vec2.feature_extractor.conv_layers.0.conv.weight",), convert_state_dict=wav2vec2_from_file,
    description="wav2vec2 audio encoder (Wan2.2-S2V: wav2vec2-large-xlsr-53-english/model.safetensors)")


__all__ = ["AUDIO_ENCODER", "S2V_14B_CONFIG", "S2V_DIT", "WAV2VEC2_XLSR_CONFIG", "infer_s2v_config",
           "wav2vec2_from_file"]
