"""Wan2.2-Animate-2: the released file recognised from its header and converted both ways, the reference's module
names mapped, the dense in-context attention equal to diffusers' flex-attention path (so it trains on the CPU), and
the units' values against the reference's formulas (fp32, tiny)."""

import pytest
import torch
from PIL import Image

from difftune.core.units import run_unit
from difftune.families.wan.animate2.keys import (ANIMATE2_CONFIG, ANIMATE2_LORA_TARGETS, ANIMATE2_ORIGINAL,
                                                 animate2_from_original, animate2_module_name, animate2_to_original)
from difftune.families.wan.animate2.model import animate2_forward
from difftune.families.wan.animate2.units import (WanAnimate2CLIPEmbedder, WanAnimate2InputVideoEmbedder,
                                                  WanAnimate2NoiseInitializer, WanAnimate2PromptEmbedder,
                                                  WanAnimate2VAEEmbedder)
from difftune.families.wan.components import DIT_ORIGINAL
from difftune.families.wan.pipeline import WanVideoPipeline
from support.wan.animate2 import tiny_animate2_transformer
from difftune.families.wan.units import WanImageEmbedderCLIP, WanPromptEmbedder, vae_encode, video_tensor
from difftune.models.detect import match_header


def test_official_header_is_recognised_and_names_convert_both_ways():
    header = animate2_to_original(ANIMATE2_ORIGINAL.signature(ANIMATE2_CONFIG))
    assert header["blocks.39.block.self_attn.q.weight"] == (5120, 5120)
    assert header["blocks.0.block.cross_attn.k_img.weight"] == (5120, 5120) and header["img_emb.proj.1.weight"] == (
        1280, 1280)
    assert match_header(header, [DIT_ORIGINAL]) is None
    match = match_header(header, [DIT_ORIGINAL, ANIMATE2_ORIGINAL])
    assert match.spec is ANIMATE2_ORIGINAL and match.label == "Wan2.2-Animate-2-14B (and -Distilled)"
    state = tiny_animate2_transformer().state_dict()
    original = animate2_to_original(state)
    back = animate2_from_original(original)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_reference_module_names_map_to_ours():
    assert animate2_module_name("dit.blocks.12.block.self_attn.q") == "dit.blocks.12.self_attn.to_q"
    assert animate2_module_name("blocks.0.block.cross_attn.o") == "blocks.0.cross_attn.to_out.0"
    assert animate2_module_name("blocks.3.block.ffn.0") == "blocks.3.ffn.0"
    modules = dict(tiny_animate2_transformer().named_modules())
    for name in ("blocks.9.block.self_attn.q", "blocks.9.block.self_attn.k", "blocks.9.block.self_attn.v",
                 "blocks.1.block.cross_attn.k_img"):
        assert animate2_module_name(name) in modules
    assert ANIMATE2_LORA_TARGETS["self_attn.q"] == "self_attn.to_q"


def _inputs(seed=0, frames=3, ref_frames=2):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(latents=r(1, 16, frames, 4, 6), timestep=torch.tensor([640.0]), prompt_embeds=r(1, 512, 32),
                image_embeds=r(1, 257, 1280), condition=r(1, 20, frames, 4, 6),
                animate2_condition_latents=r(1, 16, ref_frames, 4, 6), animate2_condition_y=r(1, 20, ref_frames, 4, 6),
                animate2_prompt_embeds=r(1, 512, 32), animate2_reference_image_embeds=r(1, 257, 1280))


@pytest.fixture()
def uncompiled_block_mask(monkeypatch):
    """diffusers compiles its block mask (minutes on a CPU); the same mask uncompiled, for the comparison."""
    import diffusers.models.transformers.transformer_wan_animate_2 as module

    real = module.create_block_mask
    monkeypatch.setattr(module, "create_block_mask", lambda *a, **k: real(*a, **{**k, "_compile": False}))


@pytest.mark.parametrize("unconditional", [False, True])
def test_dense_in_context_attention_equals_diffusers_flex_path(uncompiled_block_mask, unconditional):
    dit = tiny_animate2_transformer()
    values = _inputs()
    with torch.no_grad():
        flex = animate2_forward(dit, **values, unconditional=unconditional, dense=False)
        dense = animate2_forward(dit, **values, unconditional=unconditional, dense=True)
    assert flex.shape == dense.shape == (1, 16, 3, 4, 6)
    assert (dense - flex).abs().max() <= 1e-5
    # the reference video matters, and the unguided pass differs (block 9 skipped)
    other = dict(values, animate2_condition_latents=values["animate2_condition_latents"] + 1)
    with torch.no_grad():
        assert (animate2_forward(dit, **other, unconditional=unconditional) - dense).abs().max() > 1e-4
        assert (animate2_forward(dit, **values, unconditional=not unconditional) - dense).abs().max() > 1e-4


def test_dense_path_trains():
    dit = tiny_animate2_transformer()
    out = animate2_forward(dit, **_inputs(1))
    out.square().mean().backward()
    for name in ("blocks.0.self_attn.to_q.weight", "blocks.5.self_attn.to_k.weight", "patch_embedding.weight"):
        assert dit.get_parameter(name).grad.abs().sum() > 0


# -- units ----------------------------------------------------------------------------------------------------
def _pipe():
    from diffusers import AutoencoderKLWan
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from support.tokenizers import t5_tokenizer as flux_t5_tokenizer

    torch.manual_seed(4)
    pipe = WanVideoPipeline(torch_dtype=torch.float32)
    pipe.vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True]).eval()
    pipe.image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                                          num_attention_heads=2, image_size=32, patch_size=8)).eval()
    pipe.tokenizer = flux_t5_tokenizer()
    pipe.text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(pipe.tokenizer), d_model=32, d_kv=8, d_ff=37,
                                                    num_layers=1, num_heads=4)).eval()
    return pipe


def _clip(n, seed, size=(48, 32)):
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).byte().numpy()) for _ in range(n)]


def test_units_follow_the_reference():
    pipe = _pipe()
    image, video, clip = _clip(1, 1)[0], _clip(9, 2), _clip(5, 3)
    values = {"animate2_reference_image": image, "animate2_reference_video": video, "animate2_refert_images": None,
              "animate2_prompt_ref": None, "num_frames": 5, "height": 32, "width": 48, "batch_size": 1, "seed": 0,
              "rand_device": "cpu", "input_video": clip}
    pipe.scheduler.set_training()
    torch.set_grad_enabled(False)
    for unit in (WanAnimate2NoiseInitializer(), WanAnimate2InputVideoEmbedder(), WanAnimate2PromptEmbedder(),
                 WanAnimate2CLIPEmbedder(), WanAnimate2VAEEmbedder()):
        run_unit(pipe, unit, values)
    enc = lambda frames: vae_encode(pipe, video_tensor(frames, 32, 48))  # noqa: E731
    try:
        ref, rest, refvid = enc([image]), vae_encode(pipe, torch.zeros(1, 3, 5, 32, 48)), enc(video[:5])
        assert values["noise"].shape == (1, 16, 3, 4, 6)  # one more latent frame: the reference image's
        assert torch.equal(values["input_latents"], torch.cat([ref, enc(clip)], dim=2))
        condition = values["condition"]
        assert condition.shape == (1, 20, 3, 4, 6)
        assert torch.equal(condition[:, :4, :1], torch.ones(1, 4, 1, 4, 6)) and torch.equal(condition[:, 4:, :1], ref)
        assert torch.equal(condition[:, :4, 1:], torch.zeros(1, 4, 2, 4, 6))
        assert torch.equal(condition[:, 4:, 1:], rest)
        assert torch.equal(values["animate2_condition_latents"], refvid)
        assert torch.equal(values["animate2_condition_y"], torch.cat([torch.ones(1, 4, 2, 4, 6), refvid], dim=1))
        clip_unit = WanImageEmbedderCLIP()
        embed = lambda im: run_unit(pipe, clip_unit, {"input_image": im, "end_image": None, "height": 32,  # noqa
                                                      "width": 48, "batch_size": 1})["image_embeds"]
        assert torch.equal(values["image_embeds"], embed(image))
        assert torch.equal(values["animate2_reference_image_embeds"], embed(video[0]))
        prompt = run_unit(pipe, WanPromptEmbedder(), {"prompt": " "})["prompt_embeds"]
        assert torch.equal(values["animate2_prompt_embeds"], prompt)  # " " when no reference prompt is given
        # a continuation clip: the previous clip's tail frame is known (mask 1 over its latent frame)
        tail = run_unit(pipe, WanAnimate2VAEEmbedder(), dict(values, animate2_refert_images=_clip(1, 4)))["condition"]
        assert torch.equal(tail[0, :4, 1], torch.ones(4, 4, 6)) and torch.equal(tail[0, :4, 2], torch.zeros(4, 4, 6))
        assert not torch.equal(tail[:, 4:, 1:], condition[:, 4:, 1:])
    finally:
        torch.set_grad_enabled(True)
