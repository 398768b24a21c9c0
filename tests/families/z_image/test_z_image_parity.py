"""Z-Image sampling through `ZImagePipeline.__call__` equals diffusers' ZImagePipeline, ZImageOmniPipeline and
ZImageControlNetPipeline on the tiny models (fp32, latents, <= 1e-5)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from support.z_image import (CONTROLNET_REPO, OMNI_REPO, TURBO_REPO, load_tiny_z_image,
                                            write_tiny_z_image_hub)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_z_image_hub(tmp_path_factory.mktemp("z_image_hub"))


TOL = 1e-5


def _diffusers(cls, hub, **parts):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    turbo = hub / TURBO_REPO
    kwargs = dict(scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(turbo / "scheduler"),
                  vae=AutoencoderKL.from_pretrained(turbo / "vae"),
                  text_encoder=Qwen3ForCausalLM.from_pretrained(turbo / "text_encoder"),
                  tokenizer=AutoTokenizer.from_pretrained(turbo / "tokenizer"),
                  transformer=parts.pop("transformer", None) or ZImageTransformer2DModel.from_pretrained(
                      turbo / "transformer"))
    pipe = cls(**kwargs, **parts).to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _picture(seed, size=(32, 32)):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy())


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_text_to_image_equals_diffusers(hub, cfg_scale):
    from diffusers import ZImagePipeline as Theirs

    ours = load_tiny_z_image(hub)
    theirs = _diffusers(Theirs, hub)
    prompts = ["a red circle", "a much longer prompt about a blue square on a green field"]
    mine = ours(prompts, negative_prompt="blurry", cfg_scale=cfg_scale, height=32, width=48, num_inference_steps=3,
                seed=7, output_type="latent", progress=False)
    # diffusers' guidance_scale g is pos + g (pos - neg): the reference's cfg_scale is 1 + g
    ref = theirs(prompts, negative_prompt=["blurry"] * 2, guidance_scale=cfg_scale - 1, height=32, width=48,
                 num_inference_steps=3, generator=torch.Generator().manual_seed(7), output_type="latent").images
    diff = (mine - ref).abs().max().item()
    print(f"z-image t2i cfg {cfg_scale}: max |latents - diffusers| = {diff:.2e}")
    assert mine.shape == (2, 16, 4, 6) and diff <= TOL


def test_omni_base_equals_diffusers(hub, monkeypatch):
    from diffusers import ZImageOmniPipeline, ZImageTransformer2DModel
    from transformers import Siglip2VisionModel

    from difftune.families.z_image.edit import siglip_processor_for

    ours = load_tiny_z_image(hub, dit_repo=OMNI_REPO, siglip=True)
    siglip = Siglip2VisionModel.from_pretrained(hub / OMNI_REPO / "siglip")
    theirs = _diffusers(ZImageOmniPipeline, hub, transformer=ZImageTransformer2DModel.from_pretrained(
        hub / OMNI_REPO / "transformer"), siglip=siglip, siglip_processor=siglip_processor_for(siglip))
    # diffusers casts condition images to bf16 for its bf16 VAE; an fp32 VAE reads them as they are
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self)
    edits = [_picture(1, (64, 64)), _picture(2, (96, 64))]  # diffusers wants sides of 64 px or more
    for images in (None, edits[:1], edits):
        kwargs = dict(height=32, width=32, num_inference_steps=2)
        mine = ours("make it blue", negative_prompt="", cfg_scale=2.0, seed=3, edit_image=images,
                    output_type="latent", progress=False, **kwargs)
        ref = theirs(prompt="make it blue", image=images, guidance_scale=1.0, generator=torch.Generator().manual_seed(3),
                     output_type="latent", **kwargs).images
        diff = (mine - ref).abs().max().item()
        print(f"z-image omni, {len(images or [])} edit image(s): max |latents - diffusers| = {diff:.2e}")
        assert diff <= TOL


def test_controlnet_equals_diffusers_in_its_compat_mode_and_differs_in_the_reference_one(hub):
    from diffusers import ZImageControlNetModel, ZImageControlNetPipeline

    name = "Z-Image-Turbo-Fun-Controlnet-Union-2.1.safetensors"
    ours = load_tiny_z_image(hub, controlnet=name)
    net = ZImageControlNetModel.from_single_file(str(hub / CONTROLNET_REPO / name), config=_controlnet_config(ours),
                                                 torch_dtype=torch.float32)
    theirs = _diffusers(ZImageControlNetPipeline, hub, controlnet=net)
    control = _picture(4)
    common = dict(height=32, width=32, num_inference_steps=2)
    ref = theirs("a cat", control_image=control, controlnet_conditioning_scale=0.75, guidance_scale=0.0,
                 generator=torch.Generator().manual_seed(5), output_type="latent", **common).images
    compat = ours("a cat", controlnet_image=control, controlnet_scale=0.75, seed=5, control_compat="diffusers",
                  output_type="latent", progress=False, **common)
    reference = ours("a cat", controlnet_image=control, controlnet_scale=0.75, seed=5, output_type="latent",
                     progress=False, **common)
    plain = ours("a cat", seed=5, output_type="latent", progress=False, **common)
    diff = (compat - ref).abs().max().item()
    print(f"z-image controlnet (diffusers compat): max |latents - diffusers| = {diff:.2e}; reference forward "
          f"differs by {(reference - ref).abs().max().item():.2e}, no control by {(plain - ref).abs().max():.2e}")
    assert diff <= TOL
    # the reference adds the refiner hints to the DiT and encodes a grey inpaint image: a different forward
    assert (reference - ref).abs().max() > 1e-3 and (plain - ref).abs().max() > 1e-3


def _controlnet_config(pipe):
    """The config difftune recognised the tiny file with, as a folder diffusers' from_single_file reads."""
    import json
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(dict(pipe.controlnet.config)))
    return str(folder)
