"""Tiny Step1X-Edit: `step1x-edit-i1258.safetensors` (the DiT in BFL's names beside the connector's `connector.S.*`
names, one file, as stepfun-ai/Step1X-Edit ships it)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# the release's refiner names <- diffusers' (the inverse of step1x._REFINER / _BLOCK)


def connector_release_state(connector) -> dict[str, torch.Tensor]:
    """A `Step1XConnector`'s weights in the release's names (`connector.S.individual_token_refiner.blocks.0.
    self_attn_qkv.weight`, q/k/v fused)."""
    from difftune.families.flux.step1x import _BLOCK, _REFINER

    sd = connector.state_dict()
    out = {"connector.scale_factor": sd["scale_factor"]}
    for k, v in sd.items():
        if k.startswith("global_proj_out."):
            out["connector." + k] = v
        elif k.startswith("refiner.token_refiner.refiner_blocks."):
            index, _, rest = k[len("refiner.token_refiner.refiner_blocks."):].partition(".")
            prefix = f"connector.S.individual_token_refiner.blocks.{index}."
            if rest.startswith("attn.to_q."):
                param = rest[len("attn.to_q."):]
                base = f"refiner.token_refiner.refiner_blocks.{index}.attn."
                out[prefix + "self_attn_qkv." + param] = torch.cat([sd[base + p + "." + param]
                                                                    for p in ("to_q", "to_k", "to_v")])
            elif not rest.startswith(("attn.to_k.", "attn.to_v.")):
                old = next(o + rest[len(n):] for o, n in _BLOCK if rest.startswith(n))
                out[prefix + old] = v
        elif k.startswith("refiner."):
            rest = k[len("refiner."):]
            out["connector.S." + next(o + rest[len(n):] for o, n in _REFINER if rest.startswith(n))] = v
    return {k: v.contiguous() for k, v in out.items()}


def tiny_connector(in_channels: int = 32, width: int = 32, seed: int = 0):
    from difftune.families.flux.step1x import Step1XConnector

    torch.manual_seed(seed)
    model = Step1XConnector(in_channels=in_channels, num_attention_heads=2, attention_head_dim=width // 2,
                            num_layers=2, pooled_dim=32)
    # the release's modulations are trained, not zero: random so that they matter in tests
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def write_tiny_step1x(root: str | os.PathLike, *, qwen_hidden: int = 32, seed: int = 0) -> Path:
    """`<root>/step1x-edit-i1258.safetensors`: a tiny FLUX DiT without guidance embedder (prompt width 32, pooled
    32) and a tiny connector from a `qwen_hidden`-wide Qwen2.5-VL. Returns the file."""
    from safetensors.torch import save_file

    from .flex2 import bfl_state, tiny_flux_transformer

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    dit = tiny_flux_transformer(guidance_embeds=False, seed=seed)
    state = {**bfl_state(dit), **connector_release_state(tiny_connector(qwen_hidden, 32, seed + 1))}
    path = root / "step1x-edit-i1258.safetensors"
    save_file(state, str(path))
    return path


def write_tiny_qwen25vl(root: str | os.PathLike, *, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL in the layout of Qwen/Qwen2.5-VL-7B-Instruct's repository root (`model-0000N-of-0000M.
    safetensors` + index, config.json, the tokenizer and the image processor's preprocessor_config.json), hidden
    width 32. Returns the folder."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..qwen_image import TinyQwenImageSpec, qwen_tokenizer, tiny_qwen_text_encoder

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tok = qwen_tokenizer()
    tiny_qwen_text_encoder(TinyQwenImageSpec(seed=seed), tok).save_pretrained(root, max_shard_size="200KB")
    tok.save_pretrained(root)
    Qwen2VLImageProcessorPil().save_pretrained(root)
    return root


def step1x_processor(folder: str | os.PathLike):
    """The Qwen2.5-VL processor of a `write_tiny_qwen25vl` folder at the reference's pixel bounds for Step1X-Edit
    (256 to 324 merged 28 x 28 patches)."""
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..qwen_image import qwen_vl_processor
    from difftune.families.flux.step1x import STEP1X_MAX_PIXELS, STEP1X_MIN_PIXELS

    proc = qwen_vl_processor(folder)
    proc.image_processor = Qwen2VLImageProcessorPil.from_pretrained(
        str(folder), size={"shortest_edge": STEP1X_MIN_PIXELS, "longest_edge": STEP1X_MAX_PIXELS})
    assert isinstance(proc.tokenizer, Qwen2Tokenizer)
    return proc
