"""`--lora_target_modules ""`: the reference's automatic choice (DiffSynth-Studio fed7b18,
`DiffusionTrainingModule.auto_detect_lora_target_modules`): inside each nn.ModuleList of more than one module, every
Linear layer with min(in, out) >= 512, by its full name; a run logs what it chose, and a model without such layers is
refused in one line (the suite's tiny models are all narrower)."""

from __future__ import annotations

import pytest
from torch import nn

from conftest import model_paths_json, run_train
from difftune.errors import UserError
from difftune.lora.auto_targets import AUTO, auto_target_modules, resolve_auto_targets
from difftune.training.config import RunConfig


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(512, 512)
        self.narrow = nn.Linear(512, 256)  # min side 256: left out
        self.inner = nn.ModuleList([nn.Linear(1024, 512), nn.Linear(1024, 512)])


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(512, 512)  # outside every block list
        self.blocks = nn.ModuleList([Block(), Block()])
        self.single = nn.ModuleList([Block()])  # one module: not a block list, but its block's own list is
        self.head = nn.Sequential(nn.ModuleList([nn.Linear(600, 600), nn.Linear(600, 600)]))  # found deeper down


def test_the_reference_rule_picks_wide_linears_inside_block_lists_only():
    # the list the reference's own function (diffsynth 2.1.12, in its venv) returns for this Model
    assert auto_target_modules(Model()) == [
        "blocks.0.to_q", "blocks.0.inner.0", "blocks.0.inner.1", "blocks.1.to_q", "blocks.1.inner.0",
        "blocks.1.inner.1", "single.0.inner.0", "single.0.inner.1", "head.0.0", "head.0.1"]


def test_the_choice_is_logged_and_none_is_refused_in_one_line():
    said = []
    assert len(resolve_auto_targets(Model(), "dit", log=said.append)) == 10
    assert said == ['note: --lora_target_modules "": 10 modules of dit chosen as the reference chooses (Linear layers '
                    'of at least 512 features in block lists): to_q, inner.0, inner.1, 0, 1']
    with pytest.raises(UserError, match=r'^--lora_target_modules "": no Linear layer of at least 512 features on '
                                        r'both sides in Sequential'):
        resolve_auto_targets(nn.Sequential(nn.Linear(4, 4)), "dit")


def test_an_empty_flag_means_the_automatic_choice_and_no_flag_does_not():
    assert RunConfig(dataset_base_path=".", lora_target_modules="").lora_target_modules == (AUTO,)
    assert RunConfig(dataset_base_path=".").lora_target_modules == ()
    saved = RunConfig(dataset_base_path=".", lora_target_modules="").record()["lora_target_modules"]
    assert RunConfig(dataset_base_path=".", lora_target_modules=saved).lora_target_modules == (AUTO,)  # a resume


def test_a_run_with_an_empty_flag_uses_the_rule(tmp_path, tiny_repo):
    """The suite's tiny Qwen-Image DiT has no 512-wide layer: the run is refused naming the rule, before training."""
    from conftest import make_image_dataset

    meta = make_image_dataset(tmp_path / "data", n=1)
    with pytest.raises(UserError, match=r'^--lora_target_modules "": no Linear layer of at least 512 features .*'
                                        r'QwenImageTransformer2DModel'):
        run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
                  "--output_path", tmp_path / "out", "--model_paths", model_paths_json(tiny_repo),
                  "--torch_dtype", "float32", "--max_steps", 1, "--no_progress", "--lora_base_model", "dit",
                  "--lora_target_modules", "", "--lora_rank", 4)
    assert not list((tmp_path / "out").rglob("*.safetensors"))
