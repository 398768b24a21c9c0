"""ERNIE-Image components: the official configs, how their checkpoints are recognised, the scheduler config.

Classes are diffusers' (`ErnieImageTransformer2DModel`, `AutoencoderKLFlux2`) and transformers' (`Ministral3Model`),
so PaddlePaddle/ERNIE-Image's folders load with their own key names: `transformer/` (the 8B DiT, sharded),
`text_encoder/model.safetensors` (a whole Mistral-3 in transformers 4's layout, of which only the language model is
loaded: `parts/mistral3.py`) and `vae/` (the FLUX.2 autoencoder, `parts/flux2_vae.py`). A single-file DiT (ComfyUI's)
holds diffusers' names behind `model.diffusion_model.`, which is what diffusers' own single-file converter strips.
"""

from __future__ import annotations

from functools import partial

from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.flux2_vae import FLUX2_VAE_CONFIG, FLUX2_VAE_MARKER_KEYS, flux2_vae_config_from_weights
from ...parts.mistral3 import (MINISTRAL3_3B_TEXT_CONFIG, MISTRAL3_TEXT_MARKER_KEYS, drop_non_text,
                               text_config_from_weights, text_key)

# PaddlePaddle/ERNIE-Image scheduler: FlowMatchEulerDiscreteScheduler with a static shift of 3 (the reference's
# ERNIE-Image template too: sigmas linspace(1, 0, N + 1)[:-1], shifted).
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

# The reference's scripts' --lora_target_modules.
LORA_TARGET_MODULES = "to_q,to_k,to_v,to_out.0"

# diffusers' ErnieImagePipeline un-normalises with the trained BatchNorm eps (1e-5), not the hub config's 1e-4.
BN_EPS = 1e-5

ERNIE_IMAGE_TRANSFORMER_CONFIG = {
    "_class_name": "ErnieImageTransformer2DModel",
    "eps": 1e-06,
    "ffn_hidden_size": 12288,
    "hidden_size": 4096,
    "in_channels": 128,
    "num_attention_heads": 32,
    "num_layers": 36,
    "out_channels": 128,
    "patch_size": 1,
    "qk_layernorm": True,
    "rope_axes_dim": [32, 48, 48],
    "rope_theta": 256,
    "text_in_dim": 3072,
}


def dit_config_from_weights(shapes: dict) -> dict | None:
    """An ERNIE-Image DiT of any depth and width; the RoPE axes split the head as the official 32/48/48 of 128 do
    (the split is not in the weights)."""
    if "x_embedder.proj.weight" not in shapes or "layers.0.self_attention.norm_q.weight" not in shapes:
        return None
    hidden, in_channels, patch, _ = shapes["x_embedder.proj.weight"]
    head = shapes["layers.0.self_attention.norm_q.weight"][0]
    if head % 8 or hidden % head:
        return None
    text_in = shapes["text_proj.weight"][1] if "text_proj.weight" in shapes else hidden
    return {**ERNIE_IMAGE_TRANSFORMER_CONFIG, "hidden_size": hidden, "num_attention_heads": hidden // head,
            "num_layers": len({k.split(".")[1] for k in shapes if k.startswith("layers.")}),
            "ffn_hidden_size": shapes["layers.0.mlp.gate_proj.weight"][0], "in_channels": in_channels,
            "out_channels": shapes["final_linear.weight"][0] // (patch * patch), "patch_size": patch,
            "text_in_dim": text_in, "rope_axes_dim": [head // 4, head * 3 // 8, head * 3 // 8]}


DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="ErnieImageTransformer2DModel",
    known_configs={"PaddlePaddle/ERNIE-Image transformer": ERNIE_IMAGE_TRANSFORMER_CONFIG},
    marker_keys=("x_embedder.proj.weight", "layers.0.self_attention.to_q.weight", "final_linear.weight",
                 "adaLN_modulation.1.weight"),
    normalize_key=strip_comfyui_prefix, infer_config=dit_config_from_weights,
    description="ERNIE-Image DiT (8B, shared AdaLN, diffusers ErnieImageTransformer2DModel)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="Ministral3Model", config_class_name="Ministral3Config",
    known_configs={"Ministral-3 3B (ERNIE-Image text_encoder)": MINISTRAL3_3B_TEXT_CONFIG},
    marker_keys=MISTRAL3_TEXT_MARKER_KEYS, normalize_key=text_key, convert_state_dict=drop_non_text,
    # the folder's config.json names the multimodal Mistral3Model: its language model's weights are matched instead
    foreign_config_classes=("Mistral3Model", "Mistral3ForConditionalGeneration"),
    infer_config=partial(text_config_from_weights, base=MINISTRAL3_3B_TEXT_CONFIG),
    description="Ministral-3 3B text encoder (second-to-last hidden states; vision tower not loaded)")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKLFlux2",
    known_configs={"PaddlePaddle/ERNIE-Image VAE (FLUX.2 autoencoder)": FLUX2_VAE_CONFIG},
    marker_keys=FLUX2_VAE_MARKER_KEYS, infer_config=flux2_vae_config_from_weights,
    description="ERNIE-Image autoencoder (FLUX.2's, 32 latent channels, BatchNorm-normalised 2x2 patches)")

COMPONENTS = (DIT, TEXT_ENCODER, VAE)
