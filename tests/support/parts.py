"""Tiny random builders for the shared parts (`difftune.parts`): the FLUX.2 autoencoder and Mistral-3 text encoders
in the layouts their official folders use, and a byte-level Mistral-style tokenizer. Seeded: two processes build
bit-identical models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# transformers 5 names -> transformers 4's (the official Mistral-3 files' layout), longest prefix first.
_TO_V4 = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
          ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."),
          ("language_model.", "language_model.model."))


def tiny_flux2_vae(*, latent_channels: int = 4, width: int = 8, seed: int = 0):
    """An AutoencoderKLFlux2 with the official four levels (1/8 of the image, 1/16 once patched) at a tiny width,
    and BatchNorm statistics far from (0, 1), so normalisation shows in every test."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(width,) * 4, layers_per_block=1, latent_channels=latent_channels,
                             norm_num_groups=width, sample_size=64)
    g = torch.Generator().manual_seed(seed + 1)
    n = vae.bn.running_mean.numel()
    vae.bn.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
    vae.bn.running_var.copy_(torch.rand(n, generator=g) * 2 + 0.05)
    return vae.eval()


def mistral_tokenizer(model_max_length: int = 512):
    """A byte-level BPE tokenizer with no merges (one token per byte), Mistral's <unk>/<s>/</s> ids 0/1/2 and <pad>,
    adding <s> in front of every text as Mistral's does. Hand-built, so identical in every process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=model_max_length)


def tiny_text_config(base: dict, *, vocab_size: int, hidden: int = 32, layers: int = 3, heads: int = 2,
                     kv_heads: int = 1, head_dim: int = 16, intermediate: int = 64) -> dict:
    """`base` (a Mistral-3 text config from parts.mistral3) at a tiny size; the head size is the one
    `text_config_from_weights` reads back (the widest dividing both projections)."""
    cfg = {**base, "vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "intermediate_size": intermediate, "pad_token_id": None}
    return cfg


def tiny_mistral3(text_config: dict, *, conditional_generation: bool = False, seed: int = 0):
    """A `Mistral3Model` (ERNIE-Image's class) or `Mistral3ForConditionalGeneration` (FLUX.2-dev's) with a tiny
    Pixtral tower around `text_config`."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Mistral3Model

    vision = {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "head_dim": 8, "patch_size": 4, "image_size": 32}
    config = Mistral3Config(text_config=text_config, vision_config=vision, spatial_merge_size=2,
                            multimodal_projector_bias=False)
    torch.manual_seed(seed)
    cls = Mistral3ForConditionalGeneration if conditional_generation else Mistral3Model
    return cls(config).eval()


def v4_layout(state: dict) -> dict:
    """transformers 5's Mistral-3 names -> transformers 4's, the layout both official files are in."""
    out = {}
    for key, value in state.items():
        for new, old in _TO_V4:
            if key.startswith(new):
                key = old + key[len(new):]
                break
        out[key] = value
    return out


def write_mistral3_folder(model, folder: str | os.PathLike, *, file_name: str = "model.safetensors") -> Path:
    """config.json and the weights in the official files' (transformers 4) layout; a tied LM head is not stored."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.text_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(v4_layout(state), str(folder / file_name))
    (folder / "config.json").write_text(json.dumps(model.config.to_dict(), indent=1, default=str))
    return folder


__all__ = ["mistral_tokenizer", "tiny_flux2_vae", "tiny_mistral3", "tiny_text_config", "v4_layout",
           "write_mistral3_folder"]
