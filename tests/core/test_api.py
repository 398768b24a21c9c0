"""The Python API for custom training scripts: `examples/qwen_image/simple_train.py` trains a LoRA that
loads, and a script's module trains exactly what the `train` command trains from the same settings."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train
from difftune import (DiffusionTrainingModule, ModelConfig, ModelLogger, QwenImagePipeline, UnifiedDataset,
                      launch_training_task, load_component, sample_generator, sft_loss)
from difftune.errors import UserError
from difftune.training.accelerator import reset_accelerate_state
from support.toys import toy_family

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen_image" / "simple_train.py"


def max_diff(a_path, b_path):
    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys() and len(a) > 0
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_simple_train_example_trains_a_lora_that_loads(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    spec = importlib.util.spec_from_file_location("simple_train_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    settings = ["--dataset_repeat", 1, "--height", 32, "--width", 32, "--learning_rate", 1e-3, "--num_epochs", 1,
                "--lora_rank", 4, "--seed", 5, "--save_steps", 1]
    summary = example.main([str(a) for a in ["--model_path", tiny_repo, "--dataset_base_path", meta.parent,
                                             "--dataset_metadata_path", meta, "--output_path", tmp_path / "api",
                                             "--torch_dtype", "float32", *settings]])
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    lora = tmp_path / "api" / "step-2.safetensors"
    assert summary["saved"] == [str(tmp_path / "api" / "step-1.safetensors"), str(lora)]
    with safe_open(str(lora), "pt") as f:
        assert json.loads(f.metadata()["difftune_lora"])["components"]["transformer"]["rank"] == 4

    pipe = QwenImagePipeline.from_pretrained(torch_dtype=torch.float32,
                                             model_configs=[ModelConfig(str(tiny_repo / "transformer"))])
    before = {k: v.clone() for k, v in pipe.dit.state_dict().items()}
    pipe.load_lora(pipe.dit, str(lora))
    changed = [k for k, v in pipe.dit.state_dict().items() if not torch.equal(before[k], v)]
    assert any(".attn.to_q." in k for k in changed)

    # The train command with the same settings trains the same LoRA (same units, loss, noise, loop).
    reset_accelerate_state()
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--output_path", tmp_path / "cli",
              "--model_paths", model_paths_json(tiny_repo), "--torch_dtype", "float32", "--lora_base_model", "dit",
              "--lora_target_modules", LORA_TARGETS, "--use_gradient_checkpointing", "--no_progress",
              "--data_file_keys", "image", *settings)
    assert max_diff(lora, tmp_path / "cli" / "step-2.safetensors") <= 1e-5


# -- the launcher, on the toy family (fast) -------------------------------------------------------------

class ToyModule(DiffusionTrainingModule):
    """What a user writes for a family without a from_pretrained: load the models, switch, forward(data)."""

    def __init__(self, paths, trainable="denoiser"):
        super().__init__()
        self.pipe = toy_family.ToyPipeline()
        for name, path in paths.items():
            setattr(self.pipe, name, load_component(path, torch_dtype=torch.float32).module)
        self.switch_pipe_to_training_mode(self.pipe, trainable_models=trainable)
        self.seen = []

    def forward(self, data):
        if self.generator is not None:
            self.seen.append(self.generator.initial_seed())
        values = self.pipe.training_inputs(data)
        self.pipe.run_units(values)
        return sft_loss(self.pipe, values, self.generator)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    return toy_family.write_toy_models(root / "models"), make_image_dataset(root / "data", n=4, size=(32, 24))


def toy_dataset(meta, repeat=1):
    return UnifiedDataset(base_path=meta.parent, metadata_path=meta, repeat=repeat, data_file_keys="image",
                          main_data_operator=UnifiedDataset.default_image_operator(meta.parent, max_pixels=4096,
                                                                                   height_division_factor=4,
                                                                                   width_division_factor=4))


def test_launcher_equals_train_command_with_batches_and_accumulation(tmp_path, toy):
    paths, meta = toy
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, log_with="tensorboard",
                                         project_dir=str(tmp_path / "logs"))
    model = ToyModule(paths, trainable="prompt_encoder,denoiser")
    summary = launch_training_task(accelerator, toy_dataset(meta), model, ModelLogger(tmp_path / "api", "pipe.denoiser."),
                                   learning_rate=1e-2, num_epochs=2, batch_size=2, seed=11, progress=False)
    assert summary["steps"] == 2  # 4 samples = 1 step of 2 x 2 per epoch
    # each sample visit drew from its own (seed, epoch, index) generator
    expected = {sample_generator(11, e, i).initial_seed() for e in range(2) for i in range(4)}
    assert len(model.seen) == 8 and set(model.seen) == expected
    assert model.generator is None  # only set while a sample's forward runs
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))  # the loss went to the tracker

    reset_accelerate_state()
    run_train("--family", "toy", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cli", "--model_paths", json.dumps(list(paths.values())),
              "--torch_dtype", "float32", "--trainable_models", "prompt_encoder,denoiser", "--learning_rate", 1e-2,
              "--num_epochs", 2, "--batch_size", 2, "--gradient_accumulation_steps", 2, "--seed", 11,
              "--max_pixels", 4096, "--remove_prefix_in_ckpt", "pipe.denoiser.", "--no_progress",
              "--enable_tensorboard_log", "false")
    for name in ("epoch-1-denoiser.safetensors", "epoch-1-prompt_encoder.safetensors"):
        assert max_diff(tmp_path / "api" / name, tmp_path / "cli" / name) <= 1e-5
    assert "blocks.0.conv.weight" in load_file(str(tmp_path / "api" / "epoch-1-denoiser.safetensors"))


def test_sft_loss_needs_the_sample_generator(toy):
    paths, meta = toy
    model = ToyModule(paths)
    with pytest.raises(TypeError, match="pass self.generator"):
        model(toy_dataset(meta)[0])  # called outside launch_training_task: no generator was set
    model.generator = sample_generator(0, 0, 0)
    first = model(toy_dataset(meta)[0])
    model.generator = sample_generator(0, 0, 0)
    assert torch.equal(first, model(toy_dataset(meta)[0]))  # the generator alone decides noise and timestep


def test_launcher_and_logger_refuse_misuse(tmp_path, toy):
    paths, meta = toy

    class NoPipe(DiffusionTrainingModule):
        def forward(self, data):
            return torch.zeros(())

    with pytest.raises(UserError, match=r"NoPipe.__init__ must set self.pipe"):
        launch_training_task(accelerate.Accelerator(), toy_dataset(meta), NoPipe())
    with pytest.raises(TypeError, match="DiffusionTrainingModule"):
        launch_training_task(accelerate.Accelerator(), toy_dataset(meta), torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="save_steps must be a positive"):
        ModelLogger(tmp_path, save_steps=0)


def test_import_difftune_is_cheap_and_exports_the_api():
    code = ("import sys, difftune; assert 'torch' not in sys.modules, 'import difftune loaded torch'; "
            "from difftune import launch_training_task, DiffusionTrainingModule, sft_loss, register_family; "
            "print(difftune.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == __import__("difftune").__version__
