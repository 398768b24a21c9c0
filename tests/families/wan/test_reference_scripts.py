"""The reference's Wan scripts (tests/reference_scripts/wanvideo/model_training/) run with only
`accelerate launch .../train.py` replaced by `difftune train` and `--max_steps 2` appended, on tiny models in
Wan-AI's ORIGINAL layout as the scripts name them (./models/Wan-AI/<repo>/: diffusion_pytorch_model*.safetensors
or high_noise_model/ + low_noise_model/, models_t5_umt5-xxl-enc-bf16.pth, Wan2.1_VAE.pth / Wan2.2_VAE.pth, the
CLIP .pth, google/umt5-xxl/) and tiny 5-frame mp4 clips where the scripts look. The scripts' --height 480
--width 832 and default 81 frames are kept: the 4k+1 rule cuts the clips' frames, the frames are resized."""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from difftune.testing import read_reference_script, write_example_video_dataset, write_tiny_wan_original
from difftune.testing.scripts import flag_value

SCRIPTS = Path(__file__).resolve().parents[1] / "reference_scripts" / "wanvideo" / "model_training"
# Wan-AI repository the scripts name -> the tiny variant written for it.
REPOS = {"Wan2.1-T2V-1.3B": "t2v", "Wan2.1-I2V-14B-480P": "i2v", "Wan2.2-I2V-A14B": "i2v_a14b",
         "Wan2.2-TI2V-5B": "ti2v"}
DISTILL_COLUMNS = {"seed": 0, "rand_device": "cpu", "num_inference_steps": 2, "cfg_scale": 2}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_scripts")
    twins = root / "diffusers"
    for repo, variant in REPOS.items():
        folder, twin = write_tiny_wan_original(root / "build" / repo, variant)
        shutil.move(str(twin), str(twins / repo))  # the diffusers twin, kept out of the repository's globs
        shutil.move(str(folder), str(root / "models" / "Wan-AI" / repo))
    data = root / "data" / "diffsynth_example_dataset" / "wanvideo"
    for name in REPOS:
        write_example_video_dataset(data / name, n=2, num_frames=5, size=(64, 32))
    meta = write_example_video_dataset(data / "Wan2.1-T2V-1.3B_direct_distill", n=1, num_frames=5, size=(64, 32))
    with meta.open() as f:
        rows = [{**row, **DISTILL_COLUMNS} for row in csv.DictReader(f)]
    with meta.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return root


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    """Bare original files are matched against the official configs: the tiny ones stand in for them."""
    from difftune.families.wan.components import (DIT_ORIGINAL, IMAGE_ENCODER_ORIGINAL, TEXT_ENCODER_ORIGINAL,
                                                  VAE22_ORIGINAL, VAE_ORIGINAL)

    twins = workspace / "diffusers"
    for repo, variant in REPOS.items():
        config = lambda folder: json.loads((twins / repo / folder / "config.json").read_text())  # noqa: E731
        monkeypatch.setitem(DIT_ORIGINAL.known_configs, f"tiny {variant}", config("transformer"))
        monkeypatch.setitem((VAE22_ORIGINAL if variant == "ti2v" else VAE_ORIGINAL).known_configs,
                            f"tiny {variant}", config("vae"))
    monkeypatch.setitem(TEXT_ENCODER_ORIGINAL.known_configs, "tiny", json.loads(
        (twins / "Wan2.1-T2V-1.3B" / "text_encoder" / "config.json").read_text()))
    monkeypatch.setitem(IMAGE_ENCODER_ORIGINAL.known_configs, "tiny", json.loads(
        (twins / "Wan2.1-I2V-14B-480P" / "image_encoder" / "config.json").read_text()))
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def _run(argv, capsys) -> tuple[float, str]:
    start = time.perf_counter()
    code = difftune([*argv, "--max_steps", "2", "--no_progress"])
    seconds = time.perf_counter() - start
    out = capsys.readouterr()
    assert code == 0, f"`difftune {' '.join(argv)}` exited {code}: {out.err.strip()[-2000:]}"
    return seconds, out.out + out.err


def _checkpoint(argv) -> dict[str, torch.Tensor]:
    files = sorted(Path(flag_value(argv, "--output_path")).glob("*.safetensors"))
    assert files, f"no checkpoint in {flag_value(argv, '--output_path')}"
    return load_file(str(files[-1]))


def _assert_lora(lora: dict[str, torch.Tensor]) -> None:
    # the reference's names (q,k,v,o,ffn.0,ffn.2) trained on diffusers' modules, rank 32, saved in diffusers' layout
    for module in ("attn1.to_q", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"):
        key = f"transformer.blocks.0.{module}.lora_A.weight"
        assert key in lora and lora[key].shape[0] == 32, key
    assert all(k.startswith("transformer.") for k in lora)
    assert any(v.abs().max() > 0 for k, v in lora.items() if ".lora_B." in k)  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("script", ["lora/Wan2.1-T2V-1.3B.sh", "lora/Wan2.1-I2V-14B-480P.sh",
                                    "lora/Wan2.2-TI2V-5B.sh"])
def test_lora_script_runs_on_the_original_files(in_workspace, script, capsys):
    (argv,) = read_reference_script(SCRIPTS / script).commands
    _run(argv, capsys)
    _assert_lora(_checkpoint(argv))


@pytest.mark.slow
def test_a14b_script_trains_each_expert(in_workspace, capsys):
    """Both runs of the Wan2.2-I2V-A14B script: high_noise_model/ then low_noise_model/, each as `dit`."""
    high, low = read_reference_script(SCRIPTS / "lora" / "Wan2.2-I2V-A14B.sh").commands
    loras = []
    for argv in (high, low):
        _run(argv, capsys)
        loras.append(_checkpoint(argv))
        _assert_lora(loras[-1])
    assert loras[0].keys() == loras[1].keys()
    assert any(not torch.equal(loras[0][k], loras[1][k]) for k in loras[0] if ".lora_B." in k)


@pytest.mark.slow
def test_split_training_script_runs_both_stages(in_workspace, capsys):
    """Stage 1 (`sft:data_process`, the DiT named in --offload_models) writes the cache; stage 2 (`sft:train`)
    trains the LoRA from it. --offload_models is accepted with a note (each stage loads only what it uses)."""
    stage1, stage2 = read_reference_script(SCRIPTS / "special" / "split_training" / "Wan2.1-I2V-14B-480P.sh").commands
    _, log1 = _run(stage1, capsys)
    cache = Path(flag_value(stage1, "--output_path"))
    assert any(cache.rglob("complete.json")), "no stage-1 cache"
    _, log2 = _run(stage2, capsys)
    for log in (log1, log2):
        assert "note: --offload_models" in log and "is not needed" in log
    assert "not loading text_encoder" in log2 and "not loading image_encoder" in log2
    _assert_lora(_checkpoint(stage2))


@pytest.mark.slow
def test_direct_distill_script_trains_the_full_dit(in_workspace, capsys):
    (argv,) = read_reference_script(SCRIPTS / "special" / "direct_distill" / "Wan2.1-T2V-1.3B.sh").commands
    _run(argv, capsys)
    trained = _checkpoint(argv)
    twin = load_file(str(in_workspace / "diffusers" / "Wan2.1-T2V-1.3B" / "transformer" /
                         "diffusion_pytorch_model.safetensors"))
    assert trained.keys() == twin.keys()  # the whole DiT, in diffusers' names (the reference's prefix removed)
    assert any(not torch.equal(trained[k].float(), twin[k].float()) for k in twin)  # it trained
