"""Shared fixtures of the Z-Image tests: the family registered (it is not built in yet), the tiny models laid out
at the hub ids the reference's scripts name, and pipelines loaded from them."""

from __future__ import annotations

import pytest
import torch

from difftune.core.family import register_family
from difftune.families.z_image import FAMILY, ZImagePipeline
from difftune.families.z_image.testing import hub_paths, write_tiny_z_image_hub
from difftune.models import ModelConfig

register_family(FAMILY)

TURBO, BASE, OMNI = "Tongyi-MAI/Z-Image-Turbo", "Tongyi-MAI/Z-Image", "Tongyi-MAI/Z-Image-Omni-Base"
PAI = "PAI/Z-Image-Turbo-Fun-Controlnet-Union-2.1"


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    return write_tiny_z_image_hub(tmp_path_factory.mktemp("z_image_hub"))


def entry(hub, repo, folder, pattern="*.safetensors"):
    paths = hub_paths(hub, repo, folder, pattern)
    return paths if len(paths) > 1 else paths[0]


def load_pipe(hub, dit_repo=TURBO, siglip=False, controlnet=None, dtype=torch.float32):
    configs = [ModelConfig(entry(hub, dit_repo, "transformer")), ModelConfig(entry(hub, TURBO, "text_encoder")),
               ModelConfig(entry(hub, TURBO, "vae"))]
    if siglip:
        configs.append(ModelConfig(entry(hub, OMNI, "siglip")))
    if controlnet:
        configs.append(ModelConfig(str(hub / PAI / controlnet)))
    return ZImagePipeline.from_pretrained(torch_dtype=dtype, device="cpu", model_configs=configs,
                                          tokenizer_config=ModelConfig(str(hub / TURBO / "tokenizer")))
