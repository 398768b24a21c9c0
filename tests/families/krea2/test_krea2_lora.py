"""Krea-2 LoRA files where users load them, at the trained strength (rank 4, alpha 8: alpha / rank is 2), trained
with the reference's own target names (`wq,wk,wv,gate,wo,...,tproj.1`, translated onto diffusers' modules):

- the default file (diffusers' names behind `transformer.`, alpha folded into B; the reference's
  `--align_to_opensource_format` layout) loads in diffusers' `Krea2Pipeline.load_lora_weights` with every tensor
  used and samples what difftune samples with the LoRA fused;
- the reference's Krea2LoRALoader (rewritten here from its source: a file with `transformer.` keys is renamed by its
  Krea2LoRAConverter back onto its original module names, then GeneralLoRALoader adds B @ A) fuses it to difftune's
  weights;
- ComfyUI (its comfy/lora.py Krea2 branch and comfy/utils.py krea2_to_diffusers) maps every module of the default
  file (`transformer.<diffusers path>`) and of `--lora_format comfyui` (`diffusion_model.<original path>`);
- a LoRA in the original names (Krea's trainer, ComfyUI) is read back by difftune.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_train
from difftune.families.krea2.lora import to_diffusers_path, to_original_path
from support import write_example_dataset
from support.krea2 import diffusers_krea2, load_tiny_krea2, krea2_model_paths, write_tiny_krea2_hub

REFERENCE_TARGETS = "wq,wk,wv,gate,wo,gate,up,down,first,tmlp.0,tmlp.2,projector,txtmlp.1,txtmlp.3,last.linear,tproj.1"
KW = dict(height=32, width=32, num_inference_steps=2)
BLOCK_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up", "ff.down")
GLOBAL_MODULES = ("img_in", "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj", "txt_in.linear_1",
                  "txt_in.linear_2", "text_fusion.projector", "final_layer.linear")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_krea2_hub(tmp_path_factory.mktemp("krea2_hub"))


@pytest.fixture(scope="module")
def loras(hub, tmp_path_factory):
    """The same training (same seed) saved in the default layout and in the comfyui one."""
    root = tmp_path_factory.mktemp("krea2_lora")
    meta = write_example_dataset(root / "data", n=2, size=(32, 32))
    out = {}
    for layout in ("default", "comfyui"):
        run_train("--task", "sft", "--dataset_base_path", root / "data", "--dataset_metadata_path", meta,
                  "--output_path", root / layout, "--model_paths", json.dumps(krea2_model_paths(hub)), "--torch_dtype",
                  "float32", "--learning_rate", 5e-2, "--max_steps", 2, "--seed", 5, "--no_progress", "--max_pixels",
                  1024, "--enable_tensorboard_log", "false", "--lora_base_model", "dit", "--lora_target_modules",
                  REFERENCE_TARGETS, "--lora_rank", 4, "--lora_alpha", 8, "--lora_format", layout)
        out[layout] = next((root / layout).glob("*.safetensors"))
    return out


def _modules(keys, prefix):
    return {k[len(prefix):].rpartition(".lora_")[0] if ".lora_" in k else k[len(prefix):].rpartition(".alpha")[0]
            for k in keys}


def test_the_reference_targets_become_diffusers_modules(loras):
    saved = load_file(str(loras["default"]))
    blocks = [f"transformer_blocks.{i}" for i in range(2)] + [f"text_fusion.{kind}.{i}" for kind in
                                                              ("layerwise_blocks", "refiner_blocks") for i in range(2)]
    want = {f"{b}.{m}" for b in blocks for m in BLOCK_MODULES} | set(GLOBAL_MODULES)
    assert _modules(saved, "transformer.") == want and len(want) == 56
    assert all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in saved)
    assert saved["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"].shape[0] == 4


def _diffusers_with_lora(hub, path):
    pipe = diffusers_krea2(load_tiny_krea2(hub))
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

    from difftune.core.latents import seeded_noise
    from difftune.families.krea2.model_fn import pack

    saved = load_file(str(loras["default"]))
    theirs, warnings = _diffusers_with_lora(hub, loras["default"])
    assert warnings == []
    loaded = get_peft_model_state_dict(theirs.transformer, adapter_name="ours")
    assert {k.rpartition(".lora_")[0] for k in loaded} == _modules(saved, "transformer.")
    # the strength: diffusers' B @ A equals the trained alpha / rank (2) times the comfyui file's plain B @ A
    plain = load_file(str(loras["comfyui"]))
    wq = "diffusion_model.blocks.0.attn.wq"
    ab = plain[f"{wq}.lora_B.weight"] @ plain[f"{wq}.lora_A.weight"]
    assert float(plain["diffusion_model.blocks.0.attn.wq.alpha"]) == 8.0
    config = theirs.transformer.peft_config["ours"]
    theirs_ab = (loaded["transformer_blocks.0.attn.to_q.lora_B.weight"]
                 @ loaded["transformer_blocks.0.attn.to_q.lora_A.weight"]) * config.lora_alpha / config.r
    assert torch.allclose(theirs_ab, 2 * ab, atol=1e-6)
    latents = pack(seeded_noise((16, 4, 4), 0, 1))
    with_lora = theirs("a red circle", guidance_scale=0.0, latents=latents, output_type="latent", **KW).images
    base = diffusers_krea2(load_tiny_krea2(hub))("a red circle", guidance_scale=0.0, latents=latents,
                                                 output_type="latent", **KW).images
    ours = load_tiny_krea2(hub)
    ours.load_lora(ours.dit, str(loras["default"]))
    mine = pack(ours("a red circle", cfg_scale=1.0, seed=0, output_type="latent", progress=False, **KW))
    diff = (mine - with_lora).abs().max().item()
    print(f"krea2 LoRA: diffusers vs difftune fused, latents max difference {diff:.2e}; the LoRA moves them by "
          f"{(with_lora - base).abs().max().item():.2e}")
    assert diff <= 1e-5 and (with_lora - base).abs().max().item() > 1e-3


def _original_linears(dit) -> dict[str, torch.Tensor]:
    return {to_original_path(name): m.weight.detach().clone() for name, m in dit.named_modules()
            if isinstance(m, torch.nn.Linear)}


def reference_krea2_fuse(weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor]) -> tuple[dict, int]:
    """The reference's Krea2LoRALoader on a file: keys starting with `transformer.` are renamed by its rename table
    (diffusers' names back to its own) to `<module>.lora_A/B.default.weight`; GeneralLoRALoader then adds B @ A
    (no alpha in such a file: scale 1) to the module of that name."""
    assert any(k.startswith("transformer.") for k in lora)
    renamed = {}
    for name, value in lora.items():
        weight_name = name.replace(".lora_A.", ".").replace(".lora_B.", ".").replace("transformer.", "", 1)
        kind = "lora_A" if name.endswith(".lora_A.weight") else "lora_B"
        renamed[to_original_path(weight_name.removesuffix(".weight")) + f".{kind}.default.weight"] = value
    out, fused = dict(weights), 0
    for key in renamed:
        if key.endswith(".lora_B.default.weight"):
            module = key.removesuffix(".lora_B.default.weight")
            if module in out:
                out[module] = out[module] + renamed[key] @ renamed[module + ".lora_A.default.weight"]
                fused += 1
    return out, fused


def test_the_reference_loader_fuses_the_default_file_at_the_trained_strength(hub, loras):
    default = load_file(str(loras["default"]))
    theirs, fused = reference_krea2_fuse(_original_linears(load_tiny_krea2(hub).dit), default)
    assert fused == len(_modules(default, "transformer.")) == 56
    ours = load_tiny_krea2(hub)
    ours.load_lora(ours.dit, str(loras["default"]))
    mine = _original_linears(ours.dit)
    diff = max((theirs[k] - mine[k]).abs().max().item() for k in mine)
    print(f"krea2 default LoRA fused by the reference's loader vs difftune: {diff:.2e}")
    assert diff <= 1e-6


def _comfyui_krea2_map(layers: int) -> dict[str, str]:
    """ComfyUI's krea2_to_diffusers (comfy/utils.py), as comfy/lora.py uses it: a diffusers module path (behind
    `transformer.`, `diffusion_model.` or bare) -> the original module it patches."""
    block = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_gate": "attn.gate",
             "attn.to_out.0": "attn.wo", "attn.to_out": "attn.wo", "ff.gate": "mlp.gate", "ff.up": "mlp.up",
             "ff.down": "mlp.down"}
    out = {}
    for ours, theirs in ([(f"transformer_blocks.{i}", f"blocks.{i}") for i in range(layers)]
                         + [(f"text_fusion.{k}.{i}", f"txtfusion.{k}.{i}")
                            for k in ("layerwise_blocks", "refiner_blocks") for i in range(2)]):
        out.update({f"{ours}.{d}": f"{theirs}.{c}" for d, c in block.items()})
    out.update({"img_in": "first", "time_embed.linear_1": "tmlp.0", "time_embed.linear_2": "tmlp.2",
                "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1", "txt_in.linear_2": "txtmlp.3",
                "text_fusion.projector": "txtfusion.projector", "final_layer.linear": "last.linear"})
    return out


def test_every_module_of_both_files_is_one_comfyui_maps(hub, loras):
    comfy_map = _comfyui_krea2_map(2)
    default = _modules(load_file(str(loras["default"])), "transformer.")
    assert default <= set(comfy_map)  # every diffusers path is in ComfyUI's Krea2 map
    # --lora_format comfyui: the original names, which ComfyUI's generic diffusion_model.<key> map takes
    native = _modules(load_file(str(loras["comfyui"])), "diffusion_model.")
    originals = set(_original_linears(load_tiny_krea2(hub).dit))
    assert native <= originals and native == {comfy_map[p] for p in default}


def test_an_original_names_lora_is_read_back(hub, loras, tmp_path):
    """Krea's trainer / ComfyUI's files (`diffusion_model.<original>` + alpha) and the reference's own save
    (`<original>.lora_A.default.weight`): both fuse as the default file does."""
    comfy = load_file(str(loras["comfyui"]))
    reference_own = {re.sub(r"^diffusion_model\.", "", k).replace(".lora_A.weight", ".lora_A.default.weight")
                     .replace(".lora_B.weight", ".lora_B.default.weight"): v * (2.0 if ".lora_B." in k else 1.0)
                     for k, v in comfy.items() if not k.endswith(".alpha")}  # no alpha: scale 1, so B carries 2
    save_file(reference_own, str(tmp_path / "reference.safetensors"))
    want = load_tiny_krea2(hub)
    want.load_lora(want.dit, str(loras["default"]))
    for path in (loras["comfyui"], tmp_path / "reference.safetensors"):
        got = load_tiny_krea2(hub)
        got.load_lora(got.dit, str(path))
        diff = max((got.dit.state_dict()[k] - v).abs().max().item() for k, v in want.dit.state_dict().items())
        assert diff <= 1e-6, path
    assert to_diffusers_path("blocks.1.mlp.down") == "transformer_blocks.1.ff.down"
