"""FLUX.1 Redux: the two released files recognised (and not taken for the IP-Adapter's whole-SigLIP file); Redux
tokens against diffusers' FluxPriorReduxPipeline (fp32, tiny); the prompt they stand in for."""

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.errors import UserError
from difftune.families.flux.model_fn import model_fn_flux
from difftune.families.flux.ipadapter import IPADAPTER_IMAGE_ENCODER
from difftune.families.flux.redux import REDUX_IMAGE_EMBEDDER, REDUX_IMAGE_ENCODER, FluxReduxPromptEmbedder
from support.flux import run_unit_on, write_tiny_redux, write_tiny_siglip
from difftune.models.detect import detect_component
from difftune.models.load import load_component

SPECS = [REDUX_IMAGE_ENCODER, REDUX_IMAGE_EMBEDDER, IPADAPTER_IMAGE_ENCODER]


@pytest.fixture(scope="module")
def redux(tmp_path_factory):
    root = tmp_path_factory.mktemp("redux")
    files = write_tiny_redux(root / "FLUX.1-Redux-dev")
    files["siglip"] = write_tiny_siglip(root / "siglip-so400m-patch14-384")
    return files


def test_released_files_are_recognised_by_slot(redux):
    assert detect_component(str(redux["image_encoder"]), SPECS).name == "flux_redux_image_encoder"
    assert detect_component(str(redux["image_embedder"]), SPECS).name == "flux_redux_image_embedder"
    # google/siglip-so400m-patch14-384: the whole SigLIP, its config.json names SiglipModel -> the IP-Adapter's slot
    det = detect_component(str(redux["siglip"]), SPECS)
    assert det.name == "ipadapter_image_encoder" and det.config["vision_use_head"] is True
    embedder = load_component(str(redux["image_embedder"]), SPECS, torch_dtype=torch.float32).module
    assert type(embedder).__name__ == "ReduxImageEncoder" and embedder.config.txt_in_features == 32


def _image(seed=0, size=(50, 37)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@torch.no_grad()
def test_redux_tokens_match_flux_prior_redux_pipeline(redux):
    from diffusers import FluxPriorReduxPipeline
    from transformers import SiglipImageProcessor

    encoder = load_component(str(redux["image_encoder"]), SPECS, torch_dtype=torch.float32).module
    embedder = load_component(str(redux["image_embedder"]), SPECS, torch_dtype=torch.float32).module
    models = {"flux_redux_image_encoder": encoder, "flux_redux_image_embedder": embedder}
    images = [_image(0), _image(1)]
    out = run_unit_on(FluxReduxPromptEmbedder(), models, flux_redux_image=images, batch_size=2)
    side = encoder.config.image_size
    pipe = FluxPriorReduxPipeline(image_encoder=encoder, image_embedder=embedder, feature_extractor=SiglipImageProcessor(
        size={"height": side, "width": side}, resample=3, do_normalize=True, image_mean=[0.5] * 3,
        image_std=[0.5] * 3))
    ref = pipe.image_embedder(pipe.encode_image(images, "cpu", 1)).image_embeds
    prompt = out["prompt_embeds"]
    assert prompt.shape == (2, 512 + ref.shape[1], 32)
    assert prompt[:, :512].abs().max() == 0  # FluxPriorReduxPipeline without text encoders: 512 zero T5 tokens
    assert (prompt[:, 512:] - ref).abs().max() <= 1e-5
    assert torch.equal(out["negative_prompt_embeds"], prompt) and "pooled_prompt_embeds" not in out
    assert FluxReduxPromptEmbedder.replaces == ("FluxClipEmbedder", "FluxT5Embedder")


@torch.no_grad()
def test_redux_image_changes_the_prediction_and_pooled_is_zero(redux, flux_models):
    encoder = load_component(str(redux["image_encoder"]), SPECS, torch_dtype=torch.float32).module
    embedder = load_component(str(redux["image_embedder"]), SPECS, torch_dtype=torch.float32).module
    models = {"flux_redux_image_encoder": encoder, "flux_redux_image_embedder": embedder}
    a, b = (run_unit_on(FluxReduxPromptEmbedder(), models, flux_redux_image=_image(s))["prompt_embeds"] for s in (0, 5))
    dit, latents = flux_models["dit"], torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([400.0])
    pa = model_fn_flux(dit, latents, t, a, None, torch.tensor([1.0]))
    pb = model_fn_flux(dit, latents, t, b, None, torch.tensor([1.0]))
    zero = model_fn_flux(dit, latents, t, a, torch.zeros(1, 32), torch.tensor([1.0]))
    assert (pa - pb).abs().max() > 1e-4 and torch.equal(pa, zero)
    with pytest.raises(UserError, match="flux_redux_image"):
        run_unit_on(FluxReduxPromptEmbedder(), models)
