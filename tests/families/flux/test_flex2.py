"""FLEX.2-preview: the released single file is recognised (196 input channels, 8 double blocks in the release) and
its condition channels are the reference's formula."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.families.flux.components import DIT_BFL
from difftune.families.flux.flex2 import (FLEX2_TRANSFORMER_CONFIG, FluxFlexConditioner, flex_latents,
                                          flex_stop_timestep, infer_flux_config, is_flex)
from support.flux.flex2 import write_tiny_flex2
from difftune.models.detect import match_header, read_header


def test_released_file_recognised_by_its_sizes(tmp_path):
    path = write_tiny_flex2(tmp_path)
    header = read_header(path)
    match = match_header(header, [DIT_BFL])  # not a known config: the sizes in its weights
    assert match is not None and match.spec is DIT_BFL and match.label == "the sizes in the weights"
    assert match.config["in_channels"] == 196 and match.config["out_channels"] == 64
    assert (match.config["num_layers"], match.config["num_single_layers"]) == (1, 1)
    assert match.config["guidance_embeds"] and is_flex(match.config)


def test_release_config_is_what_its_weights_infer():
    # FLEX.2-preview: FLUX.1-dev with 8 double blocks and 196 input channels (the reference's input_dim=196,
    # num_blocks=8); inferring the config back from the shapes it builds gives the same model
    shapes = DIT_BFL.signature(FLEX2_TRANSFORMER_CONFIG)
    assert shapes["x_embedder.weight"] == (3072, 196) and shapes["proj_out.weight"] == (64, 3072)
    inferred = infer_flux_config(shapes)
    assert DIT_BFL.signature(inferred) == shapes
    assert inferred["axes_dims_rope"] == [16, 56, 56]


@pytest.fixture(scope="module")
def pipe():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8,) * 4, layers_per_block=1,
                        latent_channels=16, norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False).eval()
    return SimpleNamespace(vae=vae, device="cpu", torch_dtype=torch.float32)


def _image(seed, size=(32, 32)):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _encode(vae, image):
    x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255 * 2 - 1).permute(2, 0, 1)[None]
    z = vae.encode(x).latent_dist.mode()
    return (z - 0.1159) * 0.3611


def test_condition_is_the_reference_formula(pipe):
    inpaint, mask, control = _image(1), _image(2), _image(3)
    with torch.no_grad():
        out = FluxFlexConditioner().process(pipe, 32, 32, 1, inpaint, mask, control, 0.7, 0.25)
        # the reference: mask resized to the latent size, (x / 127.5 - 1 + 1) / 2 of its first channel; the
        # inpaint latents zeroed where the mask is 1; the control latents times the strength
        m = np.asarray(mask.resize((4, 4), Image.BICUBIC), dtype=np.float32)[..., 0]
        m = torch.from_numpy((m * (2 / 255) - 1 + 1) / 2)[None, None]
        expected = torch.cat([_encode(pipe.vae, inpaint) * (1 - m), m, _encode(pipe.vae, control) * 0.7], dim=1)
    assert out["flex_condition"].shape == (1, 33, 4, 4)
    torch.testing.assert_close(out["flex_condition"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["flex_uncondition"][:, 17:], torch.zeros(1, 16, 4, 4))
    torch.testing.assert_close(out["flex_uncondition"][:, :17], expected[:, :17])
    assert out["flex_control_stop"] == 0.25


def test_absent_inputs_are_zeros_and_a_full_mask(pipe):
    out = FluxFlexConditioner().process(pipe, 32, 48, 2, None, None, None, None, None)
    cond = out["flex_condition"]
    assert cond.shape == (2, 33, 4, 6)
    assert torch.equal(cond[:, 16], torch.ones(2, 4, 6)) and not cond[:, :16].any() and not cond[:, 17:].any()
    assert out["flex_control_stop"] == 1.0


def test_model_fn_part_appends_the_condition_until_the_stop():
    latents = torch.randn(1, 16, 4, 4)
    cond, uncond = torch.randn(1, 33, 4, 4), torch.randn(1, 33, 4, 4)
    timesteps = torch.linspace(1000, 0, 11)
    stop_t = flex_stop_timestep(timesteps, 0.5)  # the reference: timesteps[int(0.5 * 10)]
    assert stop_t == 500.0
    early = flex_latents(latents, torch.tensor([700.0]), cond, uncond, stop_t)
    late = flex_latents(latents, torch.tensor([300.0]), cond, uncond, stop_t)
    assert early.shape == (1, 49, 4, 4)
    assert torch.equal(early[:, 16:], cond) and torch.equal(late[:, 16:], uncond)
    assert torch.equal(early[:, :16], latents)
    assert flex_latents(latents, torch.tensor([1.0])) is latents


def test_tiny_flex_transformer_runs_on_the_49_channels(tmp_path):
    from difftune.core.latents import pack_latents, unpack_latents
    from difftune.families.flux.model_fn import image_ids
    from support.flux.flex2 import tiny_flux_transformer

    dit = tiny_flux_transformer(196, 64)
    x = flex_latents(torch.randn(1, 16, 4, 4), torch.tensor([500.0]), torch.randn(1, 33, 4, 4))
    with torch.no_grad():
        out = dit(hidden_states=pack_latents(x), timestep=torch.tensor([0.5]), guidance=torch.tensor([1.0]),
                  pooled_projections=torch.randn(1, 32), encoder_hidden_states=torch.randn(1, 3, 32),
                  txt_ids=torch.zeros(3, 3), img_ids=image_ids(2, 2, "cpu", torch.float32), return_dict=False)[0]
    assert unpack_latents(out, 4, 4).shape == (1, 16, 4, 4)


def test_one_default_per_control_setting_in_training_and_sampling(pipe):
    """A training row with a control image and no flex_control_stop trained with the control at every step (1.0) while
    sampling dropped it halfway (0.5, the reference's pipeline default): now 0.5 wherever it is not given (issue 36);
    the strength's 0.5 likewise."""
    from difftune.families.flux.flex2 import CALL_DEFAULTS, FLEX

    assert CALL_DEFAULTS == {"flex_control_strength": 0.5, "flex_control_stop": 0.5}
    with torch.no_grad():
        out = FluxFlexConditioner().process(pipe, 32, 32, 1, None, None, _image(3), None, None)  # a training row
        given = FluxFlexConditioner().process(pipe, 32, 32, 1, None, None, _image(3), 0.5, 0.5)
    assert out["flex_control_stop"] == 0.5
    torch.testing.assert_close(out["flex_condition"], given["flex_condition"])
    values = {"flex_control_image": _image(3)}
    FLEX.prepare_call(None, values, 1.0, {})  # the Python call and `difftune sample`
    assert values["flex_control_stop"] == out["flex_control_stop"] and values["flex_control_strength"] == 0.5
    assert {k: FLEX.call_inputs[k] for k in CALL_DEFAULTS} == CALL_DEFAULTS
