"""Ideogram-4 LoRA files where users load them, at the trained strength (rank 4, alpha 8), trained on the reference's
targets (its own module names, translated), whose `adaln_modulation` takes the final layer's modulation too:

- the default layout (diffusers': `transformer.<module>`, q/k/v apart, alpha folded into B): diffusers'
  Ideogram4LoraLoaderMixin uses every tensor and samples what difftune samples with the file fused; the reference's
  loader and ComfyUI find none of its modules (their DiTs have a fused qkv, their maps no `transformer.` names);
- `--lora_format comfyui` (`diffusion_model.` + Ideogram's original names, q/k/v fused into one qkv adapter,
  `.alpha`): the reference's loader (`pipe.load_lora(pipe.dit, path)`, its GeneralLoRALoader, rewritten step by step
  in support.lora_readers) fuses every module to difftune's weights; ComfyUI's Ideogram-4 model keeps those names
  and its generic `diffusion_model.<module>` map reads them (read from its source, not run); diffusers reads it
  while the LoRA stays in the blocks and refuses it with the final layer's modulation (its converter of the
  original names knows `layers.N.*` only: the file's `final_layer.adaln_modulation.{lora_A.weight,lora_B.weight,
  alpha}` are left over), which is why the default is diffusers' layout.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from difftune.families.ideogram4.components import REFERENCE_LORA_TARGETS, original_dit_keys
from support import write_example_dataset
from support.ideogram4 import ideogram4_tokenizer, hub_paths, load_tiny_ideogram4, write_tiny_ideogram4_hub
from support.lora_readers import diffsynth_fuse, diffsynth_general_convert

KW = dict(height=32, width=32, num_inference_steps=2)
IN_BLOCKS = "attention.qkv,attention.o,feed_forward.w1,feed_forward.w2,feed_forward.w3,layers.0.adaln_modulation"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_ideogram4_hub(tmp_path_factory.mktemp("ideogram4_hub"))


@pytest.fixture(scope="module")
def loras(hub, tmp_path_factory):
    """The same training (same seed) in the default layout and the comfyui one, on the reference's targets; and the
    comfyui layout on targets inside the blocks."""
    root = tmp_path_factory.mktemp("ideogram4_lora")
    meta = write_example_dataset(root / "data", n=2, size=(32, 32))
    out = {}
    for name, layout, targets in (("default", "default", REFERENCE_LORA_TARGETS),
                                  ("comfyui", "comfyui", REFERENCE_LORA_TARGETS),
                                  ("blocks", "comfyui", IN_BLOCKS)):
        run_train("--task", "sft", "--dataset_base_path", root / "data", "--dataset_metadata_path", meta,
                  "--output_path", root / name, "--model_paths", json.dumps(hub_paths(hub)),
                  "--tokenizer_path", str(hub / "ideogram-ai/ideogram-4-fp8/tokenizer"), "--torch_dtype", "float32",
                  "--learning_rate", 5e-2, "--max_steps", 2, "--seed", 5, "--no_progress", "--max_pixels", 1024,
                  "--enable_tensorboard_log", "false", "--lora_base_model", "dit", "--lora_target_modules", targets,
                  "--lora_rank", 4, "--lora_alpha", 8, "--lora_format", layout)
        out[name] = next((root / name).glob("*.safetensors"))
    return out


def _fused(hub, path):
    pipe = load_tiny_ideogram4(hub)
    pipe.load_lora(pipe.dit, str(path))
    return pipe


def _diffusers(pipe, path=None):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers import Ideogram4Pipeline as Theirs

    theirs = Theirs(scheduler=FlowMatchEulerDiscreteScheduler(), vae=pipe.vae, text_encoder=pipe.text_encoder,
                    tokenizer=ideogram4_tokenizer(), transformer=pipe.dit, unconditional_transformer=pipe.dit_uncond)
    theirs.set_progress_bar_config(disable=True)
    records = []
    if path is not None:
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("diffusers").addHandler(handler)
        try:
            theirs.load_lora_weights(str(path), adapter_name="ours")
        finally:
            logging.getLogger("diffusers").removeHandler(handler)
    return theirs, [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def _comfyui_weights(hub):
    """ComfyUI's (and the reference's) DiT weights: Ideogram's original names, behind `diffusion_model.`."""
    return {f"diffusion_model.{k}": v for k, v in original_dit_keys(load_tiny_ideogram4(hub).dit.state_dict())
            .items() if k.endswith(".weight")}


def test_the_default_file_is_diffusers_layout(loras):
    keys = load_file(str(loras["default"]))
    assert "transformer.layers.0.attention.to_q.lora_A.weight" in keys
    assert "transformer.layers.1.attention.to_out.0.lora_B.weight" in keys
    assert "transformer.final_layer.adaln_modulation.lora_B.weight" in keys  # the reference's target takes it
    assert all(k.startswith("transformer.") and ".lora_" in k for k in keys)  # alpha folded: no .alpha tensor
    assert not any(".attention.qkv." in k or ".attention.o." in k for k in keys)


def test_diffusers_uses_every_key_of_the_default_file_and_samples_the_trained_model(hub, loras):
    """diffusers' Ideogram4Pipeline.load_lora_weights on the default file: no warning, every module of the file (the
    final layer's modulation too) in the transformer at the trained strength, and its sampling equals difftune's with
    the file fused."""
    from peft.utils import get_peft_model_state_dict

    saved = load_file(str(loras["default"]))
    theirs, warnings = _diffusers(load_tiny_ideogram4(hub), loras["default"])
    assert warnings == []
    loaded = get_peft_model_state_dict(theirs.transformer, adapter_name="ours")
    assert set(loaded) == {k[len("transformer."):] for k in saved}
    assert all(torch.equal(loaded[k[len("transformer."):]], v) for k, v in saved.items())
    # the trained strength: diffusers' W + s * B @ A equals difftune's fused weight (the comfyui file, read back,
    # gives the same weights: test_difftune_reads_every_layout_back_alike)
    config = theirs.transformer.peft_config["ours"]
    base = load_tiny_ideogram4(hub).dit.state_dict()
    ours = _fused(hub, loras["default"]).dit.state_dict()
    for module in ("layers.0.attention.to_k", "layers.1.attention.to_out.0", "final_layer.adaln_modulation"):
        r = config.rank_pattern.get(module, config.r)
        alpha = config.alpha_pattern.get(module, config.lora_alpha)
        delta = loaded[f"{module}.lora_B.weight"] @ loaded[f"{module}.lora_A.weight"] * (alpha / r)
        assert delta.abs().max() > 1e-3
        assert torch.allclose(base[f"{module}.weight"] + delta, ours[f"{module}.weight"], atol=1e-6), module
    noise = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(0))
    args = dict(guidance_scale=3.0, guidance_schedule=None, max_sequence_length=64, output_type="latent", **KW)
    with_lora = theirs("a red circle", latents=noise, **args).images
    without = _diffusers(load_tiny_ideogram4(hub))[0]("a red circle", latents=noise, **args).images
    mine = _fused(hub, loras["default"])
    from difftune.families.ideogram4.units import tokens_to_grid
    got = mine.generate({**mine.prompt_values("a red circle", ""), "height": 32, "width": 32, "seed": None,
                         "rand_device": "cpu", "input_image": None, "latents": tokens_to_grid(noise, 2, 2)},
                        cfg_scale=3.0, num_inference_steps=2, given=("latents",), progress=False, output_type="latent")
    diff = (tokens_to_grid(with_lora, 2, 2) - got).abs().max().item()
    moved = (with_lora - without).abs().max().item()
    print(f"ideogram4 default LoRA: diffusers vs difftune fused, latents max difference {diff:.2e} "
          f"(the LoRA moves them by {moved:.2e})")
    assert diff <= 1e-5 and moved > 1e-3


def test_the_comfyui_file_has_the_original_names(loras):
    keys = load_file(str(loras["comfyui"]))
    assert "diffusion_model.layers.0.attention.qkv.lora_A.weight" in keys
    assert "diffusion_model.layers.0.attention.o.alpha" in keys
    assert "diffusion_model.final_layer.adaln_modulation.lora_B.weight" in keys
    assert not any(".to_q." in k or ".to_out." in k for k in keys)
    # q, k and v in one adapter of rank 12 (alpha 24: each part's alpha / rank kept)
    assert keys["diffusion_model.layers.0.attention.qkv.lora_A.weight"].shape[0] == 12
    assert float(keys["diffusion_model.layers.0.attention.qkv.alpha"]) == 24.0


def test_the_reference_loader_reads_the_comfyui_file_and_nothing_of_the_default(hub, loras):
    base = load_tiny_ideogram4(hub).dit.state_dict()
    weights = {k[: -len(".weight")]: v for k, v in original_dit_keys(base).items() if k.endswith(".weight")}
    fused, unused = diffsynth_fuse(weights, load_file(str(loras["comfyui"])), diffsynth_general_convert)
    assert unused == set()
    ours = original_dit_keys(_fused(hub, loras["default"]).dit.state_dict())
    diff = max((fused[k] - ours[f"{k}.weight"]).abs().max().item() for k in fused)
    moved = max((fused[k] - weights[k]).abs().max().item() for k in fused)
    print(f"ideogram4 comfyui LoRA fused by the reference's loader vs difftune's default file fused: {diff:.2e} "
          f"(the LoRA moves weights by {moved:.2e})")
    assert diff <= 1e-6 and moved > 1e-3
    # the default file: every module name is diffusers' behind `transformer.`, none of the reference's DiT
    untouched, skipped = diffsynth_fuse(weights, load_file(str(loras["default"])), diffsynth_general_convert)
    assert skipped and all(n.startswith("transformer.") for n in skipped)
    assert all(torch.equal(untouched[k], weights[k]) for k in weights)


def test_difftune_reads_every_layout_back_alike(hub, loras):
    a = _fused(hub, loras["default"]).dit.state_dict()
    b = _fused(hub, loras["comfyui"]).dit.state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_diffusers_reads_the_comfyui_file_in_the_blocks_and_refuses_the_final_layer(hub, loras):
    from peft.utils import get_peft_model_state_dict

    theirs, warnings = _diffusers(load_tiny_ideogram4(hub), loras["blocks"])
    assert warnings == []
    loaded = get_peft_model_state_dict(theirs.transformer, adapter_name="ours")
    ours = _fused(hub, loras["blocks"]).dit.state_dict()
    base = load_tiny_ideogram4(hub).dit.state_dict()
    # every module difftune fused is one diffusers holds, at the trained strength
    pattern = theirs.transformer.peft_config["ours"]
    for module in ("layers.0.attention.to_k", "layers.1.attention.to_out.0", "layers.0.adaln_modulation"):
        a, b = loaded[f"{module}.lora_A.weight"], loaded[f"{module}.lora_B.weight"]
        r = pattern.rank_pattern.get(module, pattern.r)
        alpha = pattern.alpha_pattern.get(module, pattern.lora_alpha)
        assert torch.allclose(base[f"{module}.weight"] + b @ a * (alpha / r), ours[f"{module}.weight"], atol=1e-6)
    # the final layer's modulation is what its converter leaves over, and refuses the file for
    with pytest.raises(ValueError, match=r"Ideogram4") as refused:
        _diffusers(load_tiny_ideogram4(hub), loras["comfyui"])
    assert "final_layer.adaln_modulation.lora_A.weight" in str(refused.value)
    assert "layers.0." not in str(refused.value)


def test_the_references_validate_lora_lines_work(hub, loras):
    """`pipe.load_lora(pipe.dit, path); pipe.load_lora(pipe.dit_uncond, path)`: the same updates in both DiTs."""
    for layout in ("default", "comfyui"):
        pipe = load_tiny_ideogram4(hub)
        base = load_tiny_ideogram4(hub)
        pipe.load_lora(pipe.dit, str(loras[layout]), alpha=1)
        pipe.load_lora(pipe.dit_uncond, str(loras[layout]), alpha=1)
        for key in ("layers.0.attention.to_v.weight", "final_layer.adaln_modulation.weight"):
            d_cond = pipe.dit.state_dict()[key] - base.dit.state_dict()[key]
            d_uncond = pipe.dit_uncond.state_dict()[key] - base.dit_uncond.state_dict()[key]
            assert d_cond.abs().max() > 1e-3 and torch.allclose(d_cond, d_uncond, atol=1e-6)


def test_every_module_of_the_comfyui_file_is_one_comfyui_maps(hub, loras):
    """ComfyUI's Ideogram-4 model (comfy/ldm/ideogram4/model.py) names its weights as the original files do, behind
    `diffusion_model.`; its LoRA key map (comfy/lora.py, model_lora_keys_unet) takes `diffusion_model.<module>` for
    each of them, and scales B @ A by the file's alpha / rank: every module of the comfyui file is one, at its shape.
    It has no map of diffusers' Ideogram-4 names: none of the default file's modules is one."""
    comfy = _comfyui_weights(hub)
    saved = load_file(str(loras["comfyui"]))
    modules = {k.rpartition(".lora_")[0] for k in saved if ".lora_" in k}
    assert modules and all(f"{m}.weight" in comfy for m in modules)
    for m in modules:
        b, a = saved[f"{m}.lora_B.weight"], saved[f"{m}.lora_A.weight"]
        assert (b @ a).shape == comfy[f"{m}.weight"].shape and f"{m}.alpha" in saved
    default = {k.rpartition(".lora_")[0] for k in load_file(str(loras["default"]))}
    assert not any(f"{m}.weight" in comfy for m in default)
