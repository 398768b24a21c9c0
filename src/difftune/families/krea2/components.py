"""Krea-2 components: the DiT's official config, how its checkpoints are recognised, the scheduler config.

The DiT is diffusers' `Krea2Transformer2DModel`. The files the reference's scripts name are Krea's single files
(`krea/Krea-2-Raw:raw.safetensors`, `krea/Krea-2-Turbo:turbo.safetensors`) in the original names (`first`,
`blocks.N.attn.wq`, `txtfusion`, `last`, a flat modulation table per block), converted whole by diffusers' own
krea2 single-file converter; a diffusers `transformer/` folder loads with its own names. The text encoder is
Qwen3-VL-4B (`parts/qwen3_vl.py`), the VAE Qwen-Image's (`parts/qwen_image_vae.py`).
"""

from __future__ import annotations

import re

from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.qwen3_vl import qwen3_vl_spec
from ...parts.qwen_image_vae import qwen_image_vae_spec

# diffusers' Krea2Pipeline scheduler: Euler with the exponential time shift, mu linear in the image sequence length
# between (256, 0.5) and (6400, 1.15); the reference trains at a fixed mu of 0.8 and samples Turbo at 1.15.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "use_dynamic_shifting": True, "time_shift_type": "exponential",
                    "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 6400,
                    "shift": 1.0}
TRAINING_MU = 0.8
TURBO_MU = 1.15
# The text encoder's hidden states the DiT reads (0 is the embedding output), in both diffusers and the reference.
TEXT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)

# The reference's --lora_target_modules (its original module names) and what each is in diffusers' modules.
REFERENCE_LORA_TARGETS = {
    "wq": "to_q", "wk": "to_k", "wv": "to_v", "wo": "to_out.0", "gate": "to_gate,ff.gate", "up": "ff.up",
    "down": "ff.down", "first": "img_in", "tmlp.0": "time_embed.linear_1", "tmlp.2": "time_embed.linear_2",
    "projector": "text_fusion.projector", "txtmlp.1": "txt_in.linear_1", "txtmlp.3": "txt_in.linear_2",
    "last.linear": "final_layer.linear", "tproj.1": "time_mod_proj",
}
# The reference's targets in diffusers' names (what `difftune` trains by default).
LORA_TARGET_MODULES = ("to_q,to_k,to_v,to_gate,to_out.0,ff.gate,ff.up,ff.down,img_in,time_embed.linear_1,"
                       "time_embed.linear_2,text_fusion.projector,txt_in.linear_1,txt_in.linear_2,final_layer.linear,"
                       "time_mod_proj")

# krea/Krea-2-Raw and -Turbo (one architecture; Turbo is the few-step distilled checkpoint).
KREA2_TRANSFORMER_CONFIG = {
    "_class_name": "Krea2Transformer2DModel",
    "in_channels": 64, "num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 48,
    "num_key_value_heads": 12, "intermediate_size": 16384, "timestep_embed_dim": 256, "text_hidden_dim": 2560,
    "num_text_layers": 12, "text_num_attention_heads": 20, "text_num_key_value_heads": 20,
    "text_intermediate_size": 6912, "num_layerwise_text_blocks": 2, "num_refiner_text_blocks": 2,
    "axes_dims_rope": [32, 48, 48], "rope_theta": 1000.0, "norm_eps": 1e-05,
}


def _count(shapes, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})


def rope_axes(head_dim: int) -> list[int]:
    """The (t, h, w) split of a head: Krea-2's 32/48/48 of 128 at other sizes (each part even)."""
    if head_dim == 128:
        return [32, 48, 48]
    t = max(2, (head_dim // 4) // 2 * 2)
    hw = (head_dim - t) // 2 // 2 * 2
    return [head_dim - 2 * hw, hw, hw]


def dit_config_from_weights(shapes: dict) -> dict | None:
    """Krea2Transformer2DModel of any size from its (diffusers-named) weights; the rotary split follows the head."""
    if "text_fusion.projector.weight" not in shapes or "transformer_blocks.0.attn.norm_q.weight" not in shapes:
        return None
    hidden, in_channels = shapes["img_in.weight"]
    head = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
    text_dim = shapes["txt_in.linear_1.weight"][1]
    text_head = shapes["text_fusion.layerwise_blocks.0.attn.norm_q.weight"][0]
    config = {**KREA2_TRANSFORMER_CONFIG, "in_channels": in_channels, "attention_head_dim": head,
              "num_layers": _count(shapes, "transformer_blocks."),
              "num_attention_heads": hidden // head,
              "num_key_value_heads": shapes["transformer_blocks.0.attn.to_k.weight"][0] // head,
              "intermediate_size": shapes["transformer_blocks.0.ff.gate.weight"][0],
              "timestep_embed_dim": shapes["time_embed.linear_1.weight"][1], "text_hidden_dim": text_dim,
              "num_text_layers": shapes["text_fusion.projector.weight"][1],
              "text_num_attention_heads": text_dim // text_head,
              "text_num_key_value_heads": shapes["text_fusion.layerwise_blocks.0.attn.to_k.weight"][0] // text_head,
              "text_intermediate_size": shapes["text_fusion.layerwise_blocks.0.ff.gate.weight"][0],
              "num_layerwise_text_blocks": _count(shapes, "text_fusion.layerwise_blocks."),
              "num_refiner_text_blocks": _count(shapes, "text_fusion.refiner_blocks."),
              "axes_dims_rope": rope_axes(head)}
    return config


def convert_original_dit(state: dict) -> dict:
    """Krea's original names -> diffusers' (diffusers' own single-file converter; it empties what it is given)."""
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    return convert_krea2_transformer_checkpoint_to_diffusers(dict(state))


# diffusers' names -> Krea's, the converter's renames read backwards (for `--full_format original`).
_BACK_PREFIX = (("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
                ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"),
                ("txt_in.linear_1.", "txtmlp.1."), ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."),
                ("transformer_blocks.", "blocks."), ("final_layer.linear.", "last.linear."),
                ("final_layer.norm.weight", "last.norm.scale"),
                ("final_layer.scale_shift_table", "last.modulation.lin"))
_BACK_BLOCK = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
               (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
               (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
               (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
               (".scale_shift_table", ".mod.lin"))


def original_dit_keys(state: dict) -> dict:
    """A Krea2Transformer2DModel state dict in Krea's original names (what raw.safetensors holds, and what the
    reference's and ComfyUI's loaders read): the block modulation tables flattened back."""
    out = {}
    for key, value in state.items():
        new = key
        for old, repl in _BACK_PREFIX:
            if new.startswith(old):
                new = repl + new[len(old):]
                break
        for old, repl in _BACK_BLOCK:
            new = new.replace(old, repl)
        if re.fullmatch(r"blocks\.\d+\.mod\.lin", new):
            value = value.reshape(-1)
        out[new] = value
    return out


# -- specs --------------------------------------------------------------------------------------------

DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="Krea2Transformer2DModel",
    known_configs={"krea/Krea-2 transformer": KREA2_TRANSFORMER_CONFIG},
    marker_keys=("img_in.weight", "text_fusion.projector.weight", "time_mod_proj.weight"),
    normalize_key=strip_comfyui_prefix, infer_config=dit_config_from_weights, description="Krea-2 single-stream DiT")

# Krea's single files (raw.safetensors, turbo.safetensors): the same class and configs, converted whole.
DIT_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="Krea2Transformer2DModel", known_configs=DIT.known_configs,
    marker_keys=("first.weight", "txtfusion.projector.weight", "tproj.1.weight"), normalize_key=strip_comfyui_prefix,
    convert_state_dict=convert_original_dit, infer_config=dit_config_from_weights,
    description="Krea-2 DiT, Krea's single-file layout (raw / turbo.safetensors)")

TEXT_ENCODER = qwen3_vl_spec(description="Qwen3-VL-4B text encoder (12 tapped hidden states)")
VAE = qwen_image_vae_spec()

COMPONENTS = (DIT, TEXT_ENCODER, VAE, DIT_ORIGINAL)

__all__ = ["COMPONENTS", "DIT", "DIT_ORIGINAL", "KREA2_TRANSFORMER_CONFIG", "LORA_TARGET_MODULES",
           "REFERENCE_LORA_TARGETS", "SCHEDULER_CONFIG", "TEXT_ENCODER", "TEXT_LAYERS", "TRAINING_MU", "TURBO_MU",
           "VAE", "convert_original_dit", "dit_config_from_weights", "original_dit_keys"]
