"""Tiny FLUX.1 repositories: the diffusers layout and BFL's single files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import quiet_hf, write_example_dataset
from ..tokenizers import clip_tokenizer, t5_tokenizer



# The official black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json.
FLUX_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


@dataclass
class TinyFluxSpec:
    """Sizes of a tiny FLUX.1-dev (guidance embedder on, double and single blocks)."""

    num_layers: int = 1
    num_single_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple = (4, 6, 6)  # sums to attention_head_dim
    guidance_embeds: bool = True
    clip_hidden: int = 32
    t5_hidden: int = 32
    vae_channels: int = 8
    seed: int = 0
    # encoder depths and widths (the benchmarks' proportional model sets them; the defaults are the tests')
    clip_layers: int = 2
    clip_intermediate: int = 37
    t5_layers: int = 2
    t5_heads: int = 4
    t5_d_kv: int = 8
    t5_d_ff: int = 37


flux_clip_tokenizer, flux_t5_tokenizer = clip_tokenizer, t5_tokenizer  # FLUX.1's two tokenizers, tiny


def write_tiny_flux(path: str | os.PathLike, spec: TinyFluxSpec | None = None, *, shard: bool = True) -> Path:
    """Write a tiny FLUX.1-dev repository in the diffusers layout to `path`: `model_index.json`, `scheduler/`,
    `tokenizer/` (CLIP), `tokenizer_2/` (T5), `transformer/` (sharded), `text_encoder/` (CLIPTextModel),
    `text_encoder_2/` (T5EncoderModel, sharded), `vae/` (AutoencoderKL with FLUX's shift and scale)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    quiet_hf()
    spec = spec or TinyFluxSpec()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok1, tok2 = flux_clip_tokenizer(), flux_t5_tokenizer()
    tok1.save_pretrained(root / "tokenizer")
    tok2.save_pretrained(root / "tokenizer_2")
    torch.manual_seed(spec.seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=spec.num_layers, num_single_layers=spec.num_single_layers,
        attention_head_dim=spec.attention_head_dim, num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.t5_hidden, pooled_projection_dim=spec.clip_hidden,
        guidance_embeds=spec.guidance_embeds, axes_dims_rope=tuple(spec.axes_dims_rope))
    torch.manual_seed(spec.seed + 1)
    c = spec.vae_channels
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(c,) * 4, layers_per_block=1,
                        latent_channels=16, norm_num_groups=4, sample_size=64, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    torch.manual_seed(spec.seed + 2)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok1), hidden_size=spec.clip_hidden, intermediate_size=spec.clip_intermediate,
        num_hidden_layers=spec.clip_layers,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=spec.clip_hidden, hidden_act="quick_gelu",
        bos_token_id=tok1.bos_token_id, eos_token_id=tok1.eos_token_id, pad_token_id=tok1.pad_token_id)).eval()
    torch.manual_seed(spec.seed + 3)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok2), d_model=spec.t5_hidden, d_kv=spec.t5_d_kv, d_ff=spec.t5_d_ff,
        num_layers=spec.t5_layers, num_heads=spec.t5_heads,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, relative_attention_max_distance=32,
        pad_token_id=tok2.pad_token_id, eos_token_id=tok2.eos_token_id, decoder_start_token_id=0)).eval()
    size = "100KB" if shard else "10GB"
    transformer.save_pretrained(root / "transformer", max_shard_size=size)
    vae.save_pretrained(root / "vae")
    clip.save_pretrained(root / "text_encoder")
    t5.save_pretrained(root / "text_encoder_2", max_shard_size=size)
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(FLUX_SCHEDULER_CONFIG, indent=2))
    index = {
        "_class_name": "FluxPipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    (root / "difftune_tiny_spec.json").write_text(json.dumps(spec.__dict__, indent=2, default=list))
    return root


def tiny_flux_paths(root: str | os.PathLike) -> dict[str, list[str]]:
    """The weight files of a repository written by `write_tiny_flux`, per component, sorted."""
    root = Path(root)

    def files(folder, pattern):
        return sorted(str(p) for p in (root / folder).glob(pattern))

    return {"transformer": files("transformer", "diffusion_pytorch_model*.safetensors"),
            "text_encoder": files("text_encoder", "model*.safetensors"),
            "text_encoder_2": files("text_encoder_2", "model*.safetensors"),
            "vae": files("vae", "diffusion_pytorch_model*.safetensors")}


def _ldm_vae_from_diffusers(state: dict, num_up_blocks: int) -> dict:
    """diffusers AutoencoderKL names -> the LDM layout of BFL's ae.safetensors (test data: the inverse of
    diffusers' convert_ldm_vae_checkpoint; LDM numbers the decoder's up blocks from the bottom)."""
    import re

    out = {}
    for key, t in state.items():
        k = re.sub(r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", key)
        k = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", k)
        k = re.sub(r"up_blocks\.(\d+)\.resnets\.",
                   lambda m: f"up.{num_up_blocks - 1 - int(m[1])}.block.", k)
        k = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0\.",
                   lambda m: f"up.{num_up_blocks - 1 - int(m[1])}.upsample.", k)
        k = k.replace("mid_block.resnets.0.", "mid.block_1.").replace("mid_block.resnets.1.", "mid.block_2.")
        k = k.replace("conv_shortcut.", "nin_shortcut.").replace("conv_norm_out.", "norm_out.")
        if "mid_block.attentions.0." in k:
            k = k.replace("mid_block.attentions.0.", "mid.attn_1.")
            for new, old in (("group_norm.", "norm."), ("to_q.", "q."), ("to_k.", "k."), ("to_v.", "v."),
                             ("to_out.0.", "proj_out.")):
                k = k.replace(new, old)
            if t.dim() == 2:  # LDM's attention projections are 1x1 convolutions
                t = t[:, :, None, None]
        out[k] = t
    return out


def write_tiny_flux_bfl(root: str | os.PathLike, *, prefix: str = "", name: str = "flux1-dev.safetensors"
                        ) -> dict[str, str]:
    """Write the tiny transformer and AE of `write_tiny_flux(root)` (written first if absent) also as BFL's
    single files at the repository root, as on the hub: `name` (`flux1-dev.safetensors`; Krea and Kontext
    ship the same layout as `flux1-krea-dev.safetensors`, `flux1-kontext-dev.safetensors`; keys prefixed with
    `prefix`, e.g. ComfyUI's `model.diffusion_model.`) and `ae.safetensors`. Returns {"transformer": ...,
    "vae": ...}."""
    from safetensors.torch import load_file, save_file

    from difftune.families.flux.bfl import bfl_transformer_from_diffusers

    root = Path(root)
    if not (root / "model_index.json").is_file():
        write_tiny_flux(root)
    paths = tiny_flux_paths(root)
    dit = {}
    for f in paths["transformer"]:
        dit.update(load_file(f))
    bfl = {prefix + k: v.contiguous() for k, v in bfl_transformer_from_diffusers(dit).items()}
    save_file(bfl, str(root / name))
    vae = load_file(paths["vae"][0])
    save_file({k: v.contiguous() for k, v in _ldm_vae_from_diffusers(vae, 4).items()}, str(root / "ae.safetensors"))
    return {"transformer": str(root / name), "vae": str(root / "ae.safetensors")}


def write_kontext_dataset(root: str | os.PathLike, n: int = 2, size: tuple[int, int] = (48, 32),
                          kontext_size: tuple[int, int] | None = None, references: int = 1) -> Path:
    """A tiny FLUX.1 Kontext data set: the example images (`write_example_dataset`) as targets, each with
    `references` reference images (`kontext_<i>_<j>.png`, the target's colours swapped, of `kontext_size`).
    One reference: `metadata.csv` (image,prompt,kontext_images); more: `metadata.json` with a list per row."""
    from PIL import Image, ImageOps

    root = Path(root)
    csv = write_example_dataset(root, n=n, size=size)
    lines = csv.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines[1:], 1):
        image, prompt = line.split(",", 1)
        refs = []
        for j in range(references):
            ref = ImageOps.invert(Image.open(root / image).convert("RGB")).rotate(90 * j, expand=True)
            ref = ref.resize(kontext_size or ref.size)
            ref.save(root / f"kontext_{i}_{j + 1}.png")
            refs.append(f"kontext_{i}_{j + 1}.png")
        rows.append({"image": image, "prompt": json.loads(prompt), "kontext_images": refs})
    if references == 1:
        csv.write_text("image,prompt,kontext_images\n" + "".join(
            f'{r["image"]},"{r["prompt"]}",{r["kontext_images"][0]}\n' for r in rows))
        return csv
    csv.unlink()
    (root / "metadata.json").write_text(json.dumps(rows, indent=1))
    return root / "metadata.json"
