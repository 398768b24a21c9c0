"""Wan-Dancer's released layout: the Wan base in Wan-AI's names (through diffusers' converter), the Dancer's own
modules as they are; its config and the recognition of its files."""

from __future__ import annotations

import torch

from ....models.detect import ComponentSpec
from ..components import WAN_DIT_CONFIGS
from .model import DANCER_INJECT_LAYERS, WanDancerTransformer

# the Dancer's own modules (the rest of the file is Wan's DiT)
DANCER_MODULE_PREFIXES = ("music_injector.", "img_emb_refimage.", "music_projection.", "music_encoder.",
                   "patch_embedding_global.", "head_global.", "ref_conv.", "img_emb_refface.")


def dancer_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released file (Wan-AI's names) -> `WanDancerTransformer`'s: the Wan base through diffusers' converter,
    the Dancer's modules as they are (their names are the model's)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    extras = {k: v for k, v in state.items() if k.startswith(DANCER_MODULE_PREFIXES)}
    base = {k: v for k, v in state.items() if not k.startswith(DANCER_MODULE_PREFIXES)}
    return {**convert_wan_transformer_to_diffusers(base), **extras}


def dancer_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`WanDancerTransformer`'s state dict -> the released file's names (--full_format original)."""
    from ..dit_keys import dit_to_original

    extras = {k: v for k, v in state.items() if k.startswith(DANCER_MODULE_PREFIXES)}
    base = {k: v for k, v in state.items() if not k.startswith(DANCER_MODULE_PREFIXES)}
    return {**dit_to_original(base), **extras}


DANCER_14B_CONFIG = dict({k: v for k, v in WAN_DIT_CONFIGS["Wan2.1-I2V-14B"].items()},
                         _class_name="WanDancerTransformer", music_inject_layers=DANCER_INJECT_LAYERS,
                         enable_music_inject=True, enable_refimage=True, enable_global=True, enable_dynamicfps=True,
                         enable_unimodel=True, has_ref_conv=True, music_latent_dim=256, music_heads=4, music_ff=1024,
                         music_layers=2, music_dropout=0.1)


def infer_dancer_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A bare Dancer DiT's config from its (converted) shapes; Wan's 128-channel heads; the injected blocks as the
    released list for 40 blocks and 8 injectors, else spread evenly."""
    try:
        dim, cin = shapes["patch_embedding.weight"][:2]
        layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        injectors = 1 + max((int(k.split(".")[2]) for k in shapes if k.startswith("music_injector.injector.")),
                            default=-1)
        image = shapes.get("condition_embedder.image_embedder.norm1.weight", (None,))[0]
        heads = max(1, dim // 128)
        config = dict(DANCER_14B_CONFIG, num_attention_heads=heads, attention_head_dim=dim // heads,
                      in_channels=cin, out_channels=shapes["proj_out.weight"][0] // 4, num_layers=layers,
                      ffn_dim=shapes["blocks.0.ffn.net.0.proj.weight"][0],
                      text_dim=shapes["condition_embedder.text_embedder.linear_1.weight"][1],
                      freq_dim=shapes["condition_embedder.time_embedder.linear_1.weight"][1], image_dim=image,
                      added_kv_proj_dim=dim if image else None,
                      enable_music_inject=injectors > 0, enable_refimage="img_emb_refimage.proj.1.weight" in shapes,
                      enable_unimodel="patch_embedding_global.weight" in shapes,
                      has_ref_conv="ref_conv.weight" in shapes)
        if "music_projection.weight" in shapes:
            config.update(music_latent_dim=shapes["music_projection.weight"][0],
                          music_ff=shapes["music_encoder.0.linear1.weight"][0],
                          music_layers=1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("music_encoder.")))
        config["music_inject_layers"] = DANCER_INJECT_LAYERS if (layers, injectors) == (40, 8) else \
            [round(i * (layers - 1) / max(injectors - 1, 1)) for i in range(injectors)]
        return config
    except (KeyError, IndexError, ValueError):
        return None


DANCER_DIT = ComponentSpec(
    name="dit", library=WanDancerTransformer.__module__, class_name="WanDancerTransformer",
    known_configs={"Wan-Dancer-14B": DANCER_14B_CONFIG},
    marker_keys=("music_projection.weight", "blocks.0.self_attn.q.weight", "head.modulation"),
    convert_state_dict=dancer_from_original, infer_config=infer_dancer_config,
    description="Wan-Dancer-14B DiT (Wan-AI/Wan-Dancer-14B global_model / local_model .safetensors)")


__all__ = ["DANCER_14B_CONFIG", "DANCER_DIT", "DANCER_MODULE_PREFIXES", "dancer_from_original", "dancer_to_original",
           "infer_dancer_config"]
