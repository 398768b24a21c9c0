"""Tiny Wan repositories in the diffusers layout (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers` and its siblings):
transformer/ (and transformer_2/ for the A14B experts), vae/, text_encoder/ (UMT5), tokenizer/, scheduler/
(UniPC, as the hub's), model_index.json; the I2V 14B variant adds image_encoder/ (CLIP vision) and
image_processor/."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import quiet_hf
from ..tokenizers import t5_tokenizer as flux_t5_tokenizer

VARIANTS = ("t2v", "i2v", "flf2v", "a14b", "i2v_a14b", "ti2v")
CLIP_TOKENS = 17  # the tiny CLIP: 32 px images in 8 px patches, plus the class token

# The hub's Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json (flow_shift 3; 5 for 720p / 14B).
WAN_SCHEDULER_CONFIG = {
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001, "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": 3.0, "lower_order_final": True,
    "num_train_timesteps": 1000, "predict_x0": True, "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False, "sample_max_value": 1.0, "solver_order": 2, "solver_p": None,
    "solver_type": "bh2", "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace",
    "trained_betas": None, "use_beta_sigmas": False, "use_exponential_sigmas": False, "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}


@dataclass
class TinyWanSpec:
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 8
    ffn_dim: int = 32
    text_dim: int = 32
    clip_hidden: int = 32
    vae_base_dim: int = 8
    # the original layout: Wan2.1's level structure (two blocks per level, widths x1, x2, x4, x4), which diffusers'
    # converter assumes
    vae_res_blocks: int = 1
    vae_dim_mult: tuple = (1, 1, 1, 1)
    boundary_ratio: float = 0.875
    # UMT5 encoder size (the benchmark scales it against the DiT)
    t5_layers: int = 2
    t5_heads: int = 4
    t5_d_kv: int = 8
    t5_d_ff: int = 37
    seed: int = 0


def _transformer(variant: str, spec: TinyWanSpec, seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    z = 48 if variant == "ti2v" else 16
    i2v = variant in ("i2v", "flf2v", "i2v_a14b")
    clip = variant in ("i2v", "flf2v")
    inner = spec.num_attention_heads * spec.attention_head_dim
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.num_attention_heads,
        attention_head_dim=spec.attention_head_dim, in_channels=z + (z + 4 if i2v else 0), out_channels=z,
        text_dim=spec.text_dim, freq_dim=16, ffn_dim=spec.ffn_dim, num_layers=spec.num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        image_dim=spec.clip_hidden if clip else None, added_kv_proj_dim=inner if clip else None,
        pos_embed_seq_len=2 * CLIP_TOKENS if variant == "flf2v" else None, rope_max_seq_len=1024)


def _vae(variant: str, spec: TinyWanSpec, seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    if variant == "ti2v":  # Wan2.2's VAE: 48 channels, 2x2 pixel patches then x8: x16
        return AutoencoderKLWan(base_dim=spec.vae_base_dim, decoder_base_dim=spec.vae_base_dim * 2, z_dim=48,
                                dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                                is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                                scale_factor_temporal=4, scale_factor_spatial=16,
                                latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    return AutoencoderKLWan(base_dim=spec.vae_base_dim, z_dim=16, dim_mult=list(spec.vae_dim_mult),
                            num_res_blocks=spec.vae_res_blocks, temperal_downsample=[False, True, True])


def write_tiny_wan(path: str | os.PathLike, variant: str = "t2v", spec: TinyWanSpec | None = None) -> Path:
    """A tiny Wan repository in the diffusers layout. `variant`: t2v (Wan2.1-T2V), i2v (Wan2.1-I2V-14B: CLIP
    image embedding + first-frame condition), a14b (Wan2.2-T2V-A14B: transformer/ high-noise and transformer_2/
    low-noise experts), i2v_a14b (Wan2.2-I2V-A14B: two experts with the first-frame condition, no CLIP), ti2v
    (Wan2.2-TI2V-5B: 48-channel x16 VAE)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    quiet_hf()
    spec = spec or TinyWanSpec()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = flux_t5_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    _transformer(variant, spec, spec.seed).save_pretrained(root / "transformer")
    if variant in ("a14b", "i2v_a14b"):
        _transformer(variant, spec, spec.seed + 10).save_pretrained(root / "transformer_2")
    _vae(variant, spec, spec.seed + 1).save_pretrained(root / "vae")
    torch.manual_seed(spec.seed + 2)
    UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=spec.text_dim, d_kv=spec.t5_d_kv, d_ff=spec.t5_d_ff, num_layers=spec.t5_layers,
        num_heads=spec.t5_heads,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, relative_attention_max_distance=32,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=0,
    )).eval().save_pretrained(root / "text_encoder")
    index = {"_class_name": "WanImageToVideoPipeline" if variant in ("i2v", "flf2v", "i2v_a14b") else "WanPipeline",
             "_diffusers_version": "0.42.1", "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
             "transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"]}
    if variant in ("i2v", "flf2v"):
        torch.manual_seed(spec.seed + 3)
        CLIPVisionModel(CLIPVisionConfig(
            hidden_size=spec.clip_hidden, intermediate_size=37, num_hidden_layers=3, num_attention_heads=2,
            image_size=32, patch_size=8, projection_dim=spec.clip_hidden,
        )).eval().save_pretrained(root / "image_encoder")
        CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
            root / "image_processor")
        index.update(image_encoder=["transformers", "CLIPVisionModel"],
                     image_processor=["transformers", "CLIPImageProcessor"])
    if variant in ("a14b", "i2v_a14b"):
        index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=spec.boundary_ratio)
    if variant == "ti2v":
        index["expand_timesteps"] = True
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(WAN_SCHEDULER_CONFIG, indent=2))
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root


def tiny_wan_paths(root: str | os.PathLike) -> dict[str, list[str]]:
    """The weight files of a repository written by `write_tiny_wan`, per folder (absent folders left out)."""
    root = Path(root)
    out = {}
    for folder, pattern in (("transformer", "diffusion_pytorch_model*.safetensors"),
                            ("transformer_2", "diffusion_pytorch_model*.safetensors"),
                            ("text_encoder", "model*.safetensors"), ("vae", "diffusion_pytorch_model*.safetensors"),
                            ("image_encoder", "model*.safetensors")):
        files = sorted(str(p) for p in (root / folder).glob(pattern))
        if files:
            out[folder] = files
    return out


CLIP_PTH = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"


def write_tiny_wan_original(path: str | os.PathLike, variant: str = "t2v",
                            vae_base_dim: int = 8) -> tuple[Path, Path]:
    """A tiny Wan repository in Wan-AI's ORIGINAL layout, as the reference's commands name its files:
    `diffusion_pytorch_model.safetensors` (Wan's key names) with Wan's own `config.json` (class WanModel) — for
    the A14B variants in `high_noise_model/` and `low_noise_model/` —, `models_t5_umt5-xxl-enc-bf16.pth`,
    `Wan2.1_VAE.pth` (`Wan2.2_VAE.pth` for ti2v), for i2v the CLIP `.pth` (vision tower, with a random
    projection head as open-clip's file has, and a stand-in text-tower tensor that loading drops), and the
    tokenizer in `google/umt5-xxl/`. Written from a diffusers-layout repository of the same tensors (returned
    second) through the inverse of the converters the family loads them with. `vae_base_dim`: the VAE's first
    width (the reference scripts' workspace takes 2: its clips are encoded at the scripts' 480 x 832)."""
    from safetensors.torch import load_file, save_file

    from .original import (clip_vision_to_wan, umt5_to_wan, wan22_vae_to_original, wan_dit_to_original,
                               wan_vae_to_original)

    if variant not in ("t2v", "i2v", "a14b", "i2v_a14b", "ti2v"):
        raise ValueError("the original layout is written for t2v, i2v, a14b, i2v_a14b and ti2v")
    root = Path(path)
    reference = write_tiny_wan(root / "diffusers", variant, TinyWanSpec(vae_res_blocks=2, vae_dim_mult=(1, 2, 4, 4),
                                                                     vae_base_dim=vae_base_dim))
    paths = tiny_wan_paths(reference)
    dits = {"": paths["transformer"]} if "transformer_2" not in paths else \
        {"high_noise_model": paths["transformer"], "low_noise_model": paths["transformer_2"]}
    for folder, files in dits.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        state = {k: v for f in files for k, v in load_file(f).items()}
        save_file({k: v.contiguous() for k, v in wan_dit_to_original(state).items()},
                  str(root / folder / "diffusion_pytorch_model.safetensors"))
        config = json.loads(Path(files[0]).with_name("config.json").read_text())
        (root / folder / "config.json").write_text(json.dumps({  # Wan's own config, not diffusers'
            "_class_name": "WanModel", "dim": config["num_attention_heads"] * config["attention_head_dim"],
            "ffn_dim": config["ffn_dim"], "num_heads": config["num_attention_heads"],
            "num_layers": config["num_layers"], "in_dim": config["in_channels"], "out_dim": config["out_channels"],
            "model_type": "i2v" if config["in_channels"] != config["out_channels"] else "t2v"}))
    torch.save({k: v.contiguous() for k, v in umt5_to_wan(load_file(paths["text_encoder"][0])).items()},
               root / "models_t5_umt5-xxl-enc-bf16.pth")
    vae = load_file(paths["vae"][0])
    if variant == "ti2v":
        torch.save({k: v.contiguous() for k, v in wan22_vae_to_original(vae, num_res_blocks=1).items()},
                   root / "Wan2.2_VAE.pth")
    else:
        torch.save({k: v.contiguous() for k, v in wan_vae_to_original(vae).items()}, root / "Wan2.1_VAE.pth")
    if "image_encoder" in paths:
        # CLIPVisionModel's names lack the `vision_model.` that CLIPVisionModelWithProjection's have
        clip = clip_vision_to_wan({k if k.startswith("vision_model.") else f"vision_model.{k}": v
                                   for k, v in load_file(paths["image_encoder"][0]).items()})
        hidden = clip["visual.pre_norm.weight"].shape[0]
        generator = torch.Generator().manual_seed(5)
        clip["visual.head"] = torch.randn(hidden, hidden, generator=generator) * 0.02
        clip["textual.token_embedding.weight"] = torch.zeros(4, 8)  # the text tower Wan does not use
        clip["log_scale"] = torch.tensor(4.6)
        torch.save(clip, root / CLIP_PTH)
    flux_t5_tokenizer().save_pretrained(root / "google" / "umt5-xxl")
    return root, reference
