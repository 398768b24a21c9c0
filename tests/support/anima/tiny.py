"""Tiny, randomly initialised Anima models in the layout the reference's scripts name, and the tokenizers.

`write_tiny_anima_hub(base)` lays out, under a model base path (`DIFFTUNE_MODEL_BASE_PATH`):
`circlestone-labs/Anima/split_files/diffusion_models/anima-preview.safetensors` (MiniTrainDIT's names behind `net.`,
its LLM adapter as `net.llm_adapter.*`), `.../text_encoders/qwen_3_06b_base.safetensors` (a Qwen3 backbone as
`model.*`), `.../vae/qwen_image_vae.safetensors` (the Qwen-Image VAE in the original Wan-2.1 layout),
`Qwen/Qwen3-0.6B/` (the tokenizer at the root) and `stabilityai/stable-diffusion-3.5-large/tokenizer_3/` (T5).
The DiT is 512 wide (4 heads of 128) so that the reference's automatic LoRA choice (Linear layers of at least 512
features in block lists) finds its attention and MLP layers; the rest is tiny. Seeded: identical in every process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import TinyFamily, quiet_hf, register_tiny, write_example_dataset
from ..qwen_parts import qwen3_vl_tokenizer
from ..tokenizers import t5_tokenizer

REPO = "circlestone-labs/Anima"
DIT_FILE = "split_files/diffusion_models/anima-preview.safetensors"
TEXT_ENCODER_FILE = "split_files/text_encoders/qwen_3_06b_base.safetensors"
VAE_FILE = "split_files/vae/qwen_image_vae.safetensors"
QWEN_REPO = "Qwen/Qwen3-0.6B"
T5_REPO, T5_FOLDER = "stabilityai/stable-diffusion-3.5-large", "tokenizer_3"


@dataclass
class TinyAnimaSpec:
    heads: int = 4
    head_dim: int = 128  # 512 wide: the automatic LoRA choice's minimum
    layers: int = 2
    mlp_ratio: float = 1.0
    adaln_lora_dim: int = 16
    text_hidden: int = 32  # the tiny Qwen3's width = the adapter's source_dim
    text_layers: int = 2
    adapter_dim: int = 32  # the adapter's width = the DiT's text_embed_dim
    adapter_layers: int = 2
    adapter_heads: int = 2
    t5_vocab: int = 128
    vae_base_dim: int = 4
    seed: int = 0


def tiny_dit_config(spec: TinyAnimaSpec | None = None) -> dict:
    from difftune.families.anima.components import ANIMA_CONDITIONER_CONFIG, COSMOS_ANIMA_CONFIG

    spec = spec or TinyAnimaSpec()
    return {"transformer_config": {**COSMOS_ANIMA_CONFIG, "num_attention_heads": spec.heads,
                            "attention_head_dim": spec.head_dim, "num_layers": spec.layers,
                            "mlp_ratio": spec.mlp_ratio, "text_embed_dim": spec.adapter_dim,
                            "adaln_lora_dim": spec.adaln_lora_dim},
            "conditioner_config": {**ANIMA_CONDITIONER_CONFIG, "source_dim": spec.text_hidden,
                                 "target_dim": spec.adapter_dim, "model_dim": spec.adapter_dim,
                                 "num_layers": spec.adapter_layers, "num_attention_heads": spec.adapter_heads,
                                 "target_vocab_size": spec.t5_vocab}}


def tiny_anima_dit(spec: TinyAnimaSpec | None = None, seed: int | None = None):
    """difftune's AnimaTransformer (diffusers' CosmosTransformer3DModel + AnimaTextConditioner) at tiny sizes; the
    zero-initialised parts given random values so a test sees them."""
    from difftune.families.anima.components import AnimaTransformer

    spec = spec or TinyAnimaSpec()
    seed = spec.seed if seed is None else seed
    torch.manual_seed(seed)
    dit = AnimaTransformer(**tiny_dit_config(spec))
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for _, p in sorted(dit.named_parameters()):
            if not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return dit.eval()


def tiny_qwen3(spec: TinyAnimaSpec | None = None, vocab_size: int = 300):
    from transformers import Qwen3Config, Qwen3Model

    spec = spec or TinyAnimaSpec()
    torch.manual_seed(spec.seed + 2)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=spec.text_hidden, intermediate_size=2 * spec.text_hidden,
                         num_hidden_layers=spec.text_layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, tie_word_embeddings=True, max_position_embeddings=1024)
    return Qwen3Model(config).eval()


def tiny_vae(spec: TinyAnimaSpec | None = None):
    """The Qwen-Image VAE at a tiny width (the official level multiples and two residual blocks per level: the
    structure the original layout, and diffusers' converter of it, has)."""
    from diffusers import AutoencoderKLQwenImage

    from difftune.parts.qwen_image_vae import QWEN_IMAGE_VAE_CONFIG

    spec = spec or TinyAnimaSpec()
    torch.manual_seed(spec.seed + 3)
    return AutoencoderKLQwenImage(base_dim=spec.vae_base_dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                  temperal_downsample=[False, True, True],
                                  latents_mean=QWEN_IMAGE_VAE_CONFIG["latents_mean"],
                                  latents_std=QWEN_IMAGE_VAE_CONFIG["latents_std"]).eval()


def _save(state: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


# The contract suite names its LoRA targets, so its DiT need not be 512 wide: 64 (2 heads of 32) trains faster.
CONTRACT_SPEC = TinyAnimaSpec(heads=2, head_dim=32, mlp_ratio=2.0)


def write_tiny_anima_hub(base: str | os.PathLike, spec: TinyAnimaSpec | None = None) -> Path:
    """Everything the two Anima scripts name, under a model base path; returns `base`."""
    from difftune.families.anima.components import original_dit_keys

    from ..wan.original import wan_vae_to_original

    quiet_hf()
    spec = spec or TinyAnimaSpec()
    base = Path(base)
    repo = base / REPO
    _save(original_dit_keys(tiny_anima_dit(spec).state_dict()), repo / DIT_FILE)
    tok = qwen3_vl_tokenizer()
    tok.save_pretrained(base / QWEN_REPO)
    _save({f"model.{k}": v for k, v in tiny_qwen3(spec, vocab_size=len(tok)).state_dict().items()},
          repo / TEXT_ENCODER_FILE)
    _save(wan_vae_to_original(tiny_vae(spec).state_dict()), repo / VAE_FILE)
    t5_tokenizer().save_pretrained(base / T5_REPO / T5_FOLDER)
    return base


def anima_model_paths(base: str | os.PathLike) -> list[str]:
    """--model_paths entries of the tiny Anima (the three split files)."""
    return [str(Path(base) / REPO / f) for f in (DIT_FILE, TEXT_ENCODER_FILE, VAE_FILE)]


def load_tiny_anima(base: str | os.PathLike, dtype=torch.float32):
    """The tiny models of `write_tiny_anima_hub(base)` as an `AnimaPipeline`, with both tokenizers."""
    from difftune.families.anima.pipeline import AnimaPipeline
    from difftune.models import ModelConfig

    pipe = AnimaPipeline.from_pretrained(torch_dtype=dtype, device="cpu",
                                         model_configs=[ModelConfig(p) for p in anima_model_paths(base)],
                                         tokenizer_config=ModelConfig(str(Path(base) / QWEN_REPO)),
                                         tokenizer_t5xxl_config=ModelConfig(str(Path(base) / T5_REPO / T5_FOLDER)))
    return pipe


def write_tokenizers_beside(base: str | os.PathLike) -> Path:
    """Both tokenizers also beside the text encoder's folder (`split_files/tokenizer/`, `split_files/tokenizer_3/`),
    where a run that names none finds them (the release has none there: the scripts name them by hub id)."""
    files = Path(base) / REPO / "split_files"
    qwen3_vl_tokenizer().save_pretrained(files / "tokenizer")
    t5_tokenizer().save_pretrained(files / T5_FOLDER)
    return Path(base)


def _tiny_anima(folder: Path) -> TinyFamily:
    base = write_tokenizers_beside(write_tiny_anima_hub(folder / "hub", CONTRACT_SPEC))
    return TinyFamily(model_paths=anima_model_paths(base), lora_base_model="dit",
                      lora_target_modules="to_q,to_k,to_v,to_out.0,q_proj,v_proj",
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(32, 32)),
                      flags=("--max_pixels", "1024"),
                      trainable_cases={"text_encoder_lora": ("--lora_base_model", "text_encoder",
                                                             "--lora_target_modules", "q_proj,v_proj")})


register_tiny("anima", _tiny_anima)

__all__ = ["CONTRACT_SPEC", "DIT_FILE", "QWEN_REPO", "REPO", "T5_FOLDER", "T5_REPO", "TEXT_ENCODER_FILE", "TinyAnimaSpec", "VAE_FILE",
           "anima_model_paths", "load_tiny_anima", "tiny_anima_dit", "tiny_dit_config", "tiny_qwen3", "tiny_vae",
           "write_tiny_anima_hub", "write_tokenizers_beside"]
