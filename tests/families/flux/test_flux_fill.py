"""FLUX.1 Fill: flux1-fill-dev.safetensors (BFL layout, 384 inputs) recognised and converted; the fill condition
against diffusers' FluxFillPipeline mask preparation; the denoiser call with it (fp32, tiny)."""

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.core.latents import pack_latents
from difftune.errors import UserError
from difftune.families.flux.bfl import bfl_transformer_from_diffusers
from difftune.families.flux.components import DIT, DIT_BFL
from difftune.families.flux.fill import FLUX1_FILL_TRANSFORMER_CONFIG, FluxFillCondition, is_fill_dit
from difftune.families.flux.model_fn import model_fn_flux
from support.flux import run_unit_on, with_config, write_tiny_fill_dit
from difftune.models.detect import match_header, read_header
from difftune.models.load import load_component
from support import TinyFluxSpec

SPEC = TinyFluxSpec()
TINY_FILL = {**FLUX1_FILL_TRANSFORMER_CONFIG, "num_layers": SPEC.num_layers,
             "num_single_layers": SPEC.num_single_layers, "attention_head_dim": SPEC.attention_head_dim,
             "num_attention_heads": SPEC.num_attention_heads, "joint_attention_dim": SPEC.t5_hidden,
             "pooled_projection_dim": SPEC.clip_hidden, "axes_dims_rope": list(SPEC.axes_dims_rope)}


def test_fill_dit_is_recognised_at_full_size_and_not_as_dev():
    import torch as t
    shapes = DIT.signature(FLUX1_FILL_TRANSFORMER_CONFIG)
    bfl = bfl_transformer_from_diffusers({k: t.empty(s, device="meta") for k, s in shapes.items()})
    bfl_shapes = {k: tuple(v.shape) for k, v in bfl.items()}
    assert bfl_shapes["img_in.weight"] == (3072, 384) and bfl_shapes["final_layer.linear.weight"] == (64, 3072)
    match = match_header(bfl_shapes, [DIT, DIT_BFL])
    assert match.spec is DIT_BFL and match.config == FLUX1_FILL_TRANSFORMER_CONFIG
    match = match_header(shapes, [DIT, DIT_BFL])
    assert match.spec is DIT and match.config == FLUX1_FILL_TRANSFORMER_CONFIG


def test_tiny_fill_file_loads_onto_a_384_input_transformer(tmp_path):
    path = write_tiny_fill_dit(tmp_path)
    assert path.name == "flux1-fill-dev.safetensors" and "img_in.weight" in read_header(path)
    dit = load_component(str(path), [DIT_BFL, with_config(DIT_BFL, TINY_FILL)], torch_dtype=torch.float32).module
    assert is_fill_dit(dit) and dit.x_embedder.in_features == 384 and dit.proj_out.out_features == 64


def _pair(size=(48, 32)):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    mask = Image.new("RGB", (size[0] + 8, size[1] + 8), (0, 0, 0))
    mask.paste((200, 200, 200), (10, 6, 40, 30))  # light: to fill; a size that is resized
    return image, mask


@torch.no_grad()
def test_fill_condition_matches_diffusers_prepare_mask_latents(flux_models):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxFillPipeline

    vae = flux_models["vae"]
    image, mask = _pair()
    out = run_unit_on(FluxFillCondition(), {"vae": vae}, flux_fill_image=image, flux_fill_mask=mask, height=32,
                      width=48, batch_size=1)["fill_condition"]
    assert out.shape == (1, 80, 4, 6)
    pipe = FluxFillPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                            text_encoder=flux_models["text_encoder"], tokenizer=flux_models["tokenizer"],
                            text_encoder_2=flux_models["text_encoder_2"], tokenizer_2=flux_models["tokenizer_2"],
                            transformer=flux_models["dit"])
    init = pipe.image_processor.preprocess(image, height=32, width=48)
    mask_image = pipe.mask_processor.preprocess(mask, height=32, width=48)
    masked = vae.encode(init * (1 - mask_image)).latent_dist.mode()  # diffusers takes ready latents as they are
    mask_packed, latents_packed = pipe.prepare_mask_latents(mask_image, masked, 1, 16, 1, 32, 48, torch.float32,
                                                            "cpu", None)
    ref = torch.cat((latents_packed, mask_packed), dim=-1)
    assert ref.shape[-1] == 320
    assert (pack_latents(out) - ref).abs().max() <= 1e-5
    assert 0 < out[:, 16:].mean() < 1  # some pixels to fill, some kept


@torch.no_grad()
def test_fill_denoiser_call_matches_diffusers(tmp_path, flux_models):
    dit = load_component(str(write_tiny_fill_dit(tmp_path)), [with_config(DIT_BFL, TINY_FILL)],
                         torch_dtype=torch.float32).module
    g = torch.Generator().manual_seed(1)
    latents, cond = torch.randn(1, 16, 4, 6, generator=g), torch.randn(1, 80, 4, 6, generator=g)
    prompt, pooled, t = torch.randn(1, 5, 32, generator=g), torch.randn(1, 32, generator=g), torch.tensor([300.0])
    ours = model_fn_flux(dit, latents, t, prompt, pooled, torch.tensor([3.5]), fill_condition=cond)
    # FluxFillPipeline: torch.cat((latents, masked_image_latents), dim=2) of packed tokens
    from difftune.families.flux.model_fn import image_ids
    ref = dit(hidden_states=torch.cat([pack_latents(latents), pack_latents(cond)], dim=2), timestep=t / 1000,
              guidance=torch.tensor([3.5]), pooled_projections=pooled, encoder_hidden_states=prompt,
              txt_ids=torch.zeros(5, 3), img_ids=image_ids(2, 3, "cpu", torch.float32), return_dict=False)[0]
    assert (pack_latents(ours) - ref).abs().max() <= 1e-5
    other = model_fn_flux(dit, latents, t, prompt, pooled, torch.tensor([3.5]), fill_condition=cond * 0.5)
    assert (other - ours).abs().max() > 1e-4
    # no fill condition: the reference's all-to-fill one (zero image latents, all-ones mask)
    everything = torch.cat([torch.zeros(1, 16, 4, 6), torch.ones(1, 64, 4, 6)], dim=1)
    torch.testing.assert_close(model_fn_flux(dit, latents, t, prompt, pooled, torch.tensor([3.5])),
                               model_fn_flux(dit, latents, t, prompt, pooled, torch.tensor([3.5]),
                                             fill_condition=everything), rtol=0, atol=0)


def test_no_fill_image_means_everything_to_fill_and_half_a_pair_is_refused(flux_models):
    vae = {"vae": flux_models["vae"]}
    out = run_unit_on(FluxFillCondition(), vae, height=32, width=32, batch_size=2)["fill_condition"]
    assert out.shape == (2, 80, 4, 4) and out[:, :16].abs().max() == 0 and out[:, 16:].min() == 1
    with pytest.raises(UserError, match="both"):
        run_unit_on(FluxFillCondition(), vae, flux_fill_image=_pair()[0], height=32, width=48)


@torch.no_grad()
def test_sampling_equals_flux_fill_pipeline(flux_repo, flux_models, tmp_path):
    """The whole sampling loop of a Fill DiT with an image and a mask == diffusers' FluxFillPipeline (fp32, tiny,
    latents)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxFillPipeline

    from difftune import FluxImagePipeline
    from difftune.models import ModelConfig
    from support import tiny_flux_paths

    dit = load_component(str(write_tiny_fill_dit(tmp_path)), [with_config(DIT_BFL, TINY_FILL)],
                         torch_dtype=torch.float32).module
    paths = tiny_flux_paths(flux_repo)
    ours = FluxImagePipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(p if len(p) > 1 else p[0]) for p in paths.values()],
        tokenizer_1_config=ModelConfig(str(flux_repo / "tokenizer")),
        tokenizer_2_config=ModelConfig(str(flux_repo / "tokenizer_2")))
    ours.dit, ours.vae = dit, flux_models["vae"]  # the fixture's near-deterministic VAE encode
    m = flux_models
    theirs = FluxFillPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(str(flux_repo / "scheduler")),
                              vae=m["vae"], text_encoder=m["text_encoder"], tokenizer=m["tokenizer"],
                              text_encoder_2=m["text_encoder_2"], tokenizer_2=m["tokenizer_2"], transformer=dit)
    theirs.set_progress_bar_config(disable=True)
    image, mask = _pair()
    a = ours("a red circle", flux_fill_image=image, flux_fill_mask=mask, height=32, width=48,
             num_inference_steps=3, seed=7, progress=False, output_type="latent")
    noise = pack_latents(torch.randn(1, 16, 4, 6, generator=torch.Generator().manual_seed(7)))
    b = theirs("a red circle", image=image, mask_image=mask, height=32, width=48, num_inference_steps=3,
               guidance_scale=3.5, generator=torch.Generator().manual_seed(0), latents=noise,
               output_type="latent").images
    diff = (pack_latents(a) - b).abs().max().item()
    print(f"flux Fill vs FluxFillPipeline: latents max difference {diff:.2e}")
    assert diff <= 1e-5
