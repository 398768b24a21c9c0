"""Z-Image's recognition beyond the shared checks (tests/families/test_recognition.py: the official folders,
ComfyUI's single-file DiT, the real-size models from their headers): the Fun ControlNet single files, and two models
for one slot refused in one line."""

from __future__ import annotations

import pytest

from difftune.core.family import recognise
from difftune.errors import UserError
from difftune.models import ModelConfig
from support.z_image import CONTROLNET_FILES, CONTROLNET_REPO, TURBO_REPO, hub_entry, write_tiny_z_image_hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_z_image_hub(tmp_path_factory.mktemp("z_image_hub"))


def _slots(configs, family=None):
    spec, found = recognise(configs, family, log=lambda *a: None)
    return spec.name, {slot: det for slot, _, det in found}


@pytest.mark.parametrize("filename", CONTROLNET_FILES)
def test_fun_controlnet_single_files(hub, filename):
    name, found = _slots([ModelConfig(str(hub / CONTROLNET_REPO / filename)), ModelConfig(hub_entry(hub, TURBO_REPO, "transformer"))])
    config = found["controlnet"].config
    assert name == "z_image" and found["controlnet"].source == "weights match the sizes in the weights"
    assert config["control_layers_places"] == [0, 2] and config["control_in_dim"] == 33
    assert config["add_control_noise_refiner"] == "control_noise_refiner"


def test_two_models_for_one_slot_are_refused_in_one_line(hub):
    with pytest.raises(UserError) as err:
        recognise([ModelConfig(str(hub / CONTROLNET_REPO / CONTROLNET_FILES[0])), ModelConfig(hub_entry(hub, TURBO_REPO, "vae")),
                   ModelConfig(hub_entry(hub, TURBO_REPO, "vae"))], "z_image")
    assert "\n" not in str(err.value) and "AutoencoderKL" in str(err.value)
