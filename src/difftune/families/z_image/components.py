"""Z-Image components: the official configs, how their checkpoints are recognised, the scheduler config.

Classes are diffusers' (`ZImageTransformer2DModel`, `ZImageControlNetModel`, `AutoencoderKL`) and transformers'
(`Qwen3ForCausalLM`, `Siglip2VisionModel`), so the official folders load with their own key names:
Tongyi-MAI/Z-Image(-Turbo) `transformer/`, `text_encoder/` (Qwen3-4B), `vae/` (the FLUX.1 autoencoder),
Z-Image-Omni-Base `siglip/` (SigLIP2 so400m, 27 layers), and PAI's Fun ControlNet single files, whose keys are
already diffusers' `ZImageControlNetModel` names.

Single files users download (ComfyUI's `z_image_turbo_bf16.safetensors` and alike) keep the original Tongyi names
(`x_embedder`, `final_layer`, fused `attention.qkv`, `attention.out`, `q_norm`), often behind
`model.diffusion_model.`: they are converted whole by diffusers' own single-file converter. BFL-layout autoencoders
(`ae.safetensors`) by diffusers' LDM converter.
"""

from __future__ import annotations

from functools import partial

from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.flux_ae import AE_MARKER_KEYS, FLUX1_VAE_CONFIG, convert_ldm_ae
from ...parts.qwen3 import QWEN3_4B_CONFIG, QWEN3_MARKER_KEYS, drop_lm_head, qwen3_config_from_weights, qwen3_key

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a static shift of 3 (no dynamic shifting).
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

# The reference's DiT targets (its scripts' --lora_target_modules): every attention projection and the SwiGLU.
LORA_TARGET_MODULES = "to_q,to_k,to_v,to_out.0,w1,w2,w3"

Z_IMAGE_TRANSFORMER_CONFIG = {
    "_class_name": "ZImageTransformer2DModel",
    "all_f_patch_size": [1],
    "all_patch_size": [2],
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560,
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}
# Z-Image-Omni-Base: the same DiT plus the SigLIP embedder and refiner (so400m's 1152 features).
Z_IMAGE_OMNI_TRANSFORMER_CONFIG = {**Z_IMAGE_TRANSFORMER_CONFIG, "siglip_feat_dim": 1152}

# Z-Image-Omni-Base siglip/: SigLIP2 so400m (patch 16, at most 256 patches).
SIGLIP2_SO400M_CONFIG = {
    "architectures": ["Siglip2VisionModel"],
    "attention_dropout": 0.0,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "layer_norm_eps": 1e-06,
    "model_type": "siglip2_vision_model",
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 27,
    "num_patches": 256,
    "patch_size": 16,
}


# -- keys ---------------------------------------------------------------------------------------------

def siglip_key(key: str) -> str:
    """The official siglip/ file (saved by transformers 4) names the tower `vision_model.*`; transformers>=5's
    Siglip2VisionModel has no such level (its own save_pretrained writes the short names)."""
    return key[len("vision_model."):] if key.startswith("vision_model.") else key


def convert_original_dit(state: dict) -> dict:
    """The original Tongyi names (fused qkv, `x_embedder`, `final_layer`, ...) -> diffusers', by diffusers'
    single-file converter (it pops from what it is given, so it gets a copy)."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    if not any(k.endswith(".attention.qkv.weight") or k.startswith("x_embedder.") for k in state):
        raise KeyError("not the original Z-Image layout")
    return convert_z_image_transformer_checkpoint_to_diffusers(dict(state))


def original_dit_keys(state: dict) -> dict:
    """diffusers' DiT names -> the original Tongyi names (q, k, v fused into qkv): the inverse of
    `convert_original_dit`, for `--full_format original` and the single-file test models."""
    import torch

    out, qkv = {}, {}
    for key, value in state.items():
        k = key.replace("all_x_embedder.2-1.", "x_embedder.").replace("all_final_layer.2-1.", "final_layer.")
        k = k.replace(".attention.to_out.0.", ".attention.out.").replace(".attention.norm_q.", ".attention.q_norm.")
        k = k.replace(".attention.norm_k.", ".attention.k_norm.")
        for i, p in enumerate(("to_q", "to_k", "to_v")):
            if f".attention.{p}.weight" in k:
                qkv.setdefault(k.replace(f".attention.{p}.weight", ".attention.qkv.weight"), [None] * 3)[i] = value
                break
        else:
            out[k] = value
    for k, parts in qkv.items():
        out[k] = torch.cat(parts, dim=0)
    return out


# -- configs from the weights ------------------------------------------------------------------------

def _count(shapes, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})


def dit_config_from_weights(shapes: dict) -> dict | None:
    """A Z-Image DiT of any depth and width; the RoPE axes split the head as the official 32/48/48 of 128 do (the
    split is not in the weights)."""
    if "x_pad_token" not in shapes or "layers.0.attention.norm_q.weight" not in shapes:
        return None
    dim = shapes["x_pad_token"][-1]
    head = shapes["layers.0.attention.norm_q.weight"][0]
    if head % 8 or dim % head:
        return None
    config = {**Z_IMAGE_TRANSFORMER_CONFIG, "axes_dims": [head // 4, head * 3 // 8, head * 3 // 8], "dim": dim, "n_heads": dim // head, "n_kv_heads": dim // head,
              "n_layers": _count(shapes, "layers."), "n_refiner_layers": _count(shapes, "noise_refiner."),
              "cap_feat_dim": shapes["cap_embedder.1.weight"][1],
              "in_channels": shapes["all_x_embedder.2-1.weight"][1] // 4}
    if "siglip_embedder.1.weight" in shapes:
        config["siglip_feat_dim"] = shapes["siglip_embedder.1.weight"][1]
    return config


def controlnet_config_from_weights(shapes: dict) -> dict | None:
    """A Fun ControlNet (Union / Tile 2.1 and their 8-step variants) from its weights: one control block at every
    second DiT layer (the Fun layout: layer 2i is fed by control block i), a control noise refiner beside each of
    the DiT's refiner layers, `control_in_dim` = 16 control latent channels + 1 mask + 16 inpaint latent ones."""
    if "control_all_x_embedder.2-1.weight" not in shapes or "control_layers.0.before_proj.weight" not in shapes:
        return None
    dim = shapes["control_layers.0.before_proj.weight"][0]
    head = shapes["control_layers.0.attention.norm_q.weight"][0]
    blocks = _count(shapes, "control_layers.")
    refiners = _count(shapes, "control_noise_refiner.")
    if not refiners:
        return None  # 1.0 / 2.0 layouts: not a model the reference trains
    return {"_class_name": "ZImageControlNetModel", "control_layers_places": list(range(0, 2 * blocks, 2)),
            "control_refiner_layers_places": list(range(refiners)), "add_control_noise_refiner": "control_noise_refiner",
            "control_in_dim": shapes["control_all_x_embedder.2-1.weight"][1] // 4, "all_patch_size": [2],
            "all_f_patch_size": [1], "dim": dim, "n_refiner_layers": refiners, "n_heads": dim // head,
            "n_kv_heads": dim // head, "norm_eps": 1e-05, "qk_norm": True}


def siglip_config_from_weights(shapes: dict) -> dict | None:
    """SigLIP2's vision tower at the so400m head size (72) of any depth and width."""
    emb = shapes.get("embeddings.patch_embedding.weight")
    if emb is None or len(emb) != 2:  # SigLIP2 embeds patches with a Linear; SigLIP's convolution is another model
        return None
    hidden, patch_dim = emb
    return {**SIGLIP2_SO400M_CONFIG, "hidden_size": hidden, "patch_size": int(round((patch_dim / 3) ** 0.5)),
            "num_hidden_layers": _count(shapes, "encoder.layers."),
            "intermediate_size": shapes["encoder.layers.0.mlp.fc1.weight"][0],
            "num_patches": shapes["embeddings.position_embedding.weight"][0],
            "num_attention_heads": max(1, hidden // 72)}


# -- specs --------------------------------------------------------------------------------------------

DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="ZImageTransformer2DModel",
    known_configs={"Tongyi-MAI/Z-Image(-Turbo) transformer": Z_IMAGE_TRANSFORMER_CONFIG,
                   "Tongyi-MAI/Z-Image-Omni-Base transformer": Z_IMAGE_OMNI_TRANSFORMER_CONFIG},
    marker_keys=("cap_embedder.1.weight", "x_pad_token", "layers.0.feed_forward.w1.weight"),
    normalize_key=strip_comfyui_prefix, infer_config=dit_config_from_weights, description="Z-Image S3-DiT (6B)")

# The original single-file layout: same class and configs, converted whole (fused qkv split).
DIT_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="ZImageTransformer2DModel", known_configs=DIT.known_configs,
    marker_keys=("x_embedder.weight", "cap_embedder.1.weight", "x_pad_token"), normalize_key=strip_comfyui_prefix,
    convert_state_dict=convert_original_dit, infer_config=dit_config_from_weights,
    description="Z-Image S3-DiT, original single-file layout (ComfyUI's z_image_*.safetensors)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="Qwen3Model", config_class_name="Qwen3Config",
    known_configs={"Qwen3-4B (Z-Image text_encoder)": QWEN3_4B_CONFIG},
    marker_keys=QWEN3_MARKER_KEYS, normalize_key=qwen3_key, convert_state_dict=drop_lm_head,
    # the folder's config.json names the causal LM: the weights are matched (backbone shapes) instead
    foreign_config_classes=("Qwen3ForCausalLM",), infer_config=qwen3_config_from_weights, description="Qwen3-4B text encoder (second-to-last hidden states)")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKL",
    known_configs={"Tongyi-MAI/Z-Image-Turbo VAE (FLUX.1 AE)": FLUX1_VAE_CONFIG}, marker_keys=AE_MARKER_KEYS,
    description="Z-Image autoencoder (FLUX.1's, 16 latent channels)")

VAE_LDM = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKL", known_configs=VAE.known_configs,
    marker_keys=("encoder.down.0.block.0.conv1.weight", "decoder.up.0.block.0.conv1.weight"),
    convert_state_dict=partial(convert_ldm_ae, config=FLUX1_VAE_CONFIG),
    description="Z-Image autoencoder, single-file ae.safetensors layout")

IMAGE_ENCODER = ComponentSpec(
    name="image_encoder", library="transformers", class_name="Siglip2VisionModel",
    config_class_name="Siglip2VisionConfig", known_configs={"SigLIP2 so400m (Z-Image-Omni-Base siglip/)":
                                                             SIGLIP2_SO400M_CONFIG},
    marker_keys=("embeddings.patch_embedding.weight", "post_layernorm.weight"), normalize_key=siglip_key,
    infer_config=siglip_config_from_weights, description="SigLIP2 image encoder (Omni-Base edit images)")

CONTROLNET = ComponentSpec(
    name="controlnet", library="diffusers", class_name="ZImageControlNetModel",
    marker_keys=("control_all_x_embedder.2-1.weight", "control_layers.0.before_proj.weight"),
    normalize_key=strip_comfyui_prefix, infer_config=controlnet_config_from_weights,
    description="Z-Image-Turbo Fun ControlNet (Union / Tile 2.1)")

COMPONENTS = (DIT, TEXT_ENCODER, VAE, IMAGE_ENCODER, CONTROLNET, DIT_ORIGINAL, VAE_LDM)
