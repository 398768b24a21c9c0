"""The accelerate configs in examples/accelerate/ are what accelerate itself reads them as.

Each file goes through accelerate's own parser (`load_config_from_file`) and launcher preparation
(`_validate_launch_command`, then the environment its launcher would give the training processes), and the
DeepSpeed and FSDP plugins are built from that environment, as they are in a real run, and difftune's settings
(training/engines.py) are applied to them. Where they run for real on 2 CPU processes: the DDP config in
tests/training/test_distributed.py, fsdp.yaml in tests/training/test_sharded.py, the three DeepSpeed configs in
tests/training/test_deepspeed.py (skipped where DeepSpeed is not installed, as in CI).
"""

import os
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

from conftest import train_args
from difftune.errors import UserError

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "accelerate"
EXPECTED = {
    "single_gpu.yaml": DistributedType.NO,
    "multi_gpu_ddp.yaml": DistributedType.MULTI_GPU,
    "deepspeed_zero2_offload.yaml": DistributedType.DEEPSPEED,
    "deepspeed_zero3.yaml": DistributedType.DEEPSPEED,
    "deepspeed_zero3_offload_single_gpu.yaml": DistributedType.DEEPSPEED,
    "fsdp.yaml": DistributedType.FSDP,
}
JSON_CONFIGURED = {"deepspeed_zero3_offload_single_gpu.yaml"}  # precision is in its DeepSpeed JSON file


def launcher_args(path, *overrides):
    """What `accelerate launch --config_file <path> ... train.py` resolves the file to."""
    parsed = launch_command_parser().parse_args(["--config_file", str(path), *overrides, "train.py"])
    args, defaults, _ = _validate_launch_command(parsed)
    return args, defaults


def launcher_env(monkeypatch, env: dict) -> None:
    """Give this process the variables accelerate's launcher sets for the training processes."""
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)


@pytest.fixture(autouse=True)
def _no_inherited_launch_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(key)


def test_examples_folder_has_exactly_the_documented_configs():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)
    readme = (CONFIGS / "README.md").read_text()
    assert all(name in readme for name in EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerates_parser_and_has_no_unknown_keys(name):
    path = CONFIGS / name
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)  # a local-machine config, not SageMaker
    assert config == ClusterConfig.from_yaml_file(str(path))
    assert config.distributed_type == EXPECTED[name]
    assert config.num_machines == 1 and not config.use_cpu
    assert config.mixed_precision == (None if name in JSON_CONFIGURED else "bf16")
    # accelerate copies nested keys onto its launch arguments without checking them: a typo is ignored
    # silently, so every nested key must be a real `accelerate launch` argument.
    known = {action.dest for action in launch_command_parser()._actions}
    raw = yaml.safe_load(path.read_text())
    nested = [key for key in raw.get("deepspeed_config", {})]
    nested += [key if key.startswith("fsdp_") else f"fsdp_{key}" for key in raw.get("fsdp_config", {})]
    assert [key for key in nested if key not in known] == []


def test_single_gpu_config_runs_one_process_on_gpu_0():
    args, _ = launcher_args(CONFIGS / "single_gpu.yaml")
    assert not (args.multi_gpu or args.use_deepspeed or args.use_fsdp) and args.num_processes == 1
    cmd, env = prepare_simple_launcher_cmd_env(args)
    # accelerate >= 1.16 names the visible devices only for the backend it finds (none on a CPU machine)
    assert args.gpu_ids == "0" and env.get("CUDA_VISIBLE_DEVICES", "0") == "0"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert cmd[-1] == "train.py"


def test_ddp_config_is_multi_gpu_and_the_process_count_can_be_overridden():
    args, _ = launcher_args(CONFIGS / "multi_gpu_ddp.yaml")
    assert args.multi_gpu and not (args.use_deepspeed or args.use_fsdp)
    assert args.num_processes == 8 and args.gpu_ids == "all"
    env = prepare_multi_gpu_env(args)
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # every GPU stays visible
    assert args.nproc_per_node == "8" and "ACCELERATE_USE_FSDP" not in env
    args, _ = launcher_args(CONFIGS / "multi_gpu_ddp.yaml", "--num_processes", "2", "--mixed_precision", "no")
    assert args.num_processes == 2 and args.mixed_precision == "no"


def test_deepspeed_config_is_zero2_with_cpu_offload_and_leaves_accumulation_to_difftune(monkeypatch):
    args, defaults = launcher_args(CONFIGS / "deepspeed_zero2_offload.yaml")
    assert args.use_deepspeed and args.zero_stage == 2 and args.mixed_precision == "bf16"
    assert args.offload_optimizer_device == "cpu" and args.offload_param_device == "cpu"
    assert args.gradient_accumulation_steps is None  # absent: --gradient_accumulation_steps decides
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env
    launcher_env(monkeypatch, env)
    plugin = DeepSpeedPlugin()  # built from the launcher's environment, as in the training process
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 2
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"  # filled from the Accelerator
    assert plugin.is_auto("train_micro_batch_size_per_gpu")  # filled by the training loop (no DataLoader)


def test_fsdp_config_fully_shards_each_block_of_the_denoiser(monkeypatch, tiny_repo):
    from diffusers import QwenImageTransformer2DModel
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    args, _ = launcher_args(CONFIGS / "fsdp.yaml")
    assert args.use_fsdp and not (args.multi_gpu or args.use_deepspeed)
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    launcher_env(monkeypatch, env)
    plugin = FullyShardedDataParallelPlugin()  # built from the launcher's environment
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # FSDP2's FULL_SHARD
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and not plugin.activation_checkpointing
    # No class named: one config for every family; the unit is the model's own block class (_no_split_modules).
    assert plugin.transformer_cls_names_to_wrap is None
    dit = QwenImageTransformer2DModel.from_pretrained(Path(tiny_repo) / "transformer", torch_dtype=torch.float32)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, dit)
    wrapped = [m for m in dit.modules() if policy(m)]
    assert len(wrapped) == len(dit.transformer_blocks) >= 2 and all(m in wrapped for m in dit.transformer_blocks)


@pytest.mark.parametrize("name, processes, offload", [("deepspeed_zero3.yaml", 8, "none"),
                                                      ("deepspeed_zero3_offload_single_gpu.yaml", 1, "cpu")])
def test_zero3_configs_partition_everything_and_can_write_checkpoints(monkeypatch, name, processes, offload):
    monkeypatch.chdir(CONFIGS.parents[1])  # the JSON file's path is relative to where `accelerate launch` runs
    args, defaults = launcher_args(CONFIGS / name)
    assert args.use_deepspeed and args.num_processes == processes and args.gradient_accumulation_steps is None
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    launcher_env(monkeypatch, env)
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("bf16")
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3 and plugin.zero3_init_flag
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == offload
    # without it accelerate's get_state_dict refuses to gather the weights, so no checkpoint could be saved
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert plugin.deepspeed_config["bf16"]["enabled"] is True
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"  # filled from the Accelerator


def test_accumulation_from_an_accelerate_config_that_disagrees_with_the_flag_is_refused(monkeypatch, tmp_path):
    from difftune.training.accelerator import make_accelerator

    # The reference's ZeRO-2 config carries gradient_accumulation_steps: 1; accelerate's DeepSpeed launcher
    # exports it, and Accelerator() then ignores its own gradient_accumulation_steps argument.
    config = yaml.safe_load((CONFIGS / "deepspeed_zero2_offload.yaml").read_text())
    config["deepspeed_config"]["gradient_accumulation_steps"] = 1
    path = tmp_path / "reference_zero2offload.yaml"
    path.write_text(yaml.safe_dump(config))
    args, defaults = launcher_args(path)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])
    flags = ["--dataset_base_path", tmp_path, "--torch_dtype", "float32"]
    with pytest.raises(UserError) as err:
        make_accelerator(train_args(*flags, "--gradient_accumulation_steps", 4), None)
    assert str(err.value) == ("the accelerate config sets gradient_accumulation_steps to 1 but "
                              "--gradient_accumulation_steps is 4: remove it from the config (the flag decides)")
    assert make_accelerator(train_args(*flags, "--gradient_accumulation_steps", 1), None).gradient_accumulation_steps == 1


def test_training_loop_tells_deepspeed_the_micro_batch_size(monkeypatch):
    """difftune prepares no DataLoader, from which accelerate would read DeepSpeed's micro-batch size."""
    from types import SimpleNamespace

    from difftune.training.fit import train
    from difftune.training.loop import LoopConfig

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    plugin = DeepSpeedPlugin()
    seen = {}

    class Stop(Exception):
        pass

    def prepare(*objects):  # where accelerate would hand the config to deepspeed.initialize
        seen["micro"] = plugin.deepspeed_config["train_micro_batch_size_per_gpu"]
        raise Stop

    accelerator = SimpleNamespace(num_processes=2, process_index=0, is_main_process=True, prepare=prepare,
                                  state=SimpleNamespace(deepspeed_plugin=plugin,
                                                        distributed_type=DistributedType.DEEPSPEED))
    module = torch.nn.Linear(2, 2)
    module.trainable_modules = lambda: list(module.parameters())
    with pytest.raises(Stop):
        train(accelerator, list(range(12)), module, LoopConfig(batch_size=3, progress=False))
    assert seen["micro"] == 3


def deepspeed_plugin(monkeypatch, name):
    monkeypatch.chdir(CONFIGS.parents[1])  # the single-GPU config names its JSON file from the repository root
    args, defaults = launcher_args(CONFIGS / name)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    launcher_env(monkeypatch, env)
    return DeepSpeedPlugin()


@pytest.mark.parametrize("name", ["deepspeed_zero2_offload.yaml", "deepspeed_zero3.yaml",
                                  "deepspeed_zero3_offload_single_gpu.yaml"])
def test_deepspeed_clips_at_max_grad_norm_and_takes_the_micro_batch_from_the_flags(monkeypatch, name):
    """accelerate fills DeepSpeed's `auto` clipping with 1.0 and the loop's own clip does nothing under DeepSpeed:
    --max_grad_norm is handed to DeepSpeed instead (0: off, as without the flag)."""
    from types import SimpleNamespace

    from difftune.training.engines import configure_deepspeed, engine_line

    for flag, clip in ((None, 0.0), (0.5, 0.5)):
        plugin = deepspeed_plugin(monkeypatch, name)
        accelerator = SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                                            deepspeed_plugin=plugin),
                                      num_processes=8, device=torch.device("cuda"))
        chosen = configure_deepspeed(accelerator, batch_size=2, max_grad_norm=flag)
        assert plugin.deepspeed_config["gradient_clipping"] == clip
        assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 2
        line = engine_line(accelerator, chosen)
        assert line.startswith(f"engine: DeepSpeed ZeRO-{3 if 'zero3' in name else 2} over 8 processes (cuda)")
        assert line.endswith("no gradient clipping" if clip == 0 else "gradient clipping 0.5")
        assert ("optimizer on cpu" in line) == ("offload" in name)
        assert ("parameters on cpu" in line) == (name == "deepspeed_zero3_offload_single_gpu.yaml")  # ZeRO-3 only


def test_a_deepspeed_clipping_that_disagrees_with_the_flag_is_refused(monkeypatch):
    from types import SimpleNamespace

    from difftune.training.engines import configure_deepspeed

    plugin = deepspeed_plugin(monkeypatch, "deepspeed_zero3.yaml")
    plugin.deepspeed_config["gradient_clipping"] = 1.0  # as a config with gradient_clipping: 1.0 gives it
    accelerator = SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                                        deepspeed_plugin=plugin))
    with pytest.raises(UserError) as err:
        configure_deepspeed(accelerator, batch_size=1, max_grad_norm=None)
    assert str(err.value) == ("the DeepSpeed config sets gradient_clipping to 1.0 but --max_grad_norm is not given (no "
                              "clipping): remove it from the config or pass --max_grad_norm 1.0 (the flag decides)")
    configure_deepspeed(accelerator, batch_size=1, max_grad_norm=1.0)  # agreeing: accepted
