"""Z-Image LoRA files where users load them, at the trained strength (rank 4, alpha 8: alpha / rank is 2):

- diffusers' `ZImagePipeline.load_lora_weights` reads the default (diffusers) layout and `--lora_format comfyui`
  with every tensor used and samples what difftune samples with the LoRA fused;
- the reference's own loader (`pipe.load_lora(pipe.dit, path)`, its GeneralLoRALoader: a leading
  `diffusion_model.` dropped, B @ A * alpha / rank fused into the module of that name) reads the comfyui layout,
  every module found, to difftune's fused weights; the default layout's `transformer.` names match none of its
  modules (so the comfyui layout is the one to hand it);
- ComfyUI (its current comfy/lora.py Lumina2 branch, comfy/utils.py z_image_to_diffusers) maps `diffusion_model.`,
  `transformer.` and bare diffusers names of the blocks' q/k/v/out and w1/w2/w3: every module of both files is one.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from difftune.families.z_image.components import LORA_TARGET_MODULES
from support.z_image import TURBO_REPO, hub_entry, load_tiny_z_image, write_tiny_z_image_hub
from support import write_example_dataset

KW = dict(height=32, width=32, num_inference_steps=2)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_z_image_hub(tmp_path_factory.mktemp("z_image_hub"))


@pytest.fixture(scope="module")
def loras(hub, tmp_path_factory):
    """The same training (same seed) saved in the default layout and in the comfyui one."""
    root = tmp_path_factory.mktemp("z_image_lora")
    meta = write_example_dataset(root / "data", n=2, size=(32, 32))
    paths = [hub_entry(hub, TURBO_REPO, f) for f in ("transformer", "text_encoder", "vae")]
    out = {}
    for layout in ("diffusers", "comfyui"):
        run_train("--task", "sft", "--dataset_base_path", root / "data", "--dataset_metadata_path", meta,
                  "--output_path", root / layout, "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
                  "--learning_rate", 5e-2, "--max_steps", 2, "--seed", 5, "--no_progress", "--max_pixels", 1024,
                  "--enable_tensorboard_log", "false", "--lora_base_model", "dit", "--lora_target_modules",
                  LORA_TARGET_MODULES, "--lora_rank", 4, "--lora_alpha", 8, "--lora_format", layout)
        out[layout] = next((root / layout).glob("*.safetensors"))
    return out


def _fused_by_difftune(hub, path):
    pipe = load_tiny_z_image(hub)
    pipe.load_lora(pipe.dit, str(path))
    return pipe


def _diffusers(hub, path=None):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(hub / TURBO_REPO), torch_dtype=torch.float32)
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


@pytest.mark.parametrize("layout", ["diffusers", "comfyui"])
def test_diffusers_loads_every_tensor_and_samples_as_difftune(hub, loras, layout):
    from peft.utils import get_peft_model_state_dict

    saved = load_file(str(loras[layout]))
    theirs, warnings = _diffusers(hub, loras[layout])
    assert warnings == []
    loaded = get_peft_model_state_dict(theirs.transformer, adapter_name="ours")
    modules = {re.sub(r"^(transformer|diffusion_model)\.", "", k).rpartition(".lora_")[0] for k in saved
               if ".lora_" in k}
    assert {k.rpartition(".lora_")[0] for k in loaded} == modules  # every module of the file, nothing else
    # the strength: B @ A as diffusers applies it equals the trained alpha / rank (2) times the file's comfyui B @ A
    plain = load_file(str(loras["comfyui"]))
    module = "layers.0.attention.to_q"
    ab = plain[f"diffusion_model.{module}.lora_B.weight"] @ plain[f"diffusion_model.{module}.lora_A.weight"]
    scale = theirs.transformer.peft_config["ours"].lora_alpha / theirs.transformer.peft_config["ours"].r
    theirs_ab = loaded[f"{module}.lora_B.weight"] @ loaded[f"{module}.lora_A.weight"] * scale
    assert float(plain[f"diffusion_model.{module}.alpha"]) == 8.0
    assert torch.allclose(theirs_ab, 2 * ab, atol=1e-6)
    # diffusers' guidance_scale 0 is the reference's cfg_scale 1 (Turbo's sampling)
    args = dict(generator=torch.Generator().manual_seed(0), guidance_scale=0.0, output_type="latent", **KW)
    with_lora = theirs("a red circle", **args).images
    args["generator"] = torch.Generator().manual_seed(0)
    base = _diffusers(hub)[0]("a red circle", **args).images
    mine = _fused_by_difftune(hub, loras[layout])("a red circle", seed=0, output_type="latent", progress=False, **KW)
    diff = (mine - with_lora).abs().max().item()
    print(f"z-image {layout} LoRA: diffusers vs difftune fused, latents max difference {diff:.2e}; the LoRA moves "
          f"them by {(with_lora - base).abs().max().item():.2e}")
    assert diff <= 1e-5 and (with_lora - base).abs().max().item() > 1e-3


def reference_loader_fuse(model: torch.nn.Module, lora: dict) -> int:
    """The reference's GeneralLoRALoader, step by step (read from its source): for each lora_B key, the module name
    is the key without `lora_B`, its adapter name, a leading `diffusion_model` and `weight`; an `.alpha` beside it
    scales lora_A by alpha / rank; W += B @ A for each module of that name. Returns the modules fused."""
    fused = 0
    names = {}
    for key in lora:
        if ".lora_B." not in key:
            continue
        parts = key.split(".")
        b = parts.index("lora_B")
        parts = parts[:b] + parts[b + 1:]
        if len(parts) > b + 1:  # an adapter name (lora_B.default.weight)
            parts.pop(b)
        if parts[0] == "diffusion_model":
            parts.pop(0)
        names[".".join(parts[:-1])] = key
    for name, module in model.named_modules():
        if name in names:
            key_b = names[name]
            up, down = lora[key_b], lora[key_b.replace("lora_B", "lora_A")]
            alpha_key = key_b.replace("lora_B.weight", "alpha")
            if alpha_key in lora:
                down = down * (lora[alpha_key] / down.shape[0])
            module.weight.data += up @ down
            fused += 1
    return fused


def test_the_reference_loader_reads_the_comfyui_layout_at_the_trained_strength(hub, loras):
    comfy, default = load_file(str(loras["comfyui"])), load_file(str(loras["diffusers"]))
    modules = {k.rpartition(".lora_")[0] for k in comfy if ".lora_" in k}
    theirs = load_tiny_z_image(hub).dit
    assert reference_loader_fuse(theirs, comfy) == len(modules) == 7 * (3 + 2 + 2)
    ours = _fused_by_difftune(hub, loras["diffusers"]).dit.state_dict()
    diff = max((theirs.state_dict()[k] - ours[k]).abs().max().item() for k in ours)
    print(f"z-image comfyui LoRA fused by the reference's loader vs difftune's default file fused: {diff:.2e}")
    assert diff <= 1e-6
    assert reference_loader_fuse(load_tiny_z_image(hub).dit, default) == 0  # transformer.<module>: none found


def test_every_module_is_one_comfyui_maps_for_z_image(loras):
    """ComfyUI's Z-Image map (z_image_to_diffusers) names, per block of layers / context_refiner / noise_refiner,
    attention.to_q, to_k, to_v (into the fused qkv), to_out.0 and feed_forward.w1, w2, w3; it takes them behind
    `diffusion_model.`, `transformer.` or bare."""
    mapped = re.compile(r"(layers|context_refiner|noise_refiner)\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)|"
                        r"feed_forward\.w[123])")
    for layout, prefix in (("comfyui", "diffusion_model."), ("diffusers", "transformer.")):
        keys = load_file(str(loras[layout])).keys()
        modules = {k.rpartition(".lora_")[0] if ".lora_" in k else k.rpartition(".alpha")[0] for k in keys}
        assert all(m.startswith(prefix) and mapped.fullmatch(m[len(prefix):]) for m in modules), layout
        assert all(k.endswith((".lora_A.weight", ".lora_B.weight", ".alpha")) for k in keys)
