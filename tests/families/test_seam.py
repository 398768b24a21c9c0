"""The family seam: recognition scoped per family, slots that never silently swap, the latent-layout hooks the
loss reads, and shared code that never imports a family."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import toy_family
from conftest import run_train
from difftune.core.family import FamilySpec, recognise, register_family
from difftune.errors import UserError
from difftune.models import ComponentSpec, ModelConfig

SRC = Path(__file__).resolve().parents[2] / "src" / "difftune"


@pytest.fixture(scope="module")
def toy_models(tmp_path_factory):
    return toy_family.write_toy_models(tmp_path_factory.mktemp("seam_toy"))


def test_shared_code_never_imports_a_family():
    # api.py and demo.py name the built-in families on purpose; testing/ writes each family's tiny models.
    shared = [p for p in SRC.rglob("*.py") if "families" not in p.parts and "testing" not in p.parts
              and p.name not in ("api.py", "demo.py")]
    offenders = []
    for path in shared:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any("families" in (n or "").split(".") for n in names):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == []


def test_the_family_is_recognised_from_the_weights_and_logged(toy_models, capsys):
    configs = [ModelConfig(p) for p in toy_models.values()]
    spec, found = recognise(configs, None)
    assert spec.name == "toy" and sorted(s for s, _, _ in found) == ["denoiser", "image_encoder", "prompt_encoder"]
    assert "family: toy (recognised from the weights)" in capsys.readouterr().out


def test_weights_of_no_family_are_one_line_naming_the_families_tried(tmp_path):
    from safetensors.torch import save_file

    save_file({"some.weight": torch.zeros(3, 3)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(UserError, match=r"tried the families .*qwen_image.*toy"):
        recognise([ModelConfig(str(tmp_path / "x.safetensors"))], None)


def test_a_second_model_for_one_slot_is_an_error_not_a_silent_swap(toy_models):
    configs = [ModelConfig(toy_models["denoiser"]), ModelConfig(toy_models["denoiser"])]
    with pytest.raises(UserError, match=r"both a ToyDenoiser \(denoiser\); toy has no slot for another"):
        recognise(configs, "toy")


def test_a_second_model_of_one_class_fills_the_next_slot(toy_models, monkeypatch):
    """As Wan2.2-A14B's two experts will: the spec's extra slots take further models of its class."""
    import difftune.core.family as family_mod

    monkeypatch.setattr(family_mod, "_REGISTERED", dict(family_mod._REGISTERED))  # this family is for this test
    base = toy_family.FAMILY
    comps = tuple(dataclasses.replace(c, extra_slots=("denoiser2",)) if c.name == "denoiser" else c
                  for c in base.components)

    class TwoExperts(toy_family.ToyPipeline):
        family = "toy_two_experts"
        model_names = (*toy_family.ToyPipeline.model_names, "denoiser2")

    register_family(dataclasses.replace(base, name="toy_two_experts", pipeline=TwoExperts, components=comps))
    first, second = ModelConfig(toy_models["denoiser"]), ModelConfig(toy_models["denoiser"])
    _, found = recognise([first, second, ModelConfig(toy_models["prompt_encoder"])], "toy_two_experts")
    assert [(slot, cfg is first, cfg is second) for slot, cfg, _ in found][:2] == \
        [("denoiser", True, False), ("denoiser2", False, True)]


def test_loss_mask_leaves_masked_elements_out_of_the_loss():
    from difftune.training.losses import flow_match_sft_loss, sample_generator

    class Pipe(toy_family.ToyPipeline):
        mask = None

        def loss_mask(self, values):
            return self.mask

        def model_fn(self, latents, timestep, prompt_emb, **settings):
            return latents * 0  # predicts 0: the error is the target itself

    pipe = Pipe()
    pipe.scheduler.set_training()
    x0 = torch.randn(1, 4, 2, 6, generator=torch.Generator().manual_seed(0))
    values = {"input_latents": x0, "prompt_emb": torch.zeros(1, 16, 16)}
    full = flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {})
    pipe.mask = torch.zeros(1, 1, 1, 6)
    pipe.mask[..., :3] = 1  # only the left half counts
    half = flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {})
    # same noise and timestep (same generator): recompute the two means by hand
    g = sample_generator(0, 0, 0)
    sigma, _, weight = pipe.scheduler.sample_training(1, g, image_seq_len=pipe.seq_len(x0))
    noise = torch.randn(x0.shape[1:], generator=g)[None]
    err = (noise - x0).pow(2)
    assert torch.allclose(full, err.mean() * weight, atol=1e-6)
    assert torch.allclose(half, err[..., :3].mean() * weight, atol=1e-6)


def test_family_settings_from_flags_reach_the_units_and_the_cache_fingerprint(tmp_path, tiny_repo):
    from conftest import make_image_dataset, model_paths_json

    meta = make_image_dataset(tmp_path / "data", n=2)
    run_train("--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--model_paths", model_paths_json(tiny_repo, ("text_encoder", "vae")), "--output_path",
              tmp_path / "cache", "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--torch_dtype",
              "float32", "--max_pixels", 4096, "--edit_image_auto_resize", "false", "--no_progress")
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["fingerprint"]["preprocessing"]["edit_image_auto_resize"] is False
    assert manifest["family"] == "qwen_image"


def test_family_spec_is_needed_to_register():
    with pytest.raises(TypeError, match="FamilySpec"):
        register_family("toy", toy_family.ToyPipeline)
    assert isinstance(toy_family.FAMILY, FamilySpec)
    assert all(isinstance(c, ComponentSpec) for c in toy_family.FAMILY.components)
