"""Wan components in the diffusers layout (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers` and its siblings): what each slot
holds, the reference's LoRA target names, and the repository's sampling scheduler.

Weights with a config.json beside them (diffusers' `_class_name`, transformers' `architectures`) are recognised
from it. The original Wan-AI files (.pth UMT5 / VAE / CLIP, DiT safetensors in Wan's own key names) are
recognised from their tensors against the official configs below.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...models.detect import ComponentSpec

# The reference trains (and samples) Wan with a static flow-match shift of 5.
TRAINING_SHIFT = 5.0
# The reference's expert switch when sampling with both Wan2.2 A14B experts (its `switch_DiT_boundary`), used
# when the repository's model_index.json gives no `boundary_ratio`.
DEFAULT_BOUNDARY_RATIO = 0.875

# diffusers' WanTransformer3DModel modules for the reference's Wan names: its self_attn / cross_attn q, k, v, o
# are attn1 / attn2 to_q, to_k, to_v, to_out.0 (peft matches the suffix in both blocks), its ffn.0 / ffn.2 the
# FFN's two Linear layers. (The I2V cross-attention's image k/v, add_k_proj/add_v_proj, are not among them,
# as in the reference.)
REFERENCE_LORA_TARGETS = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "ffn.0": "ffn.net.0.proj",
                          "ffn.2": "ffn.net.2"}
LORA_TARGET_MODULES = "to_q,to_k,to_v,to_out.0,ffn.net.0.proj,ffn.net.2"

DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="WanTransformer3DModel", extra_slots=("dit2",),
    marker_keys=("patch_embedding.weight", "condition_embedder.time_proj.weight"),
    description="Wan DiT (Wan2.1 / Wan2.2; a second one is the A14B low-noise expert)")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKLWan",
    marker_keys=("encoder.conv_in.weight", "decoder.conv_in.weight", "quant_conv.weight"),
    description="Wan video VAE (Wan2.1: 16 channels, x8; Wan2.2 TI2V: 48 channels, x16)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="UMT5EncoderModel", config_class_name="UMT5Config",
    marker_keys=("shared.weight", "encoder.final_layer_norm.weight"),
    description="UMT5-XXL text encoder")

IMAGE_ENCODER = ComponentSpec(
    name="image_encoder", library="transformers", class_name="CLIPVisionModel", config_class_name="CLIPVisionConfig",
    marker_keys=("vision_model.embeddings.patch_embedding.weight",),
    description="CLIP ViT-H/14 image encoder (Wan2.1 I2V 14B)")

IMAGE_ENCODER_PROJ = ComponentSpec(
    name="image_encoder", library="transformers", class_name="CLIPVisionModelWithProjection",
    config_class_name="CLIPVisionConfig", marker_keys=("vision_model.embeddings.patch_embedding.weight",),
    description="CLIP ViT-H/14 image encoder with projection (Wan2.1 I2V 14B)")


class RepoScheduler:
    """The repository's sampling scheduler (scheduler/scheduler_config.json, built with diffusers' class of that
    name, e.g. UniPCMultistepScheduler for the -Diffusers repositories) and model_index.json's expert boundary."""

    def __init__(self, scheduler, boundary_ratio: float | None = None, source: str = ""):
        self.scheduler = scheduler
        self.boundary_ratio = boundary_ratio
        self.source = source


def load_repo_scheduler(path_or_config) -> RepoScheduler:
    """From a `scheduler/` folder (a ModelConfig naming it, or a path); model_index.json is read beside it."""
    import diffusers

    from ...errors import UserError
    from ...models.load import model_directory

    folder = model_directory(path_or_config, "scheduler")
    config_file = folder / "scheduler_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{config_file}: not a readable scheduler config ({type(err).__name__})") from None
    name = config.get("_class_name") if isinstance(config, dict) else None
    cls = getattr(diffusers, str(name), None)
    if cls is None or not hasattr(cls, "from_config"):
        raise UserError(f"{config_file}: _class_name {name!r} is not a diffusers scheduler")
    index = Path(folder).parent / "model_index.json"
    boundary = None
    if index.is_file():
        try:
            boundary = json.loads(index.read_text(encoding="utf-8")).get("boundary_ratio")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            boundary = None
    return RepoScheduler(cls.from_config(config), boundary, str(folder))


# -- Wan-AI's original files (the reference's commands name these) -------------------------------------------
# Official configs in diffusers' / transformers' terms: recognition matches the converted tensor shapes against
# them (the original repositories' own config.json, class "WanModel", is not in these terms).
def _dit_config(heads, ffn, layers, in_channels=16, out_channels=16, image=False, pos_embed_seq_len=None):
    return {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": heads,
            "attention_head_dim": 128, "in_channels": in_channels, "out_channels": out_channels, "text_dim": 4096,
            "freq_dim": 256, "ffn_dim": ffn, "num_layers": layers, "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": 1280 if image else None,
            "added_kv_proj_dim": heads * 128 if image else None, "rope_max_seq_len": 1024,
            "pos_embed_seq_len": pos_embed_seq_len}


WAN_DIT_CONFIGS = {
    "Wan2.1-T2V-1.3B": _dit_config(12, 8960, 30),
    "Wan2.1-T2V-14B / Wan2.2-T2V-A14B expert": _dit_config(40, 13824, 40),
    # PAI's Wan2.1-Fun-1.3B-InP and Fun-V1.1-1.3B-InP: the I2V DiT (CLIP image, first/last frame) at 1.3B size
    "Wan2.1-Fun-1.3B-InP": _dit_config(12, 8960, 30, in_channels=36, image=True),
    "Wan2.1-I2V-14B": _dit_config(40, 13824, 40, in_channels=36, image=True),
    "Wan2.1-FLF2V-14B": _dit_config(40, 13824, 40, in_channels=36, image=True, pos_embed_seq_len=514),
    "Wan2.2-I2V-A14B expert": _dit_config(40, 13824, 40, in_channels=36),
    "Wan2.2-TI2V-5B": _dit_config(24, 14336, 30, in_channels=48, out_channels=48),
}
# Wan2.1's VAE (also Wan2.2 A14B's): AutoencoderKLWan's defaults, its latents mean / std included.
WAN21_VAE_CONFIG = {"_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4],
                    "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True],
                    "dropout": 0.0}
# Wan2.2's VAE (TI2V-5B), as diffusers' Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: 48 channels over 2x2
# pixel patches (x16), residual shortcuts, a wider decoder, and its own latents mean / std.
WAN22_VAE_CONFIG = {
    "_class_name": "AutoencoderKLWan", "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0,
    "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_temporal": 4,
    "scale_factor_spatial": 16, "clip_output": False,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}
# The vision tower of open-clip's XLM-RoBERTa ViT-H/14 (Wan2.1 I2V 14B's models_clip_...pth).
CLIP_VIT_H14_CONFIG = {"architectures": ["CLIPVisionModelWithProjection"], "model_type": "clip_vision_model",
                       "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                       "num_attention_heads": 16, "patch_size": 14, "image_size": 224, "projection_dim": 1024,
                       "hidden_act": "gelu", "layer_norm_eps": 1e-5, "num_channels": 3}
UMT5_XXL_CONFIG = {"architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 256384,
                   "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
                   "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
                   "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
                   "layer_norm_epsilon": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
                   "tie_word_embeddings": False}


def _strip_comfy_prefix(key: str) -> str:
    # ComfyUI's prefixes, and the `model.` that some released DiT files carry (krea/krea-realtime-video's; the
    # reference strips it from every Wan DiT file)
    for prefix in ("model.diffusion_model.", "diffusion_model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _dit_from_original(state):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    out = convert_wan_transformer_to_diffusers(dict(state))
    # FLF2V's image position embedding, which diffusers' converter leaves under Wan's name
    if "img_emb.emb_pos" in out:
        out["condition_embedder.image_embedder.pos_embed"] = out.pop("img_emb.emb_pos")
    return out


def _vae_from_original(state):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    return convert_wan_vae_to_diffusers(dict(state))


def _vae22_from_original(state):
    from .original_layout import wan22_vae_from_original

    return wan22_vae_from_original(state)


def _clip_from_original(state):
    from .original_layout import clip_vision_from_wan

    return clip_vision_from_wan(state)


def _umt5_from_original(state):
    from .original_layout import umt5_from_wan

    return umt5_from_wan(state)


DIT_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="WanTransformer3DModel", extra_slots=("dit2",),
    known_configs=WAN_DIT_CONFIGS,
    marker_keys=("patch_embedding.weight", "head.modulation", "blocks.0.self_attn.q.weight"),
    normalize_key=_strip_comfy_prefix, convert_state_dict=_dit_from_original, foreign_config_classes=("WanModel",),
    description="Wan DiT, Wan-AI's original layout (diffusion_pytorch_model*.safetensors)")

# Classes of the config.json a variant's repository keeps at its root beside the base models' .pth files (it describes
# the variant's DiT, not them): those files are recognised by their weights.
VARIANT_ROOT_CONFIGS = ("WanModel_S2V", "WanDancerTransformer", "LongCatVideoTransformer3DModel",
                        "WanTransformer3DMOTModel")

VAE_ORIGINAL = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKLWan", known_configs={"Wan2.1 VAE": WAN21_VAE_CONFIG},
    marker_keys=("encoder.conv1.weight", "decoder.middle.0.residual.0.gamma", "conv1.weight"),
    convert_state_dict=_vae_from_original, foreign_config_classes=VARIANT_ROOT_CONFIGS,
    description="Wan2.1 VAE, Wan-AI's original layout (Wan2.1_VAE.pth)")

VAE22_ORIGINAL = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKLWan", known_configs={"Wan2.2 VAE": WAN22_VAE_CONFIG},
    marker_keys=("encoder.downsamples.0.downsamples.0.residual.0.gamma",
                 "decoder.upsamples.0.upsamples.0.residual.0.gamma", "conv1.weight"),
    convert_state_dict=_vae22_from_original,
    foreign_config_classes=VARIANT_ROOT_CONFIGS,
    description="Wan2.2 VAE (TI2V-5B), Wan-AI's original layout (Wan2.2_VAE.pth)")

IMAGE_ENCODER_ORIGINAL = ComponentSpec(
    name="image_encoder", library="transformers", class_name="CLIPVisionModelWithProjection",
    config_class_name="CLIPVisionConfig", known_configs={"CLIP ViT-H/14 (open-clip xlm-roberta)": CLIP_VIT_H14_CONFIG},
    marker_keys=("visual.patch_embedding.weight", "visual.cls_embedding", "visual.transformer.0.attn.to_qkv.weight"),
    convert_state_dict=_clip_from_original,
    foreign_config_classes=VARIANT_ROOT_CONFIGS,
    description="CLIP ViT-H/14 image encoder, Wan-AI's original layout "
                "(models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth; its text tower is not used)")

TEXT_ENCODER_ORIGINAL = ComponentSpec(
    name="text_encoder", library="transformers", class_name="UMT5EncoderModel", config_class_name="UMT5Config",
    known_configs={"UMT5-XXL encoder": UMT5_XXL_CONFIG},
    marker_keys=("token_embedding.weight", "blocks.0.attn.q.weight", "blocks.0.ffn.gate.0.weight"),
    convert_state_dict=_umt5_from_original,
    foreign_config_classes=VARIANT_ROOT_CONFIGS,
    description="UMT5-XXL encoder, Wan-AI's original layout (models_t5_umt5-xxl-enc-bf16.pth)")
