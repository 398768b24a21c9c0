"""A tiny Wan-AI/Wan2.2-Animate-2-14B as the reference's split scripts name it: `videomodel/Wan-AI/` with the UMT5
and CLIP .pth files (and the tokenizer), `wan_animate_2/wan_animate_2_bf16.safetensors` and
`..._distillation.safetensors` in the released names (blocks.N.block.self_attn.q, ...); the VAE comes from
Wan-AI/Wan2.1-T2V-14B (`Wan2.1_VAE.pth`). The CLIP is 1280 wide: diffusers' class fixes its image projection's
input at CLIP ViT-H's width."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from difftune.families.wan.animate2 import ANIMATE2_ORIGINAL, animate2_to_original
from difftune.families.wan.components import IMAGE_ENCODER_ORIGINAL
from .common import TINY, TINY_INNER, base_known_configs, save_tensors, write_base_repo

CLIP_WIDTH = 1280
CLIP_PTH = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
FILES = {"wan_animate_2_bf16.safetensors": 0, "wan_animate_2_bf16_distillation.safetensors": 1}
TINY_LAYERS = 10  # the unguided pass skips block 9


def tiny_animate2_transformer(seed: int = TINY.seed + 60, num_layers: int = TINY_LAYERS):
    """diffusers' WanAnimate2Transformer3DModel at the tiny width (the released depth is 40 blocks: the reference's
    full-training script names blocks 0-39)."""
    from diffusers import WanAnimate2Transformer3DModel

    torch.manual_seed(seed)
    return WanAnimate2Transformer3DModel(dim=TINY_INNER, num_heads=TINY.num_attention_heads, ffn_dim=TINY.ffn_dim,
                                         text_dim=TINY.text_dim, freq_dim=16, num_layers=num_layers, in_dim=36,
                                         out_dim=16).eval()


def _clip_pth(path: Path) -> dict:
    """A one-layer CLIP ViT at the real width in open-clip's layout (Wan's .pth); returns its CLIPVisionConfig."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from .original import clip_vision_to_wan

    torch.manual_seed(TINY.seed + 61)
    config = CLIPVisionConfig(hidden_size=CLIP_WIDTH, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, image_size=32, patch_size=8, projection_dim=CLIP_WIDTH)
    model = CLIPVisionModel(config).eval()
    clip = clip_vision_to_wan({f"vision_model.{k}" if not k.startswith("vision_model.") else k: v
                               for k, v in model.state_dict().items()})
    clip["visual.head"] = torch.randn(CLIP_WIDTH, CLIP_WIDTH, generator=torch.Generator().manual_seed(6)) * 0.02
    torch.save({k: v.contiguous() for k, v in clip.items()}, path)
    return {**config.to_dict(), "architectures": ["CLIPVisionModelWithProjection"]}


def write_tiny_animate2_original(path, vae_repo=None) -> tuple[Path, list[tuple]]:
    """The tiny repository at `path`; the VAE goes to `vae_repo`/Wan2.1_VAE.pth (the scripts take it from
    Wan-AI/Wan2.1-T2V-14B), else beside UMT5. Returns the folder and the (spec, label, config) the tests add to the
    official configs."""
    root = Path(path)
    video = root / "videomodel" / "Wan-AI"
    _, twin = write_base_repo(video, "t2v")
    if vae_repo is not None:
        Path(vae_repo).mkdir(parents=True, exist_ok=True)
        shutil.move(str(video / "Wan2.1_VAE.pth"), str(Path(vae_repo) / "Wan2.1_VAE.pth"))
    # the reference's default tokenizer folder is Wan-AI/Wan2.1-T2V-1.3B:google/umt5-xxl/; this one sits beside UMT5
    clip = _clip_pth(video / CLIP_PTH)
    known = base_known_configs(twin) + [(IMAGE_ENCODER_ORIGINAL, "tiny animate-2", clip)]
    for name, offset in FILES.items():
        model = tiny_animate2_transformer(seed=TINY.seed + 60 + offset)
        save_tensors(animate2_to_original(model.state_dict()), root / "wan_animate_2" / name)
    config = {k: v for k, v in tiny_animate2_transformer().config.items() if not k.startswith("_")}
    known.append((ANIMATE2_ORIGINAL, "tiny", {"_class_name": "WanAnimate2Transformer3DModel", **config}))
    return root, known


__all__ = ["CLIP_WIDTH", "tiny_animate2_transformer", "write_tiny_animate2_original"]
