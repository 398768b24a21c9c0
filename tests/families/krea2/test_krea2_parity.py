"""Krea-2's models are recognised from the files the reference's scripts name (Krea's single files through
diffusers' krea2 converter, Qwen3-VL-4B's causal LM, Qwen-Image's VAE, and the real DiT's size from a header), and
sampling equals diffusers' Krea2Pipeline on the same tiny models (Raw's resolution-aware shift, Turbo's fixed
mu, guidance, image decoding)."""

from __future__ import annotations

import pytest
import torch

from difftune.core.family import recognise
from difftune.families.krea2 import FAMILY
from difftune.families.krea2.components import (DIT_ORIGINAL, KREA2_TRANSFORMER_CONFIG, TEXT_ENCODER, VAE,
                                                original_dit_keys)
from difftune.families.krea2.model_fn import pack
from difftune.models import ModelConfig
from difftune.models.detect import match_header
from support.krea2 import diffusers_krea2, load_tiny_krea2, krea2_model_paths, tiny_krea2_dit, write_tiny_krea2_hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_krea2_hub(tmp_path_factory.mktemp("krea2_hub"))


@pytest.fixture(scope="module")
def pipe(hub):
    return load_tiny_krea2(hub)


def test_the_scripts_files_are_recognised(hub):
    spec, found = recognise([ModelConfig(p) for p in krea2_model_paths(hub)], None, log=lambda *a: None)
    slots = {slot: det for slot, _, det in found}
    assert spec.name == "krea2" and sorted(slots) == ["dit", "text_encoder", "vae"]
    assert slots["dit"].spec is DIT_ORIGINAL and slots["dit"].config["num_layers"] == 2
    assert slots["text_encoder"].spec is TEXT_ENCODER and slots["vae"].spec is VAE


def test_single_file_loads_the_same_weights_as_the_model(pipe):
    ours = pipe.dit.state_dict()
    for k, v in tiny_krea2_dit(seed=0).state_dict().items():
        assert torch.equal(ours[k], v), k


def test_real_size_single_file_from_its_header():
    from diffusers import Krea2Transformer2DModel

    with torch.device("meta"):
        model = Krea2Transformer2DModel(**{k: v for k, v in KREA2_TRANSFORMER_CONFIG.items() if k[0] != "_"})
    shapes = {"model.diffusion_model." + k: tuple(v.shape) for k, v in original_dit_keys(model.state_dict()).items()}
    assert shapes["model.diffusion_model.blocks.0.mod.lin"] == (6 * 6144,)
    match = match_header(shapes, FAMILY.components)
    assert match.spec is DIT_ORIGINAL and match.config == KREA2_TRANSFORMER_CONFIG


def _noise(pipe, seed, h, w):
    from difftune.core.latents import seeded_noise

    return seeded_noise((16, h // 8, w // 8), seed, 1)


@pytest.mark.parametrize("case", ["raw_cfg", "turbo"])
def test_sampling_equals_diffusers_krea2_pipeline(pipe, case):
    h, w, steps = 32, 48, 3
    cfg = 3.0 if case == "raw_cfg" else 1.0
    mu = None if case == "raw_cfg" else 1.15
    ours = pipe("a red fox", negative_prompt="blurry", cfg_scale=cfg, height=h, width=w, num_inference_steps=steps,
                seed=7, mu=mu, progress=False, output_type="pt")
    ref = diffusers_krea2(pipe, is_distilled=mu is not None)
    theirs = ref("a red fox", negative_prompt="blurry" if cfg != 1.0 else None, guidance_scale=cfg - 1.0,
                 height=h, width=w, num_inference_steps=steps, latents=pack(_noise(pipe, 7, h, w)),
                 output_type="pt").images
    diff = (ours - theirs.float()).abs().max().item()
    print(f"krea2 {case}: max |ours - diffusers| = {diff:.3g}")
    assert ours.shape == theirs.shape == (1, 3, h, w) and diff < 1e-5
    # the latents before decoding too (a VAE could hide a difference)
    ours_latents = pipe("a red fox", negative_prompt="blurry", cfg_scale=cfg, height=h, width=w,
                        num_inference_steps=steps, seed=7, mu=mu, progress=False, output_type="latent")
    theirs_latents = ref("a red fox", negative_prompt="blurry" if cfg != 1.0 else None, guidance_scale=cfg - 1.0,
                         height=h, width=w, num_inference_steps=steps, latents=pack(_noise(pipe, 7, h, w)),
                         output_type="latent").images
    assert (pack(ours_latents) - theirs_latents).abs().max().item() < 1e-5


def test_prompt_states_equal_diffusers_on_the_real_tokens(pipe):
    prompts = ["a cat", "two dogs on a long sofa"]
    ours = pipe.units[-1].process(pipe, prompts)
    embeds, mask = diffusers_krea2(pipe).get_text_hidden_states(prompts, device="cpu")
    assert embeds.shape == (2, 512, 12, 32)
    # the prompt's tokens and the suffix's, the padding between them left out
    counts = mask.sum(1).tolist()
    assert ours["prompt_embeds"].shape == (2, max(counts), 12, 32) and counts[0] < counts[1] < 60
    for i, n in enumerate(counts):
        assert ours["prompt_embeds_mask"][i].tolist() == [1] * n + [0] * (max(counts) - n)
        assert torch.equal(ours["prompt_embeds"][i, :n], embeds[i][mask[i]])


def test_leaving_the_padding_out_changes_no_prediction(pipe):
    """The DiT on the fixed-length sequence (diffusers') and on the real tokens only: the same velocity."""
    from difftune.families.krea2.model_fn import model_fn_krea2

    embeds, mask = diffusers_krea2(pipe).get_text_hidden_states(["a cat", "two dogs on a long sofa"], device="cpu")
    ours = pipe.units[-1].process(pipe, ["a cat", "two dogs on a long sofa"])
    latents = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([700.0, 300.0])
    full = model_fn_krea2(pipe.dit, latents, t, embeds, mask)
    short = model_fn_krea2(pipe.dit, latents, t, ours["prompt_embeds"], ours["prompt_embeds_mask"])
    one = model_fn_krea2(pipe.dit, latents[:1], t[:1], ours["prompt_embeds"][:1, :int(mask[0].sum())], None)
    assert (full - short).abs().max().item() < 1e-5 and (full[:1] - one).abs().max().item() < 1e-5


def test_a_diffusers_transformer_folder_loads_as_the_single_file(hub, pipe, tmp_path):
    from difftune.families.krea2.components import DIT
    from difftune.models.detect import detect_component

    tiny_krea2_dit(seed=0).save_pretrained(tmp_path / "transformer")
    det = detect_component(str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"), FAMILY.components)
    assert det.spec is DIT and det.source.endswith("config.json")
    # bare diffusers-named weights (no config.json): every size read from the shapes
    (tmp_path / "transformer" / "config.json").unlink()
    det = detect_component(str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"), FAMILY.components)
    assert det.spec is DIT and det.config["num_layers"] == 2 and det.config["axes_dims_rope"] == [4, 6, 6]


def test_a_text_encoder_without_the_tapped_layers_is_refused_in_one_line(hub, tmp_path):
    from difftune.errors import UserError
    from difftune.families.krea2 import Krea2Pipeline
    from support.qwen_parts import TinyQwen3VLSpec, write_tiny_qwen3_vl

    shallow = write_tiny_qwen3_vl(tmp_path / "shallow", TinyQwen3VLSpec(hidden=32, layers=4, head_dim=16,
                                                                        intermediate=64))
    paths = krea2_model_paths(hub)
    # refused when the parts are put together (Krea2Pipeline.check_models), before a model is loaded
    with pytest.raises(UserError, match=r"the text_encoder .*model.safetensors has 4 layers and the dit reads its "
                                        r"hidden states 2, 5, .*35"):
        Krea2Pipeline.from_pretrained(torch_dtype=torch.float32, model_configs=[
            ModelConfig(paths[0]), ModelConfig(str(shallow / "model.safetensors")), ModelConfig(paths[2])])
