"""Wan components in the diffusers layout (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers` and its siblings): what each slot
holds, the reference's LoRA target names, and the repository's sampling scheduler.

Weights with a config.json beside them (diffusers' `_class_name`, transformers' `architectures`) are recognised
from it. The original Wan-AI files (.pth UMT5 / VAE / CLIP, DiT safetensors in Wan's own key names) are not
mapped yet.
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
    from ...models.load import _directory

    folder = _directory(path_or_config, "scheduler")
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
