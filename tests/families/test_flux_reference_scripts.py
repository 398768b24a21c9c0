"""The reference's FLUX.1 LoRA scripts (tests/reference_scripts/flux/model_training/lora/) run with only
`accelerate launch examples/flux/model_training/train.py` replaced by `difftune train`, on tiny models in the
layouts they name (BFL single files from an offline hub under ./models) and tiny data sets where the scripts
look (./data/diffsynth_example_dataset/flux/...), with `--max_steps 2` appended. Plus the two-stage form of the
FLUX.1-dev command, split as the reference's split_training scripts split theirs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from difftune.testing import (populate_offline_hub, write_example_dataset, write_kontext_dataset, write_tiny_flux,
                              write_tiny_flux_bfl)
from difftune.testing.scripts import flag_value, reference_commands

SCRIPTS = Path(__file__).resolve().parents[1] / "reference_scripts" / "flux" / "model_training" / "lora"


def test_reference_commands_parses_the_scripts():
    (dev,) = reference_commands(SCRIPTS / "FLUX.1-dev.sh")
    assert dev[:3] == ["train", "--dataset_base_path", "data/diffsynth_example_dataset/flux/FLUX.1-dev"]
    assert dev[dev.index("--model_id_with_origin_paths") + 1].startswith("black-forest-labs/FLUX.1-dev:flux1-dev.")
    assert dev[-2:] == ["--align_to_opensource_format", "--use_gradient_checkpointing"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """./models with FLUX.1-dev (diffusers folders + flux1-dev.safetensors + ae.safetensors), FLUX.1-Krea-dev and
    FLUX.1-Kontext-dev (their BFL transformers, other weights), and the three data sets the scripts name."""
    root = tmp_path_factory.mktemp("flux_scripts")
    repo = write_tiny_flux(root / "tiny")
    dev = populate_offline_hub(root / "models", "black-forest-labs/FLUX.1-dev", repo)
    write_tiny_flux_bfl(dev)
    for name, file, seed in (("FLUX.1-Krea-dev", "flux1-krea-dev.safetensors", 10),
                             ("FLUX.1-Kontext-dev", "flux1-kontext-dev.safetensors", 20)):
        from difftune.testing import TinyFluxSpec

        other = write_tiny_flux(root / name, TinyFluxSpec(seed=seed))
        write_tiny_flux_bfl(other, name=file)
        (root / "models" / "black-forest-labs" / name).mkdir(parents=True)
        shutil.copy(other / file, root / "models" / "black-forest-labs" / name / file)
    data = root / "data" / "diffsynth_example_dataset" / "flux"
    write_example_dataset(data / "FLUX.1-dev", n=2, size=(48, 32))
    write_example_dataset(data / "FLUX.1-Krea-dev", n=2, size=(48, 32))
    write_kontext_dataset(data / "FLUX.1-Kontext-dev", n=2, size=(48, 32), kontext_size=(32, 48))
    return root


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    import json

    from difftune.families.flux.components import DIT, VAE

    # BFL's single files carry no config: the tiny configs stand in for FLUX.1's known ones
    for spec, folder in ((DIT, "transformer"), (VAE, "vae")):
        monkeypatch.setitem(spec.known_configs, "tiny", json.loads((workspace / "tiny" / folder / "config.json").read_text()))
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def _checkpoint(output: str) -> dict[str, torch.Tensor]:
    files = sorted(Path(output).glob("*.safetensors"))
    assert files, f"no checkpoint in {output}"
    return load_file(str(files[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("script", ["FLUX.1-dev.sh", "FLUX.1-Krea-dev.sh", "FLUX.1-Kontext-dev.sh"])
def test_reference_script_runs_with_only_the_launcher_replaced(in_workspace, script):
    (argv,) = reference_commands(SCRIPTS / script)
    assert difftune([*argv, "--max_steps", "2", "--no_progress"]) == 0
    lora = _checkpoint(flag_value(argv, "--output_path"))
    if "--align_to_opensource_format" in argv:  # the reference's kohya file: BFL's fused names, an alpha per layer
        assert all(k.startswith("lora_unet_") for k in lora)
        assert lora["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 3 * 32  # q, k, v
        assert lora["lora_unet_single_blocks_0_linear1.lora_down.weight"].shape[0] == 4 * 32  # q, k, v, MLP
        assert any(v.abs().max() > 0 for k, v in lora.items() if ".lora_up." in k)  # it trained
        return
    # the reference's fused target names, trained on diffusers' modules, saved in diffusers' LoRA layout
    assert all(k.startswith("transformer.") for k in lora)
    for module in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_v_proj",
                   "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.attn.to_k"):
        assert f"transformer.{module}.lora_A.weight" in lora
        assert lora[f"transformer.{module}.lora_A.weight"].shape[0] == 32  # --lora_rank 32
    assert any(v.abs().max() > 0 for k, v in lora.items() if ".lora_B." in k)  # it trained


@pytest.mark.slow
def test_two_stage_form_of_the_dev_command(in_workspace):
    """The dev command split as the reference's split_training scripts do: stage 1 with the encoders (no DiT),
    `--dataset_repeat 1`, `--task sft:data_process`; stage 2 from the cache with the DiT alone, `--task sft:train`.
    It trains what the one-stage command trains (bf16 weights, as the reference's default: within bf16 rounding)."""
    (argv,) = reference_commands(SCRIPTS / "FLUX.1-dev.sh")
    models = flag_value(argv, "--model_id_with_origin_paths").split(",")
    dit = [m for m in models if m.endswith("flux1-dev.safetensors")]
    assert len(dit) == 1

    def edit(argv, **changes):
        out = list(argv)
        for name, value in changes.items():
            i = out.index(f"--{name}")
            if value is None:
                del out[i:i + 2]
            else:
                out[i + 1] = value
        return out

    one = [*argv, "--max_steps", "2", "--no_progress"]
    stage1 = edit(one, model_id_with_origin_paths=",".join(m for m in models if m not in dit), dataset_repeat="1",
                  output_path="./models/train/FLUX.1-dev-LoRA-splited-cache") + ["--task", "sft:data_process"]
    stage2 = edit(one, model_id_with_origin_paths=dit[0], dataset_metadata_path=None,
                  dataset_base_path="./models/train/FLUX.1-dev-LoRA-splited-cache",
                  output_path="./models/train/FLUX.1-dev-LoRA-splited") + ["--task", "sft:train"]
    assert difftune(one) == 0
    assert difftune(stage1) == 0
    assert difftune(stage2) == 0
    a, b = _checkpoint(flag_value(argv, "--output_path")), _checkpoint("./models/train/FLUX.1-dev-LoRA-splited")
    assert a.keys() == b.keys() and a
    # stage 2 trained (the dev command passes --align_to_opensource_format: kohya's lora_up)
    assert any(v.abs().max() > 0 for k, v in b.items() if ".lora_B." in k or ".lora_up." in k)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"flux dev command: one-stage vs two-stage max LoRA difference {diff:.2e}")
    assert diff < 1e-3
