"""Recognition of LongCat-Video's DiT files (the released config, or one inferred from the shapes) and the
reference's LoRA targets, which are its module names."""

from __future__ import annotations

import math

from ....models.detect import ComponentSpec
from .model import LongCatVideoTransformer3DModel, swiglu_width

# the reference's LoRA targets for LongCat-Video (lora/LongCat-Video.sh), which are this model's module names
LORA_TARGET_MODULES = ("adaLN_modulation.1,attn.qkv,attn.proj,cross_attn.q_linear,cross_attn.kv_linear,"
                       "cross_attn.proj,ffn.w1,ffn.w2,ffn.w3")

LONGCAT_VIDEO_CONFIG = {"_class_name": "LongCatVideoTransformer3DModel", "in_channels": 16, "out_channels": 16,
                        "hidden_size": 4096, "depth": 48, "num_heads": 32, "caption_channels": 4096, "mlp_ratio": 4,
                        "adaln_tembed_dim": 512, "frequency_embedding_size": 256, "patch_size": [1, 2, 2],
                        "text_tokens_zero_pad": True}


def infer_longcat_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A bare LongCat-Video DiT's config from its shapes (the heads show in the per-head norms; the MLP ratio is
    4, the released one, where it gives the SwiGLU's width, else the smallest of 1..8 in quarter steps that does)."""
    try:
        hidden, cin = shapes["x_embedder.proj.weight"][:2]
        patch = list(shapes["x_embedder.proj.weight"][2:])
        depth = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        head_dim = shapes["blocks.0.attn.q_norm.weight"][0]
        width = shapes["blocks.0.ffn.w1.weight"][0]
        ratio = next(r / 4 for r in (16, *range(4, 33)) if swiglu_width(int(hidden * r / 4)) == width)
        tembed, freq = shapes["t_embedder.mlp.0.weight"]
        return dict(LONGCAT_VIDEO_CONFIG, in_channels=cin, out_channels=shapes["final_layer.linear.weight"][0] //
                    math.prod(patch), hidden_size=hidden, depth=depth, num_heads=hidden // head_dim,
                    caption_channels=shapes["y_embedder.y_proj.0.weight"][1], mlp_ratio=ratio,
                    adaln_tembed_dim=tembed, frequency_embedding_size=freq, patch_size=patch)
    except (KeyError, IndexError, ValueError, StopIteration):
        return None


LONGCAT_DIT = ComponentSpec(
    name="dit", library=LongCatVideoTransformer3DModel.__module__,
    class_name="LongCatVideoTransformer3DModel",
    known_configs={"LongCat-Video": LONGCAT_VIDEO_CONFIG},
    marker_keys=("x_embedder.proj.weight", "blocks.0.attn.qkv.weight", "final_layer.linear.weight"),
    infer_config=infer_longcat_config,
    description="LongCat-Video DiT (meituan-longcat/LongCat-Video dit/diffusion_pytorch_model*.safetensors)")


__all__ = ["LONGCAT_DIT", "LONGCAT_VIDEO_CONFIG", "LORA_TARGET_MODULES", "infer_longcat_config"]
