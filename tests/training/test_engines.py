"""The engine settings difftune makes before `prepare` and the training-state rules, without launching processes
(tests/training/test_sharded.py runs FSDP2 on 2 processes; test_deepspeed.py runs DeepSpeed where it is installed).
Nothing here needs DeepSpeed: its state layout is written through the same code with its two accessors standing
in (they return the whole fp32 tensor, as ZeRO's do), and read back by the loader's reader."""

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from difftune.errors import UserError
from difftune.training import engines
from difftune.training.deepspeed_state import StateParts, owner_of, part_name, save_deepspeed_tensors
from difftune.training.state import changed_settings, load_training_state


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


class EncoderBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


class Denoiser(torch.nn.Module):
    _no_split_modules = ["Block"]  # as diffusers' models declare their repeated blocks

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList([Block(), Block(), Block()])


class Encoder(torch.nn.Module):
    _no_split_modules = ["EncoderBlock"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([EncoderBlock()])


class Pipe:
    def __init__(self, **models):
        self.models = models

    def loaded_models(self):
        return dict(self.models)


class Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pipe = Pipe(dit=Denoiser(), text_encoder=Encoder())
        self.pipe_models = torch.nn.ModuleDict(self.pipe.loaded_models())
        self.pipe.models["text_encoder"].requires_grad_(False)


def fsdp_accelerator(**plugin):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **plugin)
    return SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin),
                           num_processes=4, device=torch.device("cpu"), is_main_process=True)


def test_the_fsdp_unit_is_each_trained_models_own_block_class_and_frozen_models_stay_whole():
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    accelerator, module = fsdp_accelerator(auto_wrap_policy="TRANSFORMER_BASED_WRAP"), Module()
    chosen = engines.configure_fsdp(accelerator, module)
    plugin = accelerator.state.fsdp_plugin
    assert chosen["classes"] == ["Block"] and chosen["units"] == 3  # not the frozen encoder's EncoderBlock
    assert plugin.ignored_modules == [module.pipe.models["text_encoder"]]
    # accelerate's own policy (what prepare() applies) now wraps exactly the denoiser's blocks
    policy = fsdp2_prepare_auto_wrap_policy(plugin, module)
    assert [m for m in module.modules() if policy(m)] == list(module.pipe.models["dit"].blocks)
    assert engines.engine_line(accelerator, chosen) == (
        "engine: FSDP2 over 4 processes (cpu), FULL_SHARD, one unit per Block (3 units) in dit; whole on every "
        "process (frozen): text_encoder; training state sharded")


def test_fsdp_wrap_settings_the_config_names_are_kept_or_refused():
    accelerator = fsdp_accelerator(auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                   transformer_cls_names_to_wrap=["SomeOtherFamilysBlock"])
    with pytest.raises(UserError) as err:
        engines.configure_fsdp(accelerator, Module())
    assert str(err.value) == ("the accelerate config's fsdp_transformer_layer_cls_to_wrap names SomeOtherFamilysBlock, "
                              "which the trained models (dit) do not have (their blocks: Block); remove it and difftune "
                              "wraps their blocks")
    accelerator = fsdp_accelerator(auto_wrap_policy="NO_WRAP")
    chosen = engines.configure_fsdp(accelerator, Module())
    assert accelerator.state.fsdp_plugin.auto_wrap_policy is None and chosen["policy"] == "NO_WRAP"
    assert "NO_WRAP: one unit per trained model" in engines.engine_line(accelerator, chosen)


def test_fsdp_version_1_is_refused():
    accelerator = SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.FSDP,
                                                        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)),
                                  num_processes=2)
    with pytest.raises(UserError, match=r"^the accelerate config sets fsdp_version 1: difftune trains with FSDP2 "):
        engines.after_accelerator(accelerator)


def test_a_changed_process_layout_resumes_when_every_step_keeps_its_samples():
    saved = {"world_size": 2, "batch_size": 1, "gradient_accumulation_steps": 1, "seed": 3}
    changed, note = changed_settings(saved, {**saved, "world_size": 1, "gradient_accumulation_steps": 2})
    assert changed == [] and note.startswith("resuming with another layout (gradient_accumulation_steps 1 -> 2, "
                                             "world_size 2 -> 1): 2 samples per step as before")
    changed, note = changed_settings(saved, {**saved, "world_size": 4})
    assert changed == ["world_size (2 -> 4)"] and note is None
    changed, _ = changed_settings(saved, {**saved, "world_size": 1, "gradient_accumulation_steps": 2, "seed": 4})
    assert changed == ["seed (3 -> 4)"]


def one_process():
    return SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.NO), num_processes=1,
                           process_index=0, is_main_process=True)


def test_a_state_is_refused_with_a_pickle_or_under_another_engine_family(tmp_path):
    state = tmp_path / "step-3"
    (state / "shards").mkdir(parents=True)
    (state / "state.json").write_text(json.dumps({"format": 2, "settings": {}}))
    (state / "shards" / ".metadata").write_bytes(b"\x80\x04")  # DCP's default index: a pickle
    with pytest.raises(UserError, match=r"contains \.metadata; difftune never loads pickled files"):
        load_training_state(state, one_process(), None, None, None, {})
    (state / "shards" / ".metadata").unlink()
    (state / "state.json").write_text(json.dumps({"format": 3, "settings": {}}))
    with pytest.raises(UserError) as err:
        load_training_state(state, one_process(), None, None, None, {})
    assert str(err.value).endswith("a state saved under DeepSpeed does not resume under one process (resume it "
                                   "under DeepSpeed)")


def test_the_deepspeed_state_layout_is_what_its_reader_expects(tmp_path, monkeypatch):
    """save_deepspeed_tensors on each of 2 processes (DeepSpeed's accessors standing in), read back by StateParts:
    every parameter once, in the file of its owner, with its moments."""
    from safetensors.torch import save_file

    utils = types.ModuleType("deepspeed.utils")
    utils.safe_get_full_fp32_param = lambda p: p.detach().float()
    utils.safe_get_full_optimizer_state = lambda p, key: p.detach().float() * (2 if key == "exp_avg" else 3)
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    monkeypatch.setitem(sys.modules, "deepspeed.utils", utils)

    model = Denoiser()
    flat = torch.zeros(8)
    base = SimpleNamespace(state={flat: {"step": torch.tensor(5.0), "exp_avg": flat, "exp_avg_sq": flat}})
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=base))
    meta = None
    for rank in range(2):
        accelerator = SimpleNamespace(num_processes=2, process_index=rank, unwrap_model=lambda m: model)

        def save(tensors, tmp_file, shown):
            save_file(tensors, str(tmp_file))

        meta = save_deepspeed_tensors(accelerator, engine, tmp_path, tmp_path, save)
    names = [n for n, _ in model.named_parameters()]
    assert meta == {"param_names": names, "optimizer_keys": ["exp_avg", "exp_avg_sq"], "optimizer_step": 5,
                    "parts": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [part_name(0), part_name(1)]
    parts = StateParts(tmp_path, meta)
    params = dict(model.named_parameters())
    for i, name in enumerate(names):
        read = parts.tensors(i, name)
        assert torch.equal(read["weight"], params[name].detach()) and torch.equal(read["exp_avg_sq"], 3 * read["weight"])
        assert owner_of(i, 2) == i % 2
    with pytest.raises(UserError, match=r"deepspeed-1\.safetensors is missing \(the state was written by 2 "):
        (tmp_path / part_name(1)).unlink()
        StateParts(tmp_path, meta)


EXIT_SCRIPT = """
import atexit, os, sys
atexit.register(lambda: print("finalised"))
from difftune.training.engines import exit_launched_process
print("written", end="")  # still in the pipe's buffer
exit_launched_process(3)
print(" and returned", end="")
"""


@pytest.mark.parametrize("world_size, code, out", [("2", 3, "written"), ("1", 0, "written and returnedfinalised\n")])
def test_a_launched_process_ends_without_finalisation_its_output_flushed(world_size, code, out):
    """One of several launched processes leaves through os._exit (FSDP2 keeps the gloo group, and its threads,
    alive past destroy_process_group; its teardown in the interpreter's finalisation aborted a rank under load):
    what it printed still arrives, with its exit code; a lone process returns and finishes as usual."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "WORLD_SIZE": world_size}
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (code, out), proc.stderr[-2000:]
