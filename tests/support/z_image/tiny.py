"""Tiny, randomly initialised Z-Image models in the layouts the reference's scripts name, and tiny data sets.

`write_tiny_z_image_hub(base)` lays out, under a model base path (`DIFFTUNE_MODEL_BASE_PATH`), what the 17 scripts
load: `Tongyi-MAI/Z-Image-Turbo` (transformer/, text_encoder/, vae/, tokenizer/, scheduler/), `Tongyi-MAI/Z-Image`
(transformer/), `Tongyi-MAI/Z-Image-Omni-Base` (transformer/ with the SigLIP embedder, siglip/) and
`PAI/Z-Image-Turbo-Fun-Controlnet-Union-2.1` (the Union and Tile 2.1 files and their 8-step variants, as single
files at the repository root). Everything is seeded: two processes write bit-identical files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import TinyFamily, quiet_hf, register_tiny, write_example_dataset

SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                    "shift": 3.0, "use_dynamic_shifting": False}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
# One user turn as Qwen3's template renders it (the thinking block only when thinking is switched off).
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
                 "{% endif %}{% endif %}")
CONTROLNET_FILES = ("Z-Image-Turbo-Fun-Controlnet-Union-2.1.safetensors",
                    "Z-Image-Turbo-Fun-Controlnet-Union-2.1-8steps.safetensors",
                    "Z-Image-Turbo-Fun-Controlnet-Tile-2.1.safetensors",
                    "Z-Image-Turbo-Fun-Controlnet-Tile-2.1-8steps.safetensors")


@dataclass
class TinyZImageSpec:
    """Sizes of a tiny Z-Image: every architectural part kept (refiners, SigLIP refiner, two control places)."""

    dim: int = 64
    n_heads: int = 2
    axes_dims: tuple = (8, 12, 12)  # sums to dim / n_heads
    n_layers: int = 3
    n_refiner_layers: int = 2
    # Every Linear of the text encoder takes a multiple of 64 features: bitsandbytes' CPU kernel packs a frozen
    # NF4 layer's weight in blocks of 64 (the QLoRA script quantises it).
    text_hidden: int = 64
    text_layers: int = 2
    text_heads: int = 2
    text_head_dim: int | None = None  # default: text_hidden / text_heads
    text_intermediate: int | None = None  # default: 2 x text_hidden
    siglip_hidden: int = 32
    siglip_patch: int = 4
    siglip_patches: int = 16
    vae_channels: int = 8
    seed: int = 0


def z_image_tokenizer():
    """A byte-level Qwen2 tokenizer with no merges (one token per byte), Qwen3's special tokens and a chat template
    that renders one user turn as Qwen3's does. Hand-built, so identical in every process."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tok.model_max_length = 2048
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _randomise(module: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Give zero-initialised parts (pad tokens, ControlNet projections) random values, so a test sees them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def tiny_dit(spec: TinyZImageSpec, *, omni: bool = False, seed: int = 0):
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(spec.seed + seed)
    dit = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=spec.dim, n_layers=spec.n_layers,
        n_refiner_layers=spec.n_refiner_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_heads,
        cap_feat_dim=spec.text_hidden, siglip_feat_dim=spec.siglip_hidden if omni else None,
        axes_dims=list(spec.axes_dims), axes_lens=[1536, 512, 512])
    _randomise(dit, spec.seed + seed + 100)
    return dit.eval()


def tiny_text_encoder(spec: TinyZImageSpec, tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(spec.seed + 2)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=spec.text_hidden,
                         intermediate_size=spec.text_intermediate or 2 * spec.text_hidden,
                         num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads, num_key_value_heads=1,
                         head_dim=spec.text_head_dim or spec.text_hidden // spec.text_heads,
                         max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=True,
                         bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    return Qwen3ForCausalLM(config).eval()


def tiny_vae(spec: TinyZImageSpec):
    from diffusers import AutoencoderKL

    torch.manual_seed(spec.seed + 3)
    c = spec.vae_channels
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(c,) * 4, layers_per_block=1,
                         latent_channels=16, norm_num_groups=4, sample_size=64, scaling_factor=0.3611,
                         shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False).eval()


def tiny_siglip(spec: TinyZImageSpec):
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

    torch.manual_seed(spec.seed + 4)
    config = Siglip2VisionConfig(hidden_size=spec.siglip_hidden, intermediate_size=37, num_hidden_layers=2,
                                 num_attention_heads=2, num_patches=spec.siglip_patches, patch_size=spec.siglip_patch,
                                 hidden_act="gelu_pytorch_tanh")
    return Siglip2VisionModel(config).eval()


def tiny_controlnet(spec: TinyZImageSpec, seed: int = 0):
    from diffusers import ZImageControlNetModel

    torch.manual_seed(spec.seed + 10 + seed)
    places = list(range(0, spec.n_layers, 2))
    net = ZImageControlNetModel(control_layers_places=places, control_refiner_layers_places=list(
        range(spec.n_refiner_layers)), control_in_dim=33, add_control_noise_refiner="control_noise_refiner",
        dim=spec.dim, n_refiner_layers=spec.n_refiner_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_heads)
    _randomise(net, spec.seed + 20 + seed)
    return net.eval()


def _save_sharded(model, folder: Path, shard: bool) -> None:
    model.save_pretrained(folder, max_shard_size="1MB" if shard else "10GB")


def write_tiny_z_image_turbo(repo: str | os.PathLike, spec: TinyZImageSpec | None = None, *, shard: bool = True
                             ) -> Path:
    """Tongyi-MAI/Z-Image-Turbo's layout: transformer/, text_encoder/, vae/, tokenizer/, scheduler/ and
    model_index.json (what diffusers' `ZImagePipeline.from_pretrained` reads)."""
    quiet_hf()
    spec = spec or TinyZImageSpec()
    turbo = Path(repo)
    tok = z_image_tokenizer()
    tok.save_pretrained(turbo / "tokenizer")
    _save_sharded(tiny_dit(spec), turbo / "transformer", shard)
    _save_sharded(tiny_text_encoder(spec, tok), turbo / "text_encoder", shard)
    tiny_vae(spec).save_pretrained(turbo / "vae")
    _write_scheduler(turbo)
    index = {"_class_name": "ZImagePipeline", "_diffusers_version": "0.42.1",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen3ForCausalLM"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
             "transformer": ["diffusers", "ZImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
    (turbo / "model_index.json").write_text(json.dumps(index, indent=2))
    return turbo


def _write_scheduler(repo: Path) -> None:
    (repo / "scheduler").mkdir(parents=True, exist_ok=True)
    (repo / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))


def write_tiny_z_image_hub(base: str | os.PathLike, spec: TinyZImageSpec | None = None, *, shard: bool = True
                           ) -> Path:
    """Write the tiny models under `base` at the hub ids the scripts name; returns `base`."""
    from safetensors.torch import save_file

    spec = spec or TinyZImageSpec()
    base = Path(base)
    write_tiny_z_image_turbo(base / "Tongyi-MAI" / "Z-Image-Turbo", spec, shard=shard)
    for repo in (base / "Tongyi-MAI" / "Z-Image", base / "Tongyi-MAI" / "Z-Image-Omni-Base"):
        _write_scheduler(repo)
    _save_sharded(tiny_dit(spec, seed=5), base / "Tongyi-MAI" / "Z-Image" / "transformer", shard)
    omni = base / "Tongyi-MAI" / "Z-Image-Omni-Base"
    _save_sharded(tiny_dit(spec, omni=True, seed=6), omni / "transformer", shard)
    tiny_siglip(spec).save_pretrained(omni / "siglip")
    pai = base / "PAI" / "Z-Image-Turbo-Fun-Controlnet-Union-2.1"
    pai.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(CONTROLNET_FILES):
        state = {k: v.contiguous() for k, v in tiny_controlnet(spec, seed=i).state_dict().items()}
        save_file(state, str(pai / name))
    (base / "difftune_tiny_z_image.json").write_text(json.dumps(spec.__dict__, indent=2, default=list))
    return base


def write_single_files(base: str | os.PathLike, out: str | os.PathLike) -> dict[str, Path]:
    """The tiny Turbo DiT and VAE as the single files users download: the DiT in the original Tongyi names behind
    ComfyUI's `model.diffusion_model.` (`z_image_turbo_bf16.safetensors`), the VAE in the LDM layout
    (`ae.safetensors`). `base` holds `write_tiny_z_image_hub`'s models."""
    from safetensors.torch import load_file, save_file

    from ..flux.tiny import _ldm_vae_from_diffusers  # FLUX's AE layout (its test support), which Z-Image ships
    from difftune.families.z_image.components import original_dit_keys

    turbo, out = Path(base) / "Tongyi-MAI" / "Z-Image-Turbo", Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dit = {}
    for f in sorted((turbo / "transformer").glob("*.safetensors")):
        dit.update(load_file(str(f)))
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in original_dit_keys(dit).items()},
              str(out / "z_image_turbo_bf16.safetensors"))
    vae = load_file(str(turbo / "vae" / "diffusion_pytorch_model.safetensors"))
    save_file({k: v.contiguous() for k, v in _ldm_vae_from_diffusers(vae, 4).items()}, str(out / "ae.safetensors"))
    return {"dit": out / "z_image_turbo_bf16.safetensors", "vae": out / "ae.safetensors"}


# the hub repositories the reference's scripts name
TURBO_REPO, BASE_REPO, OMNI_REPO = "Tongyi-MAI/Z-Image-Turbo", "Tongyi-MAI/Z-Image", "Tongyi-MAI/Z-Image-Omni-Base"
CONTROLNET_REPO = "PAI/Z-Image-Turbo-Fun-Controlnet-Union-2.1"


def hub_paths(base: str | os.PathLike, repo: str, folder: str, pattern: str = "*.safetensors") -> list[str]:
    return sorted(str(p) for p in (Path(base) / repo / folder).glob(pattern))


def hub_entry(base: str | os.PathLike, repo: str, folder: str, pattern: str = "*.safetensors"):
    """One --model_paths entry: the folder's file, or its list of shards."""
    paths = hub_paths(base, repo, folder, pattern)
    return paths if len(paths) > 1 else paths[0]


def load_tiny_z_image(base: str | os.PathLike, dit_repo: str = TURBO_REPO, siglip: bool = False,
                      controlnet: str | None = None, dtype=torch.float32):
    """The tiny models of `write_tiny_z_image_hub(base)` as a `ZImagePipeline` (`dit_repo`'s DiT, Turbo's text
    encoder and VAE, Omni-Base's SigLIP2 with `siglip`, the Fun ControlNet file `controlnet`)."""
    from difftune.models import ModelConfig
    from difftune.families.z_image.pipeline import ZImagePipeline

    configs = [ModelConfig(hub_entry(base, dit_repo, "transformer")), ModelConfig(hub_entry(base, TURBO_REPO, "text_encoder")),
               ModelConfig(hub_entry(base, TURBO_REPO, "vae"))]
    if siglip:
        configs.append(ModelConfig(hub_entry(base, OMNI_REPO, "siglip")))
    if controlnet:
        configs.append(ModelConfig(str(Path(base) / CONTROLNET_REPO / controlnet)))
    return ZImagePipeline.from_pretrained(torch_dtype=dtype, device="cpu", model_configs=configs,
                                          tokenizer_config=ModelConfig(str(Path(base) / TURBO_REPO / "tokenizer")))


def turbo_model_paths(base: str | os.PathLike) -> list:
    """--model_paths entries (a shard list where a model is sharded) of the tiny Z-Image-Turbo."""
    entries = [hub_paths(base, "Tongyi-MAI/Z-Image-Turbo", f) for f in ("transformer", "text_encoder", "vae")]
    return [e if len(e) > 1 else e[0] for e in entries]


def write_edit_dataset(root: str | os.PathLike, n: int = 2, size: tuple[int, int] = (32, 32),
                       edit_size: tuple[int, int] = (32, 32)) -> Path:
    """Omni-Base image-to-image data: the example images as targets, each with its colours inverted as `edit_image`
    (metadata.csv: image,prompt,edit_image)."""
    from PIL import Image, ImageOps

    root = Path(root)
    csv = write_example_dataset(root, n=n, size=size)
    rows = csv.read_text().splitlines()
    out = ["image,prompt,edit_image"]
    for i, line in enumerate(rows[1:], 1):
        image = line.split(",", 1)[0]
        ImageOps.invert(Image.open(root / image).convert("RGB")).resize(edit_size).save(root / f"edit_{i}.png")
        out.append(f"{line},edit_{i}.png")
    csv.write_text("\n".join(out) + "\n")
    return csv


def write_control_dataset(root: str | os.PathLike, n: int = 2, size: tuple[int, int] = (32, 32)) -> Path:
    """Fun ControlNet data: the example images with an edge map of each as `controlnet_image`
    (metadata.csv: image,prompt,controlnet_image)."""
    from PIL import Image, ImageFilter

    root = Path(root)
    csv = write_example_dataset(root, n=n, size=size)
    rows = csv.read_text().splitlines()
    out = ["image,prompt,controlnet_image"]
    for i, line in enumerate(rows[1:], 1):
        image = line.split(",", 1)[0]
        Image.open(root / image).convert("L").filter(ImageFilter.FIND_EDGES).convert("RGB").save(
            root / f"control_{i}.png")
        out.append(f"{line},control_{i}.png")
    csv.write_text("\n".join(out) + "\n")
    return csv


def omni_model_paths(base: str | os.PathLike, siglip: bool = True) -> list:
    """--model_paths entries of the tiny Omni-Base (its DiT and SigLIP2, Z-Image-Turbo's text encoder and VAE)."""
    entries = [hub_paths(base, "Tongyi-MAI/Z-Image-Omni-Base", "transformer")]
    if siglip:
        entries.append(hub_paths(base, "Tongyi-MAI/Z-Image-Omni-Base", "siglip"))
    entries += [hub_paths(base, "Tongyi-MAI/Z-Image-Turbo", f) for f in ("text_encoder", "vae")]
    return [e if len(e) > 1 else e[0] for e in entries]


def _tiny_z_image(folder: Path) -> TinyFamily:
    from ..common import TinyVariant
    from difftune.families.z_image.components import LORA_TARGET_MODULES

    base = write_tiny_z_image_hub(folder / "hub")
    size = (32, 32)
    controlnet = str(base / "PAI" / "Z-Image-Turbo-Fun-Controlnet-Union-2.1" / CONTROLNET_FILES[0])
    variants = {
        "omni": TinyVariant(model_paths=omni_model_paths(base, siglip=False)),
        "edit": TinyVariant(flags=("--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image"),
                            write_dataset=lambda root: write_edit_dataset(root, n=2, size=size, edit_size=(48, 32)),
                            model_paths=omni_model_paths(base)),
        "controlnet": TinyVariant(flags=("--data_file_keys", "image,controlnet_image", "--extra_inputs",
                                         "controlnet_image"),
                                  write_dataset=lambda root: write_control_dataset(root, n=2, size=size),
                                  model_paths=[*turbo_model_paths(base), controlnet]),
    }
    return TinyFamily(model_paths=turbo_model_paths(base), lora_base_model="dit",
                      lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=size),
                      flags=("--max_pixels", "1024"), optional_slots=("image_encoder", "controlnet"),
                      trainable_cases={"text_encoder_lora": ("--lora_base_model", "text_encoder",
                                                             "--lora_target_modules", "q_proj,v_proj")},
                      # measured: 7.9e-6 after one step, 1.7e-5 after two, on layers.1's w2 LoRA (lr 1e-3), the
                      # Adam effect the field describes; 3.8e-5 for batch 2 against accumulation 2 since the training
                      # table is float32 (other timesteps by one ulp, other round-off); Z-Image's own split test holds
                      # 1e-5 at its settings
                      split_tolerance=5e-5, variants=variants)


register_tiny("z_image", _tiny_z_image)

__all__ = ["BASE_REPO", "CONTROLNET_FILES", "CONTROLNET_REPO", "OMNI_REPO", "TURBO_REPO", "TinyZImageSpec", "hub_entry", "hub_paths",
           "load_tiny_z_image", "omni_model_paths", "turbo_model_paths",
           "write_control_dataset", "write_edit_dataset", "write_single_files", "write_tiny_z_image_hub",
           "write_tiny_z_image_turbo",
           "z_image_tokenizer"]
