"""The reference's Z-Image scripts (tests/reference_scripts/z_image/model_training/) with only
`accelerate launch examples/z_image/model_training/train.py` replaced by `difftune train`, on the tiny models laid
out under ./models at the hub ids they name and tiny data sets where they look, with `--max_steps 2` appended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.cli.main import main as difftune
from difftune.families.z_image.testing import write_control_dataset, write_example_dataset, write_tiny_z_image_hub
from difftune.testing.scripts import flag_value, reference_commands
from zimage_helpers import FAMILY  # noqa: F401  (registers the family)

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "z_image" / "model_training"
RUNNING = ["lora/Z-Image-Turbo.sh", "lora/Z-Image.sh", "lora/Z-Image-Omni-Base.sh", "full/Z-Image-Turbo.sh",
           "full/Z-Image.sh", "full/Z-Image-Omni-Base.sh",
           "lora/Z-Image-Turbo-Fun-Controlnet-Union-2.1.sh", "lora/Z-Image-Turbo-Fun-Controlnet-Union-2.1-8steps.sh",
           "lora/Z-Image-Turbo-Fun-Controlnet-Tile-2.1-8steps.sh", "full/Z-Image-Turbo-Fun-Controlnet-Union-2.1.sh",
           "full/Z-Image-Turbo-Fun-Controlnet-Union-2.1-8steps.sh",
           "full/Z-Image-Turbo-Fun-Controlnet-Tile-2.1-8steps.sh",
           "special/differential_training/Z-Image-Turbo.sh"]
# Not yet: --enable_npu_patch (a family flag the seam must carry), --task trajectory_imitation (the task table lives in
# training/losses.py), and the NF4 script on these tiny sizes (bitsandbytes' CPU kernel packs weights in blocks of 64
# input features: the tiny Qwen3 and DiT have layers of 32 and 170).


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("z_image_scripts")
    write_tiny_z_image_hub(root / "models")
    data = root / "data" / "diffsynth_example_dataset" / "z_image"
    for name in ("Z-Image-Turbo", "Z-Image", "Z-Image-Omni-Base"):
        write_example_dataset(data / name, n=2, size=(32, 32))
    for name in ("Z-Image-Turbo-Fun-Controlnet-Union-2.1", "Z-Image-Turbo-Fun-Controlnet-Union-2.1-8steps",
                 "Z-Image-Turbo-Fun-Controlnet-Tile-2.1-8steps"):
        write_control_dataset(data / name, n=2, size=(32, 32))
    # ostris' training adapter (a LoRA on the DiT in diffusers' names) for the differential script
    adapter = root / "models" / "ostris" / "zimage_turbo_training_adapter"
    adapter.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({"diffusion_model.layers.0.attention.to_q.lora_A.weight": torch.randn(4, 64, generator=g),
               "diffusion_model.layers.0.attention.to_q.lora_B.weight": torch.randn(64, 4, generator=g)},
              str(adapter / "zimage_turbo_training_adapter_v1.safetensors"))
    return root


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def test_the_snapshot_has_all_17_scripts():
    assert len(sorted(SCRIPTS.rglob("*.sh"))) == 17


@pytest.mark.slow
@pytest.mark.parametrize("script", RUNNING)
def test_reference_script_runs_with_only_the_launcher_replaced(in_workspace, script):
    (argv,) = reference_commands(SCRIPTS / script)
    assert difftune([*argv, "--max_steps", "2", "--no_progress", "--torch_dtype", "float32"]) == 0
    files = sorted(Path(flag_value(argv, "--output_path")).glob("*.safetensors"))
    assert files, script
    saved = load_file(str(files[-1]))
    if flag_value(argv, "--lora_base_model"):
        assert any(k.endswith("feed_forward.w3.lora_A.weight") for k in saved)
        assert all(v.shape[0] == 32 for k, v in saved.items() if k.endswith("lora_A.weight"))  # --lora_rank 32
    elif flag_value(argv, "--trainable_models") == "controlnet":
        assert any(k.startswith("control_layers.") for k in saved) and not any(k.startswith("layers.") for k in saved)
    else:
        assert "x_pad_token" in saved and "layers.0.feed_forward.w1.weight" in saved  # the DiT, prefix removed



def test_i2l_script_is_refused_in_one_line(in_workspace, capsys):
    (argv,) = reference_commands(SCRIPTS / "full/ZImage-i2L-v2.sh")
    assert difftune([*argv, "--max_steps", "2", "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--template_model_id_or_path" in err[0] and "Diffusion Templates" in err[0]
