"""InfiniteYou: image_proj_model.bin (nested pickle, resampler names) recognised and mapped onto diffusers'
IP-Adapter-Plus resampler, which computes the reference's formula; the InfuseNet ControlNet reads the face tokens
as its prompt with infinityou_guidance, as diffusers' ControlNet call does."""

import math

import pytest
import torch
from PIL import Image

from difftune.core.latents import pack_latents
from difftune.errors import UserError
from difftune.families.flux.model_fn import model_fn_flux
from difftune.families.flux.infiniteyou import IMAGE_PROJ_MODEL, INFU_IMAGE_PROJ_CONFIG, FluxInfiniteYouEmbedder
from difftune.families.flux.model_fn import image_ids
from support.flux import run_unit_on, with_config, write_tiny_controlnet, write_tiny_image_proj
from difftune.families.flux.infiniteyou import image_proj_native_keys
from support.flux.variants import tiny_controlnet_config, tiny_image_proj_config
from difftune.models.detect import match_header
from difftune.models.files import load_pth
from difftune.models.load import load_component


@pytest.fixture(scope="module")
def proj_file(tmp_path_factory):
    return write_tiny_image_proj(tmp_path_factory.mktemp("infu"))


@pytest.fixture(scope="module")
def projector(proj_file):
    return load_component(str(proj_file), [with_config(IMAGE_PROJ_MODEL, tiny_image_proj_config())],
                          torch_dtype=torch.float32).module


def test_release_layout_is_recognised_at_full_size():
    shapes = IMAGE_PROJ_MODEL.signature(INFU_IMAGE_PROJ_CONFIG)
    released = image_proj_native_keys({k: torch.empty(s, device="meta") for k, s in shapes.items()})
    header = {"image_proj." + k: tuple(v.shape) for k, v in released.items()}
    assert header["image_proj.layers.0.0.to_kv.weight"] == (2560, 1280)
    match = match_header(header, [IMAGE_PROJ_MODEL])
    assert match is not None and match.config == INFU_IMAGE_PROJ_CONFIG
    assert IMAGE_PROJ_MODEL.infer_config(shapes) == INFU_IMAGE_PROJ_CONFIG


def _reference_resampler(sd, x, heads, depth):
    """The reference's InfiniteYouImageProjector on the release's tensors, step by step."""
    ln = torch.nn.functional.layer_norm
    lin = torch.nn.functional.linear
    latents = sd["latents"].repeat(x.shape[0], 1, 1)
    x = lin(x, sd["proj_in.weight"], sd["proj_in.bias"])
    for i in range(depth):
        p = f"layers.{i}."
        xs = ln(x, x.shape[-1:], sd[p + "0.norm1.weight"], sd[p + "0.norm1.bias"])
        ls = ln(latents, latents.shape[-1:], sd[p + "0.norm2.weight"], sd[p + "0.norm2.bias"])
        q = lin(ls, sd[p + "0.to_q.weight"])
        k, v = lin(torch.cat([xs, ls], 1), sd[p + "0.to_kv.weight"]).chunk(2, dim=-1)
        b, n, _ = q.shape
        q, k, v = (t.view(b, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        scale = 1 / math.sqrt(math.sqrt(q.shape[-1]))
        w = torch.softmax((q * scale) @ (k * scale).transpose(-2, -1), dim=-1)
        out = (w @ v).permute(0, 2, 1, 3).reshape(b, n, -1)
        latents = lin(out, sd[p + "0.to_out.weight"]) + latents
        h = ln(latents, latents.shape[-1:], sd[p + "1.0.weight"], sd[p + "1.0.bias"])
        latents = lin(torch.nn.functional.gelu(lin(h, sd[p + "1.1.weight"])), sd[p + "1.3.weight"]) + latents
    latents = lin(latents, sd["proj_out.weight"], sd["proj_out.bias"])
    return ln(latents, latents.shape[-1:], sd["norm_out.weight"], sd["norm_out.bias"])


@torch.no_grad()
def test_projector_computes_the_reference_resampler(proj_file, projector):
    raw = {k[len("image_proj."):]: v for k, v in load_pth(proj_file).items()}
    face = torch.randn(2, 1, 512, generator=torch.Generator().manual_seed(0))
    config = tiny_image_proj_config()
    ref = _reference_resampler(raw, face, config["heads"], config["depth"])
    assert (projector(face) - ref).abs().max() <= 1e-5


@torch.no_grad()
def test_infusenet_reads_face_tokens_and_infinityou_guidance(flux_models, projector, tmp_path):
    from diffusers import FluxControlNetModel
    from safetensors.torch import load_file

    config = tiny_controlnet_config("infusenet")
    infusenet = FluxControlNetModel.from_config({k: v for k, v in config.items() if k != "_class_name"}).eval()
    infusenet.load_state_dict(load_file(str(write_tiny_controlnet(tmp_path, "infusenet"))))
    dit = flux_models["dit"]
    g = torch.Generator().manual_seed(4)
    latents, cond = torch.randn(1, 16, 4, 4, generator=g), torch.randn(1, 16, 4, 4, generator=g)
    prompt, pooled, face = torch.randn(1, 6, 32, generator=g), torch.randn(1, 32, generator=g), \
        torch.randn(1, 1, 512, generator=g)
    t, guidance, id_guidance = torch.tensor([800.0]), torch.tensor([3.5]), torch.tensor([1.5])
    ours = model_fn_flux(dit, latents, t, prompt, pooled, guidance, controlnet=infusenet,
                                  controlnet_conditioning=cond, image_proj_model=projector,
                                  infinityou_face_embeds=face, infinityou_guidance=id_guidance)
    tokens, img_ids = pack_latents(latents), image_ids(2, 2, "cpu", torch.float32)
    id_tokens = projector(face)
    samples, single = infusenet(hidden_states=tokens, controlnet_cond=pack_latents(cond), timestep=t / 1000,
                                guidance=id_guidance, pooled_projections=pooled, encoder_hidden_states=id_tokens,
                                txt_ids=torch.zeros(id_tokens.shape[1], 3), img_ids=img_ids, return_dict=False)
    ref = dit(hidden_states=tokens, timestep=t / 1000, guidance=guidance, pooled_projections=pooled,
              encoder_hidden_states=prompt, txt_ids=torch.zeros(6, 3), img_ids=img_ids,
              controlnet_block_samples=samples, controlnet_single_block_samples=single, return_dict=False)[0]
    assert (pack_latents(ours) - ref).abs().max() <= 1e-5
    other = model_fn_flux(dit, latents, t, prompt, pooled, guidance, controlnet=infusenet,
                                   controlnet_conditioning=cond, image_proj_model=projector,
                                   infinityou_face_embeds=-face, infinityou_guidance=id_guidance)
    assert (other - ours).abs().max() > 1e-4  # the face changes the prediction


def test_face_embedding_unit(flux_models):
    face = Image.new("RGB", (16, 16), (200, 150, 120))

    def embedder(image):
        return torch.full((512,), float(image.getpixel((0, 0))[0]) / 255)

    out = run_unit_on(FluxInfiniteYouEmbedder(), {"face_embedder": embedder}, infinityou_id_image=face,
                      infinityou_guidance=2.0, batch_size=2)
    assert out["infinityou_face_embeds"].shape == (2, 1, 512) and out["infinityou_guidance"].tolist() == [2.0, 2.0]
    with pytest.raises(UserError) as e:
        run_unit_on(FluxInfiniteYouEmbedder(), {}, infinityou_id_image=face)
    assert "insightface" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("prefix", ["image_proj_model.", "pipe.image_proj_model.", ""])
def test_a_fully_trained_projector_is_recognised_in_diffusers_names(projector, tmp_path, prefix):
    """Full training saves the projector as `pipe.image_proj_model.<diffusers' name>` less --remove_prefix_in_ckpt
    (the reference's script removes `pipe.`): that file loads back as the projector it was (issue 36)."""
    from safetensors.torch import save_file

    from difftune.models.detect import detect_component

    state = {prefix + k: v.clone() for k, v in projector.state_dict().items()}
    assert any(".attn.to_k." in k for k in state)  # diffusers' names, to_kv split
    save_file(state, str(tmp_path / "epoch-0.safetensors"))
    spec = with_config(IMAGE_PROJ_MODEL, tiny_image_proj_config())
    assert detect_component(str(tmp_path / "epoch-0.safetensors"), [spec]).name == "image_proj_model"
    loaded = load_component(str(tmp_path / "epoch-0.safetensors"), [spec], torch_dtype=torch.float32).module
    for k, v in projector.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
