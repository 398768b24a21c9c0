"""Qwen-Image pipeline: parity with diffusers, unit declarations, batching, prompt template."""

import inspect

import pytest
import torch
from PIL import Image

from difftune.models import ModelConfig
from difftune.core.units import run_unit
from difftune.families.qwen_image import QwenImagePipeline
from difftune.families.qwen_image.model_fn import model_fn_qwen_image
from difftune.families.qwen_image.units import EDIT_PROMPT_TEMPLATE, PROMPT_TEMPLATE, template_drop_count
from support import TinyQwenImageSpec, qwen_tokenizer, tiny_qwen_image_paths, write_tiny_qwen_image


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_qwen_image(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def edit_repo(tmp_path_factory):
    return write_tiny_qwen_image(tmp_path_factory.mktemp("qwen_edit"), edit=True)


def load_pipe(root, dtype=torch.float32, processor=False):
    paths = tiny_qwen_image_paths(root)
    return QwenImagePipeline.from_pretrained(
        torch_dtype=dtype, device="cpu",
        model_configs=[ModelConfig(paths["transformer"]), ModelConfig(paths["text_encoder"]),
                       ModelConfig(paths["vae"][0])],
        tokenizer_config=ModelConfig(str(root / "tokenizer")),
        processor_config=ModelConfig(str(root / "processor")) if processor else None)


@pytest.fixture(scope="module")
def pipe(repo):
    return load_pipe(repo)


@pytest.fixture(scope="module")
def diffusers_pipe(repo):
    from diffusers import QwenImagePipeline as DiffusersQwen

    p = DiffusersQwen.from_pretrained(str(repo), dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_parity_with_diffusers(pipe, diffusers_pipe, cfg):
    """Same seed, prompt embeddings and steps give the same image as diffusers' QwenImagePipeline."""
    ours = pipe(["a red circle on a blue background"], negative_prompt="blurry", cfg_scale=cfg, height=64, width=48,
                num_inference_steps=3, seed=7, progress=False, output_type="pt")
    values = {"prompt": ["a red circle on a blue background"], "negative_prompt": ["blurry"], "edit_image": None}
    run_unit(pipe, pipe.units[-1], values, cfg=True)
    kwargs = dict(prompt_embeds=values["prompt_embeds"], prompt_embeds_mask=values["prompt_embeds_mask"])
    if cfg != 1.0:
        kwargs.update(negative_prompt_embeds=values["negative_prompt_embeds"],
                      negative_prompt_embeds_mask=values["negative_prompt_embeds_mask"])
    theirs = diffusers_pipe(**kwargs, true_cfg_scale=cfg, height=64, width=48, num_inference_steps=3,
                            generator=torch.Generator().manual_seed(7), output_type="pt").images
    assert ours.shape == theirs.shape == (1, 3, 64, 48)
    assert (ours - theirs).abs().max().item() <= 1e-3
    assert ours.std() > 0.01  # not a blank image


def test_prompt_embeddings_match_diffusers_with_computed_drop(pipe, diffusers_pipe):
    diffusers_pipe.prompt_template_encode_start_idx = template_drop_count(pipe.tokenizer, PROMPT_TEMPLATE)
    theirs, their_mask = diffusers_pipe.encode_prompt(["a cat", "a much longer prompt about a dog"], device="cpu")
    values = {"prompt": ["a cat", "a much longer prompt about a dog"], "edit_image": None}
    run_unit(pipe, pipe.units[-1], values)
    assert torch.allclose(values["prompt_embeds"], theirs, atol=1e-6)
    assert torch.equal(values["prompt_embeds_mask"], their_mask.long())


def test_template_drop_is_computed_from_the_tokenizer():
    tok = qwen_tokenizer()  # byte-level: one token per byte of the prefix, specials are single tokens
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    expected = len(prefix.replace("<|im_start|>", "#").replace("<|im_end|>", "#").encode())
    assert template_drop_count(tok, PROMPT_TEMPLATE) == expected
    edit_prefix = EDIT_PROMPT_TEMPLATE.split("<|vision_start|>")[0]
    assert template_drop_count(tok, EDIT_PROMPT_TEMPLATE) == len(
        edit_prefix.replace("<|im_start|>", "#").replace("<|im_end|>", "#").encode())
    # after dropping, the user's prompt is what is left (one token per byte here, plus the closing template)
    ids = tok(PROMPT_TEMPLATE.format("abc"))["input_ids"]
    assert tok.decode(ids[template_drop_count(tok, PROMPT_TEMPLATE):]).startswith("abc<|im_end|>")


def test_batched_prompts_of_different_lengths_match_one_at_a_time(pipe):
    prompts = ["a", "a long prompt with many more tokens than the first one"]
    values = {"prompt": prompts, "edit_image": None}
    run_unit(pipe, pipe.units[-1], values)
    emb, mask = values["prompt_embeds"], values["prompt_embeds_mask"]
    assert mask[0].sum() < mask[1].sum()  # really padded
    torch.manual_seed(0)
    latents = torch.randn(2, 16, 8, 6)
    t = torch.tensor([500.0, 300.0])
    with torch.no_grad():
        batched = model_fn_qwen_image(pipe.dit, latents, t, emb, mask)
        for i in range(2):
            n = int(mask[i].sum())
            single = model_fn_qwen_image(pipe.dit, latents[i:i + 1], t[i:i + 1], emb[i:i + 1, :n], mask[i:i + 1, :n])
            assert (batched[i:i + 1] - single).abs().max().item() < 1e-5


def test_gradient_checkpointing_and_offload_give_the_same_gradients(pipe):
    torch.manual_seed(0)
    latents, emb = torch.randn(1, 16, 4, 4), torch.randn(1, 5, 32)
    mask = torch.ones(1, 5, dtype=torch.long)
    grads = []
    for ckpt, offload in ((False, False), (True, False), (True, True)):
        pipe.dit.zero_grad()
        pipe.dit.requires_grad_(True)
        out = model_fn_qwen_image(pipe.dit, latents, torch.tensor([400.0]), emb, mask,
                                  use_gradient_checkpointing=ckpt, use_gradient_checkpointing_offload=offload)
        out.square().mean().backward()
        grads.append(pipe.dit.img_in.weight.grad.clone())
    pipe.dit.requires_grad_(False)
    pipe.dit.zero_grad()
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def _declared_kwargs(unit):
    return set(unit.inputs) | set(unit.cfg_inputs)


def test_every_unit_reads_and_writes_exactly_what_it_declares(pipe, edit_repo):
    """Each unit's process() takes exactly its declared inputs; on inputs that exercise every branch it
    writes only declared names, and uses only declared models (the runner would raise otherwise)."""
    edit_pipe = load_pipe(edit_repo, processor=True)
    for unit in pipe.units:
        params = set(inspect.signature(unit.process).parameters) - {"pipe"}
        assert params == _declared_kwargs(unit), unit.name
    image = Image.new("RGB", (40, 56), (200, 30, 30))
    for training in (False, True):
        edit_pipe.scheduler.set_timesteps(4, image_seq_len=12, denoising_strength=0.5)
        if training:
            edit_pipe.scheduler.set_training()
        values = {"prompt": ["x"], "negative_prompt": ["y"], "height": 50, "width": 40, "seed": 1,
                  "rand_device": "cpu", "batch_size": 1, "input_image": image, "edit_image": image,
                  "edit_image_auto_resize": True}
        for unit in edit_pipe.units:
            before = dict(values)
            run_unit(edit_pipe, unit, values, cfg=True)
            changed = {k for k in values if k not in before or values[k] is not before[k]}
            assert changed <= set(unit.writes(cfg=True)), (unit.name, changed)
        assert values["height"] == 64 and values["width"] == 48
        assert values["latents"].shape == values["noise"].shape == (1, 16, 8, 6)
        assert values["input_latents"].shape == (1, 16, 8, 6)
        assert values["edit_latents"].shape[:2] == (1, 16)
        assert values["prompt_embeds"].shape[0] == 1 and values["negative_prompt_embeds"].shape[0] == 1
        if training:  # clean latents in training, noised for image-to-image in inference
            assert torch.equal(values["latents"], values["noise"])
        else:
            assert not torch.equal(values["latents"], values["noise"])
    edit_pipe.scheduler.training = False


def test_edit_inference_runs_and_uses_the_edit_image(edit_repo):
    pipe = load_pipe(edit_repo, processor=True)
    a = pipe("make it blue", edit_image=Image.new("RGB", (64, 64), "red"), height=32, width=32,
             num_inference_steps=2, seed=0, cfg_scale=1.0, progress=False, output_type="pt")
    b = pipe("make it blue", edit_image=Image.new("RGB", (64, 64), "green"), height=32, width=32,
             num_inference_steps=2, seed=0, cfg_scale=1.0, progress=False, output_type="pt")
    assert a.shape == (1, 3, 32, 32) and (a - b).abs().max() > 0


def test_noise_is_seeded():
    pipe = QwenImagePipeline()
    unit = pipe.units[1]
    v1 = run_unit(pipe, unit, {"height": 32, "width": 32, "seed": 3, "rand_device": "cpu", "batch_size": 2})
    v2 = run_unit(pipe, unit, {"height": 32, "width": 32, "seed": 3, "rand_device": "cpu", "batch_size": 2})
    assert v1["noise"].shape == (2, 16, 4, 4) and torch.equal(v1["noise"], v2["noise"])


def test_image_to_image_starts_from_the_input(pipe):
    img = Image.new("RGB", (32, 32), (250, 250, 250))
    out = pipe("x", input_image=img, denoising_strength=0.3, height=32, width=32, num_inference_steps=4, seed=0,
               cfg_scale=1.0, progress=False, output_type="pt")
    full = pipe("x", height=32, width=32, num_inference_steps=4, seed=0, cfg_scale=1.0, progress=False,
                output_type="pt")
    assert out.shape == (1, 3, 32, 32) and (out - full).abs().max() > 1e-3


def test_bf16_inference_is_finite(repo):
    """In bfloat16 the latents and the decoded pixels are finite (an all-NaN result would decode to a black image,
    so the tensors are checked, not the picture)."""
    p = load_pipe(repo, dtype=torch.bfloat16)
    call = dict(height=32, width=32, num_inference_steps=2, seed=0, cfg_scale=2.0, progress=False)
    latents = p("a cat", output_type="latent", **call)
    pixels = p("a cat", output_type="pt", **call)
    assert latents.shape == (1, 16, 4, 4) and torch.isfinite(latents).all() and latents.abs().max() > 0
    assert pixels.shape == (1, 3, 32, 32) and torch.isfinite(pixels).all()
    img = p("a cat", **call)
    assert isinstance(img, Image.Image) and img.size == (32, 32)


def test_zero_cond_t_flag_equals_diffusers_own_2511_handling(tmp_path):
    """The flag on a transformer loaded with the Qwen-Image config gives what diffusers computes for a transformer
    whose config says zero_cond_t (Qwen-Image-Edit-2511): edit tokens modulated at t=0."""
    from support import tiny_qwen_transformer

    plain = tiny_qwen_transformer(TinyQwenImageSpec()).eval()
    official = tiny_qwen_transformer(TinyQwenImageSpec(zero_cond_t=True)).eval()  # same weights, 2511's config
    g = torch.Generator().manual_seed(0)
    latents, edit = torch.randn(1, 16, 4, 6, generator=g), torch.randn(1, 16, 4, 4, generator=g)
    emb = torch.randn(1, 5, TinyQwenImageSpec().text_hidden, generator=g)
    kw = dict(latents=latents, timestep=torch.tensor([700.0]), prompt_embeds=emb,
              prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long), edit_latents=edit)
    with torch.no_grad():
        ours = model_fn_qwen_image(plain, **kw, zero_cond_t=True)
        theirs = model_fn_qwen_image(official, **kw)
        without = model_fn_qwen_image(plain, **kw, zero_cond_t=False)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert (ours - without).abs().max() > 1e-3  # it matters
