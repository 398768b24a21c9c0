"""FLUX.2 components: the official configs, how their checkpoints are recognised, the scheduler config.

Classes are diffusers' (`Flux2Transformer2DModel`, `AutoencoderKLFlux2`) and transformers' (`Qwen3Model` for klein's
text encoder, `MistralModel` for dev's: the language model of its Mistral-3 file, `parts/mistral3.py`), so the
black-forest-labs/FLUX.2-dev and FLUX.2-klein-{4B,9B,base-4B,base-9B} folders (`transformer/`, `text_encoder/`,
`vae/`) load with their own key names. BFL's single files (`flux2-dev.safetensors`, fused qkv, `double_blocks.*`)
are converted whole by diffusers' own single-file converter; `bfl_dit_keys` is the inverse.
"""

from __future__ import annotations

from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.flux2_vae import FLUX2_VAE_CONFIG, FLUX2_VAE_MARKER_KEYS, flux2_vae_config_from_weights
from ...parts.mistral3 import (MISTRAL3_TEXT_MARKER_KEYS, MISTRAL_SMALL_3_1_TEXT_CONFIG, drop_non_text,
                               text_config_from_weights, text_key)
from ...parts.qwen3 import QWEN3_4B_CONFIG, QWEN3_MARKER_KEYS, drop_lm_head, qwen3_config_from_weights, qwen3_key

# black-forest-labs/FLUX.2-* scheduler/scheduler_config.json: exponential time shift, mu from the image size (the
# pipeline passes diffusers' `compute_empirical_mu`); the reference trains at mu = 0.8.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                    "time_shift_type": "exponential", "base_image_seq_len": 256, "max_image_seq_len": 4096,
                    "base_shift": 0.5, "max_shift": 1.15}
TRAINING_MU = 0.8

# The reference's DiT targets (its scripts' --lora_target_modules, less the per-block single-block to_out list,
# which the suffix `attn.to_out` of the single blocks covers).
LORA_TARGET_MODULES = ("to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,linear_out,"
                       "to_qkv_mlp_proj,single_transformer_blocks.*.attn.to_out")

_BASE = {"_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 128, "out_channels": None,
         "attention_head_dim": 128, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
         "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "eps": 1e-06}
FLUX2_DEV_CONFIG = {**_BASE, "num_layers": 8, "num_single_layers": 48, "num_attention_heads": 48,
                    "joint_attention_dim": 15360, "guidance_embeds": True}
FLUX2_KLEIN_4B_CONFIG = {**_BASE, "num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24,
                         "joint_attention_dim": 7680, "guidance_embeds": False}
FLUX2_KLEIN_9B_CONFIG = {**_BASE, "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
                         "joint_attention_dim": 12288, "guidance_embeds": False}

# Qwen3-8B (FLUX.2-klein-9B's text encoder): the 4B's layout, wider.
QWEN3_8B_CONFIG = {**QWEN3_4B_CONFIG, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "num_hidden_layers": 36}



def _count(shapes, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})


def dit_config_from_weights(shapes: dict) -> dict | None:
    """A FLUX.2 DiT of any depth and width: the head size from the q norm, the RoPE axes its four equal quarters
    (as the official 4 x 32 of 128; the split is not in the weights)."""
    if "x_embedder.weight" not in shapes or "transformer_blocks.0.attn.norm_q.weight" not in shapes:
        return None
    inner, in_channels = shapes["x_embedder.weight"]
    head = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
    if head % 4 or inner % head:
        return None
    return {**_BASE, "in_channels": in_channels, "attention_head_dim": head, "num_attention_heads": inner // head,
            "axes_dims_rope": [head // 4] * 4, "joint_attention_dim": shapes["context_embedder.weight"][1],
            "num_layers": _count(shapes, "transformer_blocks."),
            "num_single_layers": _count(shapes, "single_transformer_blocks."),
            "mlp_ratio": shapes["transformer_blocks.0.ff.linear_out.weight"][1] / inner,
            "timestep_guidance_channels": shapes["time_guidance_embed.timestep_embedder.linear_1.weight"][1],
            "guidance_embeds": "time_guidance_embed.guidance_embedder.linear_1.weight" in shapes}


def convert_bfl_dit(state: dict) -> dict:
    """BFL's names (`double_blocks.*`, fused qkv, `img_in`, ...) -> diffusers', by diffusers' single-file converter
    (it pops from what it is given, so it gets a copy)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    if not any(k.startswith("double_blocks.") for k in state):
        raise KeyError("not BFL's FLUX.2 layout")
    return convert_flux2_transformer_checkpoint_to_diffusers(dict(state))



def mistral_config_from_weights(shapes: dict) -> dict | None:
    """A Mistral text backbone of any size that has the 30 layers whose hidden states FLUX.2-dev reads (10, 20, 30):
    a shallower one (ERNIE-Image's 26-layer Ministral-3 3B) cannot be FLUX.2-dev's text encoder."""
    config = text_config_from_weights(shapes, base=MISTRAL_SMALL_3_1_TEXT_CONFIG)
    return config if config is not None and config["num_hidden_layers"] >= 30 else None


# diffusers' DiT names -> BFL's (the inverse of diffusers' convert_flux2_transformer_checkpoint_to_diffusers)
_BFL_TOP = (("x_embedder.", "img_in."), ("context_embedder.", "txt_in."),
            ("time_guidance_embed.timestep_embedder.linear_1.", "time_in.in_layer."),
            ("time_guidance_embed.timestep_embedder.linear_2.", "time_in.out_layer."),
            ("time_guidance_embed.guidance_embedder.linear_1.", "guidance_in.in_layer."),
            ("time_guidance_embed.guidance_embedder.linear_2.", "guidance_in.out_layer."),
            ("double_stream_modulation_img.linear.", "double_stream_modulation_img.lin."),
            ("double_stream_modulation_txt.linear.", "double_stream_modulation_txt.lin."),
            ("single_stream_modulation.linear.", "single_stream_modulation.lin."), ("proj_out.", "final_layer.linear."))
_BFL_DOUBLE = {"attn.norm_q.weight": "img_attn.norm.query_norm.scale",
               "attn.norm_k.weight": "img_attn.norm.key_norm.scale", "attn.to_out.0.weight": "img_attn.proj.weight",
               "ff.linear_in.weight": "img_mlp.0.weight", "ff.linear_out.weight": "img_mlp.2.weight",
               "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
               "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
               "attn.to_add_out.weight": "txt_attn.proj.weight", "ff_context.linear_in.weight": "txt_mlp.0.weight",
               "ff_context.linear_out.weight": "txt_mlp.2.weight"}
_BFL_QKV = {"img_attn.qkv.weight": ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"),
            "txt_attn.qkv.weight": ("attn.add_q_proj.weight", "attn.add_k_proj.weight", "attn.add_v_proj.weight")}
_BFL_SINGLE = {"attn.to_qkv_mlp_proj.weight": "linear1.weight", "attn.to_out.weight": "linear2.weight",
               "attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale"}


def bfl_dit_keys(state: dict) -> dict:
    """A diffusers FLUX.2 DiT state dict in BFL's single-file names (`flux2-dev.safetensors`): fused qkv,
    `double_blocks` / `single_blocks`, the final modulation's (shift, scale) order. For `--full_format original` and
    the single-file test models."""
    import re

    import torch

    out = {}
    blocks = {}
    for key, value in state.items():
        m = re.match(r"(single_transformer_blocks|transformer_blocks)\.(\d+)\.(.+)", key)
        if m:
            blocks.setdefault((m.group(1), int(m.group(2))), {})[m.group(3)] = value
        elif key.startswith("norm_out.linear."):
            scale, shift = value.chunk(2, dim=0)
            out["final_layer.adaLN_modulation.1." + key.rsplit(".", 1)[1]] = torch.cat([shift, scale], dim=0)
        else:
            new = next((bfl + key[len(d):] for d, bfl in _BFL_TOP if key.startswith(d)), key)
            out[new] = value
    for (kind, i), params in sorted(blocks.items()):
        if kind == "single_transformer_blocks":
            out.update({f"single_blocks.{i}.{_BFL_SINGLE[k]}": v for k, v in params.items()})
            continue
        out.update({f"double_blocks.{i}.{_BFL_DOUBLE[k]}": v for k, v in params.items() if k in _BFL_DOUBLE})
        for fused, parts in _BFL_QKV.items():
            out[f"double_blocks.{i}.{fused}"] = torch.cat([params[p] for p in parts], dim=0)
    return out



DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="Flux2Transformer2DModel",
    known_configs={"black-forest-labs/FLUX.2-dev transformer": FLUX2_DEV_CONFIG,
                   "black-forest-labs/FLUX.2-klein(-base)-4B transformer": FLUX2_KLEIN_4B_CONFIG,
                   "black-forest-labs/FLUX.2-klein(-base)-9B transformer": FLUX2_KLEIN_9B_CONFIG},
    marker_keys=("x_embedder.weight", "single_stream_modulation.linear.weight",
                 "transformer_blocks.0.attn.to_q.weight"),
    normalize_key=strip_comfyui_prefix, infer_config=dit_config_from_weights, description="FLUX.2 DiT")

DIT_BFL = ComponentSpec(
    name="dit", library="diffusers", class_name="Flux2Transformer2DModel", known_configs=DIT.known_configs,
    marker_keys=("img_in.weight", "single_stream_modulation.lin.weight", "double_blocks.0.img_attn.qkv.weight"),
    normalize_key=strip_comfyui_prefix, convert_state_dict=convert_bfl_dit, infer_config=dit_config_from_weights,
    description="FLUX.2 DiT, BFL's single-file layout (flux2-dev.safetensors and alike)")

TEXT_ENCODER_QWEN3 = ComponentSpec(
    name="text_encoder", library="transformers", class_name="Qwen3Model", config_class_name="Qwen3Config",
    known_configs={"Qwen3-4B (FLUX.2-klein-4B text_encoder)": QWEN3_4B_CONFIG,
                   "Qwen3-8B (FLUX.2-klein-9B text_encoder)": QWEN3_8B_CONFIG},
    marker_keys=QWEN3_MARKER_KEYS, normalize_key=qwen3_key, convert_state_dict=drop_lm_head,
    foreign_config_classes=("Qwen3ForCausalLM",), infer_config=qwen3_config_from_weights,
    description="Qwen3 text encoder of FLUX.2-klein (hidden states 9, 18, 27)")

TEXT_ENCODER_MISTRAL = ComponentSpec(
    name="text_encoder", library="transformers", class_name="MistralModel", config_class_name="MistralConfig",
    known_configs={"Mistral-Small-3.1 24B (FLUX.2-dev text_encoder)": MISTRAL_SMALL_3_1_TEXT_CONFIG},
    marker_keys=MISTRAL3_TEXT_MARKER_KEYS, normalize_key=text_key, convert_state_dict=drop_non_text,
    # the folder's config.json names the multimodal model: its language model's weights are matched instead
    foreign_config_classes=("Mistral3ForConditionalGeneration",),
    infer_config=mistral_config_from_weights,
    description="Mistral-Small-3.1 text encoder of FLUX.2-dev (hidden states 10, 20, 30; vision tower not loaded)")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKLFlux2",
    known_configs={"black-forest-labs/FLUX.2 vae": FLUX2_VAE_CONFIG}, marker_keys=FLUX2_VAE_MARKER_KEYS,
    infer_config=flux2_vae_config_from_weights,
    description="FLUX.2 autoencoder (32 latent channels, BatchNorm-normalised 2x2 patches)")

COMPONENTS = (DIT, DIT_BFL, TEXT_ENCODER_QWEN3, TEXT_ENCODER_MISTRAL, VAE)

__all__ = ["bfl_dit_keys", "COMPONENTS", "DIT", "DIT_BFL", "FLUX2_DEV_CONFIG", "FLUX2_KLEIN_4B_CONFIG",
           "FLUX2_KLEIN_9B_CONFIG", "LORA_TARGET_MODULES", "SCHEDULER_CONFIG", "TEXT_ENCODER_MISTRAL",
           "TEXT_ENCODER_QWEN3", "TRAINING_MU", "VAE"]
