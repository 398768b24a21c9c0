"""Tiny Nexus-GenV2: `edit_decoder.bin` (a plain tensor state dict: the DiT as `pipe.dit.*` in the reference's
FluxDiT names, the embedding merger as `embedding_merger.*`), as DiffSynth-Studio/Nexus-GenV2 ships it."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def diffsynth_dit_state(transformer) -> dict[str, torch.Tensor]:
    """A diffusers FLUX transformer's weights in the reference's FluxDiT names (the inverse of
    `nexus_gen.diffsynth_dit_to_bfl` after BFL's layout), final modulation in (scale, shift) order."""
    from difftune.families.flux.nexus_gen import _DOUBLE, _GLOBAL, _SINGLE, _swap_halves
    from .flex2 import bfl_state

    inverse = {"double_blocks": {v: k for k, v in _DOUBLE.items()}, "single_blocks": {v: k for k, v in _SINGLE.items()}}
    glob = {v: k for k, v in _GLOBAL.items()}
    out = {}
    for key, t in bfl_state(transformer).items():
        module, _, param = key.rpartition(".")
        head, _, rest = module.partition(".")
        if head in inverse:
            index, _, name = rest.partition(".")
            new = inverse[head][name]
            param = "weight" if param == "scale" else param
            out[f"{'blocks' if head == 'double_blocks' else 'single_blocks'}.{index}.{new}.{param}"] = t
        else:
            out[f"{glob[module]}.{param}"] = _swap_halves(t) if module == "final_layer.adaLN_modulation.1" else t
    return out


def tiny_merger(hidden: int = 32, out_channels: int = 32, seed: int = 0):
    from difftune.families.flux.nexus_gen import NexusGenEmbeddingMerger

    torch.manual_seed(seed)
    model = NexusGenEmbeddingMerger(hidden_size=hidden, num_attention_heads=hidden // 16,
                                    num_key_value_heads=1, intermediate_size=2 * hidden, num_layers=1,
                                    out_channels=out_channels, expand_ratio=2, mrope_section=(2, 3, 3))
    with torch.no_grad():  # RMSNorm weights start at 1: perturbed so that their names matter in tests
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def write_tiny_nexus_decoder(root: str | os.PathLike, *, qwen_hidden: int = 32, seed: int = 0) -> Path:
    """`<root>/edit_decoder.bin`: a tiny FLUX.1-dev DiT (prompt width 32) and a tiny merger from a
    `qwen_hidden`-wide Qwen2.5-VL to 32-wide prompt tokens. Returns the file."""
    from .flex2 import tiny_flux_transformer

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    state = {"pipe.dit." + k: v.contiguous() for k, v in diffsynth_dit_state(tiny_flux_transformer(seed=seed)).items()}
    state.update({"embedding_merger." + k: v.contiguous()
                  for k, v in tiny_merger(qwen_hidden, 32, seed + 1).state_dict().items()})
    path = root / "edit_decoder.bin"
    torch.save(state, str(path))
    return path


def nexus_release_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `NexusGenAR`'s weights in Nexus-GenV2's names (transformers 4.49's Qwen2.5-VL: `visual.*`,
    `model.layers.*`, `lm_head.weight`, plus `vision_head.weight`, `image_prefill_embeds.weight`)."""
    out = {}
    for k, v in state.items():
        for new, old in (("model.model.visual.", "visual."), ("model.model.language_model.", "model."),
                         ("model.lm_head.", "lm_head.")):
            if k.startswith(new):
                k = old + k[len(new):]
                break
        out[k] = v.contiguous()
    return out


def write_tiny_nexus_ar(root: str | os.PathLike, *, seed: int = 0) -> tuple[Path, dict]:
    """`<root>/model.safetensors` (Nexus-GenV2's names, hidden width 32) and `<root>/processor/` (tokenizer and
    image processor). Returns the file and the `NexusGenAR` config it was built from."""
    from safetensors.torch import save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..qwen_image import TinyQwenImageSpec, qwen_tokenizer, tiny_qwen_text_encoder
    from difftune.families.flux.nexus_gen import NexusGenAR

    root = Path(root)
    (root / "processor").mkdir(parents=True, exist_ok=True)
    tok = qwen_tokenizer()
    qwen = tiny_qwen_text_encoder(TinyQwenImageSpec(seed=seed), tok)
    torch.manual_seed(seed + 1)
    model = NexusGenAR(qwen_config=qwen.config.to_dict())
    model.model.load_state_dict(qwen.state_dict())
    save_file(nexus_release_names(model.state_dict()), str(root / "model.safetensors"))
    tok.save_pretrained(root / "processor")
    Qwen2VLImageProcessorPil().save_pretrained(root / "processor")
    return root / "model.safetensors", {"_class_name": "NexusGenAR", **{k: v for k, v in model.config.items() if not k.startswith("_")}}
