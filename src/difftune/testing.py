"""Tiny, randomly initialised model repositories in the official on-disk layouts.

No weights can be downloaded where difftune is tested, so every test builds a tiny model with the
real architecture (diffusers / transformers classes) and saves it exactly as the official hub
repository is laid out: sharded safetensors with their index, `config.json` beside the weights,
`tokenizer/`, `scheduler/` and `model_index.json`. Everything is deterministic across processes
(fixed seeds, a hand-built tokenizer vocabulary), so two processes writing the same repository get
bit-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The official Qwen/Qwen-Image scheduler/scheduler_config.json.
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>"]


@dataclass
class TinyQwenImageSpec:
    """Sizes of a tiny Qwen-Image. Defaults are the smallest that keep every architectural feature."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple = (8, 4, 4)  # sums to attention_head_dim
    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_intermediate: int = 64
    mrope_section: tuple = (2, 3, 3)  # sums to text head_dim / 2
    vae_base_dim: int = 8
    vae_dim_mult: tuple = (1, 1, 1, 1)  # 4 entries -> x8 spatial downsampling, as the real VAE
    vae_num_res_blocks: int = 1
    zero_cond_t: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict)


def qwen_tokenizer():
    """A byte-level Qwen2 tokenizer with no merges (one token per byte) and the Qwen special tokens.

    Hand-built, so its vocabulary is identical in every process (trained tokenizers are not).
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tok.model_max_length = 2048
    return tok


def tiny_qwen_transformer(spec: TinyQwenImageSpec):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(spec.seed)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=spec.num_layers,
        attention_head_dim=spec.attention_head_dim, num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.text_hidden, guidance_embeds=False, axes_dims_rope=tuple(spec.axes_dims_rope),
        zero_cond_t=spec.zero_cond_t,
    )


def tiny_qwen_vae(spec: TinyQwenImageSpec):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(spec.seed + 1)
    return AutoencoderKLQwenImage(base_dim=spec.vae_base_dim, z_dim=16, dim_mult=list(spec.vae_dim_mult),
                                  num_res_blocks=spec.vae_num_res_blocks, temperal_downsample=[False, True, True])


def tiny_qwen_text_encoder(spec: TinyQwenImageSpec, tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(spec.seed + 2)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads, num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(spec.mrope_section)},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=tok.pad_token_id),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=spec.text_hidden,
                           fullatt_block_indexes=[1], window_size=112),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def _quiet_hf():
    import diffusers
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()


def write_tiny_qwen_image(path: str | os.PathLike, spec: TinyQwenImageSpec | None = None, *, edit: bool = False,
                          shard: bool = True) -> Path:
    """Write a tiny Qwen-Image (or Qwen-Image-Edit with `edit=True`) repository to `path`.

    Layout, as on the hub: `model_index.json`, `scheduler/`, `tokenizer/`, `transformer/` (sharded
    `diffusion_pytorch_model-0000N-of-0000M.safetensors` + index), `text_encoder/` (sharded
    `model-0000N-of-0000M.safetensors` + index), `vae/diffusion_pytorch_model.safetensors`, and for the
    edit model `processor/`.
    """
    _quiet_hf()
    spec = spec or TinyQwenImageSpec()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = qwen_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    transformer = tiny_qwen_transformer(spec)
    text_encoder = tiny_qwen_text_encoder(spec, tok)
    vae = tiny_qwen_vae(spec)
    # Small shard sizes force several shards, as in the real repositories.
    transformer.save_pretrained(root / "transformer", max_shard_size="100KB" if shard else "10GB")
    text_encoder.save_pretrained(root / "text_encoder", max_shard_size="100KB" if shard else "10GB")
    vae.save_pretrained(root / "vae")
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_IMAGE_SCHEDULER_CONFIG, indent=2))
    index = {
        "_class_name": "QwenImageEditPipeline" if edit else "QwenImagePipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    if edit:
        # The official processor/ folder holds the Qwen2-VL image processor config and the tokenizer.
        # Written piecewise: transformers' Qwen2VLProcessor also wants a video processor (torchvision).
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil().save_pretrained(root / "processor")
        tok.save_pretrained(root / "processor")
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    (root / "difftune_tiny_spec.json").write_text(json.dumps(spec.__dict__, indent=2, default=list))
    return root


def tiny_qwen_image_paths(root: str | os.PathLike) -> dict[str, list[str]]:
    """The weight files of a repository written by `write_tiny_qwen_image`, per component, sorted."""
    root = Path(root)
    return {
        "transformer": sorted(str(p) for p in (root / "transformer").glob("diffusion_pytorch_model*.safetensors")),
        "text_encoder": sorted(str(p) for p in (root / "text_encoder").glob("model*.safetensors")),
        "vae": [str(root / "vae" / "diffusion_pytorch_model.safetensors")],
    }


def populate_offline_hub(model_base_path: str | os.PathLike, model_id: str, source: str | os.PathLike) -> Path:
    """Copy a repository into `<model_base_path>/<model_id>/`, where hub ids resolve without a download.

    This is where `ModelConfig(model_id=..., origin_file_pattern=...)` looks first
    (`DIFFTUNE_MODEL_BASE_PATH`, default `./models`).
    """
    dest = Path(model_base_path) / model_id
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    return dest


def write_example_dataset(root: str | os.PathLike, n: int = 4, size: tuple[int, int] = (64, 64)) -> Path:
    """A tiny image data set in the reference's layout: image_<i>.png and metadata.csv (image,prompt)."""
    from PIL import Image, ImageDraw

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    colors = [("red", (220, 40, 40)), ("blue", (40, 60, 220)), ("green", (40, 180, 70)), ("yellow", (230, 220, 50))]
    lines = ["image,prompt"]
    for i in range(n):
        name, rgb = colors[i % len(colors)]
        back_name, back = colors[(i + 1) % len(colors)]
        img = Image.new("RGB", size, back)
        w, h = size
        ImageDraw.Draw(img).ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=rgb)
        img.save(root / f"image_{i + 1}.png")
        lines.append(f'image_{i + 1}.png,"a {name} circle on a {back_name} background"')
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root / "metadata.csv"


def write_example_workspace(root: str | os.PathLike) -> Path:
    """`./models/Qwen/Qwen-Image` (a tiny model in the official layout, where hub ids resolve) and
    `./data/example_image_dataset`, so the reference's command lines run unchanged inside `root`."""
    root = Path(root)
    write_tiny_qwen_image(root / "models" / "Qwen" / "Qwen-Image")
    write_example_dataset(root / "data" / "example_image_dataset")
    return root


# -- FLUX.1 ---------------------------------------------------------------------------------------------

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


def flux_clip_tokenizer():
    """A CLIP BPE tokenizer with no merges: one token per byte-level character (word ends marked `</w>`)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({c + "</w>": len(alphabet) + i for i, c in enumerate(alphabet)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def flux_t5_tokenizer():
    """A T5 (Unigram) tokenizer over single characters, hand-scored so it is identical in every process."""
    from transformers import T5Tokenizer

    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def write_tiny_flux(path: str | os.PathLike, spec: TinyFluxSpec | None = None, *, shard: bool = True) -> Path:
    """Write a tiny FLUX.1-dev repository in the diffusers layout to `path`: `model_index.json`, `scheduler/`,
    `tokenizer/` (CLIP), `tokenizer_2/` (T5), `transformer/` (sharded), `text_encoder/` (CLIPTextModel),
    `text_encoder_2/` (T5EncoderModel, sharded), `vae/` (AutoencoderKL with FLUX's shift and scale)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    _quiet_hf()
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
        vocab_size=len(tok1), hidden_size=spec.clip_hidden, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=spec.clip_hidden, hidden_act="quick_gelu",
        bos_token_id=tok1.bos_token_id, eos_token_id=tok1.eos_token_id, pad_token_id=tok1.pad_token_id)).eval()
    torch.manual_seed(spec.seed + 3)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok2), d_model=spec.t5_hidden, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
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


def write_tiny_flux_bfl(root: str | os.PathLike, *, prefix: str = "") -> dict[str, str]:
    """Write the tiny transformer and AE of `write_tiny_flux(root)` (written first if absent) also as BFL's
    single files at the repository root, as on the hub: `flux1-dev.safetensors` (keys prefixed with `prefix`,
    e.g. ComfyUI's `model.diffusion_model.`) and `ae.safetensors`. Returns {"transformer": ..., "vae": ...}."""
    from safetensors.torch import load_file, save_file

    from .families.flux.bfl import bfl_transformer_from_diffusers

    root = Path(root)
    if not (root / "model_index.json").is_file():
        write_tiny_flux(root)
    paths = tiny_flux_paths(root)
    dit = {}
    for f in paths["transformer"]:
        dit.update(load_file(f))
    bfl = {prefix + k: v.contiguous() for k, v in bfl_transformer_from_diffusers(dit).items()}
    save_file(bfl, str(root / "flux1-dev.safetensors"))
    vae = load_file(paths["vae"][0])
    save_file({k: v.contiguous() for k, v in _ldm_vae_from_diffusers(vae, 4).items()}, str(root / "ae.safetensors"))
    return {"transformer": str(root / "flux1-dev.safetensors"), "vae": str(root / "ae.safetensors")}


# -- tiny families for the family contract suite (tests/families/) -------------------------------------

@dataclass
class TinyFamily:
    """A tiny, randomly initialised set of one family's models plus what training them needs: the family
    contract suite runs every registered family from this (a new family registers one with `register_tiny`)."""

    model_paths: list  # --model_paths entries (a path, or a list of shard paths), one per model
    lora_base_model: str  # the denoiser's slot
    lora_target_modules: str
    # A small image data set in the reference's layout: folder -> metadata file.
    write_dataset: object = None
    flags: tuple = ()  # more flags every run needs (sizes, ...)
    # Other trainable sets to check split == one-stage on: name -> flags.
    trainable_cases: dict = field(default_factory=dict)


_TINY: dict = {}


def register_tiny(family: str, make) -> None:
    """`make(folder) -> TinyFamily` writes the family's tiny models under `folder`."""
    _TINY[family] = make


def tiny_family(family: str, folder: str | os.PathLike) -> TinyFamily:
    if family not in _TINY:
        raise KeyError(f"family {family!r} registers no tiny models for the contract suite "
                       f"(difftune.testing.register_tiny)")
    return _TINY[family](Path(folder))


def _tiny_qwen_image(folder: Path) -> TinyFamily:
    from .families.qwen_image.components import LORA_TARGET_MODULES

    repo = write_tiny_qwen_image(folder / "repo")
    paths = tiny_qwen_image_paths(repo)
    entries = [p if len(p) > 1 else p[0] for p in (paths["transformer"], paths["text_encoder"], paths["vae"])]
    return TinyFamily(model_paths=entries, lora_base_model="dit", lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(48, 32)),
                      flags=("--max_pixels", "4096"),
                      trainable_cases={"text_encoder_lora": (
                          "--lora_base_model", "text_encoder", "--lora_target_modules", "q_proj,v_proj")})


register_tiny("qwen_image", _tiny_qwen_image)


def _tiny_flux(folder: Path) -> TinyFamily:
    from .families.flux.components import LORA_TARGET_MODULES

    paths = tiny_flux_paths(write_tiny_flux(folder / "repo"))
    entries = [p if len(p) > 1 else p[0] for p in paths.values()]
    return TinyFamily(model_paths=entries, lora_base_model="dit", lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(48, 32)),
                      flags=("--max_pixels", "4096"),
                      trainable_cases={
                          "clip_lora": ("--lora_base_model", "text_encoder", "--lora_target_modules", "q_proj,v_proj"),
                          "t5_lora": ("--lora_base_model", "text_encoder_2", "--lora_target_modules", "q,v")})


register_tiny("flux", _tiny_flux)
