"""FLUX.2 LoRA files where users load them, at the trained strength (rank 4, alpha 8: alpha / rank is 2), on the tiny
klein-4B with the reference's target list (every attention projection, both feed-forwards, the single blocks' fused
projections):

- diffusers' `Flux2KleinPipeline.load_lora_weights` (Flux2LoraLoaderMixin) reads the default (diffusers) layout with
  every tensor used, and samples what difftune samples with the LoRA fused;
- the reference's own loader (Flux2ImagePipeline keeps the base pipeline's GeneralLoRALoader; its DiT has diffusers'
  module names; a leading `diffusion_model.` dropped, tests/support/lora_readers.py) reads
  `--lora_format comfyui` (diffusers' names behind `diffusion_model.`), every module found, to difftune's fused
  weights; the default layout's `transformer.` names match none of its modules.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from difftune.families.flux2.components import LORA_TARGET_MODULES
from support.lora_readers import diffsynth_fuse, diffsynth_general_convert
from support import write_example_dataset
from support.flux2 import KLEIN_4B, klein_model_paths, load_tiny_klein, write_tiny_flux2_hub

KW = dict(height=32, width=32, num_inference_steps=2)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_flux2_hub(tmp_path_factory.mktemp("flux2_hub"))


@pytest.fixture(scope="module")
def loras(hub, tmp_path_factory):
    """The same training (same seed) saved in the default layout and in the comfyui one."""
    root = tmp_path_factory.mktemp("flux2_lora")
    meta = write_example_dataset(root / "data", n=2, size=(32, 32))
    out = {}
    for layout in ("diffusers", "comfyui"):
        run_train("--task", "sft", "--dataset_base_path", root / "data", "--dataset_metadata_path", meta,
                  "--output_path", root / layout, "--model_paths", json.dumps(klein_model_paths(hub)),
                  "--tokenizer_path", hub / KLEIN_4B / "tokenizer", "--torch_dtype", "float32",
                  "--learning_rate", 5e-2, "--max_steps", 2, "--seed", 5, "--no_progress", "--max_pixels", 1024,
                  "--enable_tensorboard_log", "false", "--lora_base_model", "dit", "--lora_target_modules",
                  LORA_TARGET_MODULES, "--lora_rank", 4, "--lora_alpha", 8, "--lora_format", layout)
        out[layout] = next((root / layout).glob("*.safetensors"))
    return out


def _diffusers(hub, path=None):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(hub / KLEIN_4B), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if path is None:
        return pipe, []
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("diffusers").addHandler(handler)
    try:
        pipe.load_lora_weights(str(path), adapter_name="ours")
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    return pipe, [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_diffusers_loads_every_tensor_and_samples_as_difftune(hub, loras):
    from peft.utils import get_peft_model_state_dict

    saved = load_file(str(loras["diffusers"]))
    assert all(k.startswith("transformer.") for k in saved)
    theirs, warnings = _diffusers(hub, loras["diffusers"])
    assert warnings == []
    loaded = get_peft_model_state_dict(theirs.transformer, adapter_name="ours")
    modules = {k[len("transformer."):].rpartition(".lora_")[0] for k in saved}
    # 5 double blocks x 12 modules, 20 single blocks x 2
    assert {k.rpartition(".lora_")[0] for k in loaded} == modules and len(modules) == 5 * 12 + 20 * 2
    plain = load_file(str(loras["comfyui"]))
    module = "single_transformer_blocks.3.attn.to_qkv_mlp_proj"
    ab = plain[f"diffusion_model.{module}.lora_B.weight"] @ plain[f"diffusion_model.{module}.lora_A.weight"]
    scale = theirs.transformer.peft_config["ours"].lora_alpha / theirs.transformer.peft_config["ours"].r
    theirs_ab = loaded[f"{module}.lora_B.weight"] @ loaded[f"{module}.lora_A.weight"] * scale
    assert float(plain[f"diffusion_model.{module}.alpha"]) == 8.0
    assert torch.allclose(theirs_ab, 2 * ab, atol=1e-6)
    args = dict(generator=torch.Generator().manual_seed(0), guidance_scale=1.0, output_type="latent", **KW)
    with_lora = theirs(prompt="a red circle", **args).images
    args["generator"] = torch.Generator().manual_seed(0)
    base = _diffusers(hub)[0](prompt="a red circle", **args).images
    ours = load_tiny_klein(hub)
    ours.load_lora(ours.dit, str(loras["diffusers"]))
    mine = ours("a red circle", seed=0, output_type="pt", progress=False, **KW)
    theirs_image = theirs.vae.decode(with_lora).sample.float() / 2 + 0.5
    diff = (mine - theirs_image.clamp(0, 1)).abs().max().item()
    moved = (with_lora - base).abs().max().item()
    print(f"flux2 LoRA: diffusers vs difftune fused, image max difference {diff:.2e}; the LoRA moves the latents by "
          f"{moved:.2e}")
    assert diff <= 1e-5 and moved > 1e-3


def test_the_reference_loader_reads_the_comfyui_layout_at_the_trained_strength(hub, loras):
    comfy, default = load_file(str(loras["comfyui"])), load_file(str(loras["diffusers"]))
    modules = {k.rpartition(".lora_")[0] for k in comfy if ".lora_" in k}
    assert all(re.match(r"diffusion_model\.(single_)?transformer_blocks\.", m) for m in modules)
    base = load_tiny_klein(hub).dit.state_dict()
    weights = {k[: -len(".weight")]: v for k, v in base.items() if k.endswith(".weight") and v.dim() == 2}
    theirs, unmatched = diffsynth_fuse(weights, comfy, diffsynth_general_convert)
    assert unmatched == set() and len(modules) == 5 * 12 + 20 * 2
    ours = load_tiny_klein(hub)
    ours.load_lora(ours.dit, str(loras["diffusers"]))
    mine = ours.dit.state_dict()
    diff = max((theirs[k] - mine[f"{k}.weight"]).abs().max().item() for k in theirs)
    moved = max((theirs[k] - weights[k]).abs().max().item() for k in theirs)
    print(f"flux2 comfyui LoRA fused by the reference's loader vs difftune's default file fused: {diff:.2e} (the LoRA "
          f"moves the weights by {moved:.2e})")
    assert diff <= 1e-6 and moved > 1e-4
    _, unmatched = diffsynth_fuse(weights, default, diffsynth_general_convert)
    assert len(unmatched) == len(modules)  # transformer.<module>: none found


def test_every_module_is_one_comfyui_maps_for_flux2(loras):
    """ComfyUI's FLUX LoRA key map (comfy/lora.py: for its Flux models, FLUX.2's class included, `transformer.<diffusers
    name>` through comfy/utils.py's flux_to_diffusers) names, per double block, attn.to_q/to_k/to_v and
    add_q/k/v_proj (slices of the fused img/txt qkv), attn.to_out.0, attn.to_add_out, ff.linear_in/out and
    ff_context.linear_in/out, and per single block attn.to_qkv_mlp_proj (linear1) and attn.to_out (linear2): every
    module of the default file is one, and it holds only LoRA pairs (alpha folded into B: ComfyUI's scale 1)."""
    mapped = re.compile(r"transformer\.(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|"
                        r"add_v_proj|to_out\.0|to_add_out)|ff\.linear_(in|out)|ff_context\.linear_(in|out))|"
                        r"single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out))")
    keys = load_file(str(loras["diffusers"])).keys()
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert all(mapped.fullmatch(k.rpartition(".lora_")[0]) for k in keys)
