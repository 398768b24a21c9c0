"""ERNIE-Image LoRA files where users load them, at the trained strength (rank 4, alpha 8: alpha / rank is 2). The
reference's DiT has diffusers' module names, so its `--lora_target_modules` need no translation and one file
serves every reader:

- diffusers' `ErnieImagePipeline.load_lora_weights` (ErnieImageLoraLoaderMixin) reads the default (diffusers)
  layout, every tensor used, and samples what difftune samples with the LoRA fused; it refuses the comfyui layout
  (its `.alpha` tensors are not "lora" keys), which is why that is not the default;
- the reference's own loader (GeneralLoRALoader: a leading `diffusion_model.` dropped, B @ A * alpha / rank fused
  into the module of that name) reads `--lora_format comfyui`, every module found, to difftune's fused weights;
  the default file's `transformer.` names match none of its modules;
- ComfyUI (comfy/ldm/ernie/model.py, `model_base.ErnieImage`) builds the DiT with diffusers' module names, so its
  generic key map (`diffusion_model.<module>` + `.alpha`) takes the comfyui layout.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from difftune.families.ernie_image.components import LORA_TARGET_MODULES
from support import write_example_dataset
from support.ernie_image import REPO, ernie_image_model_paths, load_tiny_ernie_image, write_tiny_ernie_image_hub
from support.lora_readers import diffsynth_general_convert

KW = dict(height=32, width=32, num_inference_steps=2)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_ernie_image_hub(tmp_path_factory.mktemp("ernie_image_hub"))


@pytest.fixture(scope="module")
def loras(hub, tmp_path_factory):
    """The same training (same seed) saved in the default layout and in the comfyui one."""
    root = tmp_path_factory.mktemp("ernie_image_lora")
    meta = write_example_dataset(root / "data", n=2, size=(32, 32))
    out = {}
    for layout in ("default", "comfyui"):
        flags = () if layout == "default" else ("--lora_format", layout)
        run_train("--task", "sft", "--dataset_base_path", root / "data", "--dataset_metadata_path", meta,
                  "--output_path", root / layout, "--model_paths", json.dumps(ernie_image_model_paths(hub)),
                  "--torch_dtype", "float32", "--learning_rate", 5e-2, "--max_steps", 2, "--seed", 5, "--no_progress",
                  "--max_pixels", 1024, "--enable_tensorboard_log", "false", "--lora_base_model", "dit",
                  "--lora_target_modules", LORA_TARGET_MODULES, "--lora_rank", 4, "--lora_alpha", 8, *flags)
        out[layout] = next((root / layout).glob("*.safetensors"))
    return out


def _diffusers(hub, path=None):
    from diffusers import (AutoencoderKLFlux2, ErnieImagePipeline, ErnieImageTransformer2DModel,
                           FlowMatchEulerDiscreteScheduler)
    from transformers import AutoTokenizer

    ours = load_tiny_ernie_image(hub)  # its text encoder: the same backbone diffusers' Mistral3Model runs
    repo = hub / REPO
    pipe = ErnieImagePipeline(transformer=ErnieImageTransformer2DModel.from_pretrained(repo / "transformer"),
                              vae=AutoencoderKLFlux2.from_pretrained(repo / "vae"), text_encoder=ours.text_encoder,
                              tokenizer=AutoTokenizer.from_pretrained(repo / "tokenizer"),
                              scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(repo / "scheduler"))
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


def _noise(seed):
    from difftune.core.latents import seeded_noise

    return seeded_noise((128, 2, 2), seed, 1, device="cpu")


def test_comfyui_file_is_diffusion_model_names_with_alpha(loras):
    """Every module is one of ComfyUI's ErnieImageModel (its blocks' self_attention.to_q/to_k/to_v/to_out.0)."""
    keys = load_file(str(loras["comfyui"])).keys()
    modules = {k.rpartition(".lora_")[0] if ".lora_" in k else k.rpartition(".alpha")[0] for k in keys}
    pattern = re.compile(r"diffusion_model\.layers\.\d+\.self_attention\.(to_q|to_k|to_v|to_out\.0)")
    assert all(pattern.fullmatch(m) for m in modules) and len(modules) == 2 * 4
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight", ".alpha")) for k in keys)


def test_diffusers_refuses_the_comfyui_layout(hub, loras):
    with pytest.raises(ValueError, match="lora"):
        _diffusers(hub, loras["comfyui"])


def test_diffusers_loads_every_tensor_of_the_default_file_and_samples_as_difftune(hub, loras):
    layout = "default"
    from peft.utils import get_peft_model_state_dict

    saved = load_file(str(loras[layout]))
    theirs, warnings = _diffusers(hub, loras[layout])
    assert warnings == []
    loaded = get_peft_model_state_dict(theirs.transformer, adapter_name="ours")
    modules = {re.sub(r"^(transformer|diffusion_model)\.", "", k).rpartition(".lora_")[0] for k in saved
               if ".lora_" in k}
    assert {k.rpartition(".lora_")[0] for k in loaded} == modules  # every module of the file, nothing else
    # the strength: B @ A as diffusers applies it is the trained alpha / rank (2) times the comfyui file's B @ A
    plain = load_file(str(loras["comfyui"]))
    module = "layers.1.self_attention.to_v"
    ab = plain[f"diffusion_model.{module}.lora_B.weight"] @ plain[f"diffusion_model.{module}.lora_A.weight"]
    cfg = theirs.transformer.peft_config["ours"]
    scale = cfg.alpha_pattern.get(module, cfg.lora_alpha) / cfg.rank_pattern.get(module, cfg.r)
    theirs_ab = loaded[f"{module}.lora_B.weight"] @ loaded[f"{module}.lora_A.weight"] * scale
    assert float(plain[f"diffusion_model.{module}.alpha"]) == 8.0
    assert torch.allclose(theirs_ab, 2 * ab, atol=1e-6)
    with_lora = theirs("a red circle", guidance_scale=4.0, latents=_noise(0), output_type="latent", use_pe=False,
                       **KW).images
    base = _diffusers(hub)[0]("a red circle", guidance_scale=4.0, latents=_noise(0), output_type="latent",
                              use_pe=False, **KW).images
    ours = load_tiny_ernie_image(hub)
    ours.load_lora(ours.dit, str(loras[layout]))
    mine = ours("a red circle", cfg_scale=4.0, seed=0, output_type="latent", progress=False, **KW)
    diff = (mine - with_lora).abs().max().item()
    print(f"ernie-image {layout} LoRA: diffusers vs difftune fused, latents max difference {diff:.2e}; the LoRA "
          f"moves them by {(with_lora - base).abs().max().item():.2e}")
    assert diff <= 1e-5 and (with_lora - base).abs().max().item() > 1e-3


def test_the_reference_loader_reads_the_comfyui_file_at_the_trained_strength(hub, loras):
    lora = diffsynth_general_convert(load_file(str(loras["comfyui"])))
    theirs = load_tiny_ernie_image(hub).dit
    weights = dict(theirs.named_parameters())
    fused = 0
    for key, up in lora.items():
        if key.endswith(".lora_B.weight"):
            module = key[: -len(".lora_B.weight")]
            with torch.no_grad():
                weights[f"{module}.weight"] += up @ lora[f"{module}.lora_A.weight"]
            fused += 1
    assert fused == 2 * 4
    ours = load_tiny_ernie_image(hub)
    ours.load_lora(ours.dit, str(loras["default"]))
    mine = ours.dit.state_dict()
    diff = max((theirs.state_dict()[k] - mine[k]).abs().max().item() for k in mine)
    print(f"ernie-image comfyui LoRA fused by the reference's loader vs difftune's default file fused: {diff:.2e}")
    assert diff <= 1e-6
    base = load_tiny_ernie_image(hub).dit.state_dict()
    assert max((theirs.state_dict()[k] - base[k]).abs().max().item() for k in base) > 1e-3
    # the default file's transformer.<module> names: none is a module of the reference's DiT
    names = {k[: -len(".lora_B.weight")] for k in diffsynth_general_convert(load_file(str(loras["default"])))
             if k.endswith(".lora_B.weight")}
    assert names and not names & {n for n, _ in load_tiny_ernie_image(hub).dit.named_modules()}
