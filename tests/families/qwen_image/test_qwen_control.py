"""Qwen-Image In-Context control, EliGen and the Blockwise ControlNet (issue 13, item 4): each follows the
reference's definition, changes the output, and splits into stage 1 / stage 2 like one-stage training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import difftune.models as models_pkg
from conftest import run_train
from difftune.core.family import get_family
from difftune.core.latents import pack_latents
from difftune.errors import UserError
from difftune.families.qwen_image.controlnet import QwenImageBlockwiseMultiControlNet
from difftune.families.qwen_image.eligen import (entity_attention_mask, entity_sequence, segment_freqs,
                                                 use_masked_attention)
from difftune.families.qwen_image.forward import transformer_forward
from difftune.models import ModelConfig
from difftune.parts.eligen import entity_token_masks
from support import (TinyQwenImageSpec, tiny_qwen_image_paths, tiny_qwen_transformer,
                              write_control_dataset, write_tiny_blockwise_controlnet, write_tiny_qwen_image)
from difftune.training.config import TaskSpec

FAMILY = get_family("qwen_image")
SIZE = (48, 32)  # width, height of the tiny data sets: 3 x 2 tokens


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny Qwen-Image, a tiny Canny-style and Inpaint-style Blockwise ControlNet, and one data set per feature."""
    root = tmp_path_factory.mktemp("qwen_control")
    write_tiny_qwen_image(root / "repo")
    paths = tiny_qwen_image_paths(root / "repo")
    ws = {"base": [paths["transformer"], paths["text_encoder"], paths["vae"][0]], "root": root,
          "controlnet": str(write_tiny_blockwise_controlnet(root / "Qwen-Image-Blockwise-ControlNet-Canny")),
          "inpaint": str(write_tiny_blockwise_controlnet(root / "Qwen-Image-Blockwise-ControlNet-Inpaint",
                                                         inpaint=True))}
    for kind in ("context", "controlnet", "inpaint", "eligen"):
        # EliGen: 1, 2 and 1 entities, prompts of different lengths (stage 1 encodes rows 1 and 3 as one batch)
        ws[f"data_{kind}"] = write_control_dataset(root / f"data_{kind}", kind, size=SIZE, n=3 if kind == "eligen" else 2)
    return ws


def _pipe(ws, *extra_models):
    from difftune.families.qwen_image import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(torch_dtype=torch.float32, model_configs=[
        ModelConfig(p) for p in [*ws["base"], *extra_models]], tokenizer_config=str(ws["root"] / "repo" / "tokenizer"))


def _values(pipe, ws, kind):
    from difftune.data import UnifiedDataset

    meta = ws[f"data_{kind}"]
    keys = {"context": "image,context_image", "controlnet": "image,blockwise_controlnet_image",
            "inpaint": "image,blockwise_controlnet_image,blockwise_controlnet_inpaint_mask",
            "eligen": "image,eligen_entity_masks"}[kind]
    data = UnifiedDataset(base_path=meta.parent, metadata_path=meta, data_file_keys=keys.split(","),
                          extra_inputs=["eligen_entity_prompts"] if kind == "eligen" else ())
    pipe.scheduler.set_training()
    out = []
    for i in range(len(data)):
        values = pipe.training_inputs(data[i])
        pipe.run_units(values)
        out.append(values)
    return out


def _predict(pipe, values, **override):
    kwargs = {**pipe.model_fn_kwargs(values), **override}
    torch.manual_seed(0)
    latents = torch.randn_like(values["input_latents"])
    with torch.no_grad():
        return pipe.model_fn(latents=latents, timestep=torch.tensor([500.0]), **kwargs)


def _flags(models, meta, kind, *more):
    keys = {"context": ("image,context_image", "context_image"),
            "controlnet": ("image,blockwise_controlnet_image", "blockwise_controlnet_image"),
            "eligen": ("image,eligen_entity_masks", "eligen_entity_masks,eligen_entity_prompts")}[kind]
    return ["--model_paths", json.dumps(models), "--dataset_metadata_path", meta, "--data_file_keys", keys[0],
            "--extra_inputs", keys[1], "--torch_dtype", "float32", "--max_pixels", 4096, "--learning_rate", 1e-3,
            "--num_epochs", 1, "--dataset_repeat", 2, "--seed", 3, "--no_progress", *more]


def _one_stage_and_split(root, flags, data_root):
    run_train("--task", "sft", "--dataset_base_path", data_root, "--output_path", root / "one", *flags)
    run_train("--task", "sft:data_process", "--dataset_base_path", data_root, "--output_path", root / "cache", *flags)
    flags = list(flags)
    i = flags.index("--dataset_metadata_path")
    del flags[i:i + 2]
    run_train("--task", "sft:train", "--dataset_base_path", root / "cache", "--output_path", root / "two", *flags)
    a, b = load_file(str(root / "one" / "epoch-0.safetensors")), load_file(str(root / "two" / "epoch-0.safetensors"))
    assert a.keys() == b.keys() and a
    return a, b, max((a[k] - b[k]).abs().max().item() for k in a)


# -- the transformer pass the extensions use ----------------------------------------------------------------

@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_block_by_block_forward_equals_diffusers_forward(zero_cond_t):
    """transformer_forward (with its full-mask attention too) computes what QwenImageTransformer2DModel does."""
    dit = tiny_qwen_transformer(TinyQwenImageSpec(zero_cond_t=zero_cond_t)).eval()
    torch.manual_seed(1)
    tokens = torch.randn(2, 6 + 6, 64)  # noisy 2x3 tokens + one condition image of the same size
    text = torch.randn(2, 5, 32)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    shapes = [[(1, 2, 3), (1, 2, 3)]] * 2
    t = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        want = dit(hidden_states=tokens, timestep=t, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                   img_shapes=shapes, return_dict=False)[0]
        got = transformer_forward(dit, tokens, t, text, mask, shapes)
        use_masked_attention(dit)  # a full mask that says what the padding mask says
        keys = torch.cat([mask.bool(), torch.ones(2, 12, dtype=torch.bool)], 1)
        full = keys[:, None, None, :].expand(2, 1, 17, 17) | torch.eye(17, dtype=torch.bool)
        masked = transformer_forward(dit, tokens, t, text, mask, shapes, attention_mask=full)
    assert (got - want).abs().max() < 1e-6
    assert (masked - want).abs().max() < 1e-5


# -- EliGen ---------------------------------------------------------------------------------------------------

def _reference_eligen_mask(masks, seq_lens, height, width):
    """The reference's definition (DiffSynth-Studio QwenImageDiT.process_entity_masks and the EntityControl
    unit), written out step by step for one sample: masks at latent size, 16 channels, 2x2 patches."""
    patched = []
    for m in masks:
        small = np.asarray(m.convert("RGB").resize((width // 8, height // 8), resample=Image.NEAREST), np.float32)
        lat = torch.from_numpy(small / 255 * 2 - 1).permute(2, 0, 1).mean(0, keepdim=True) > 0  # (1, h, w)
        lat = lat.repeat(16, 1, 1).float()
        c, h, w = lat.shape
        patched.append(lat.view(c, h // 2, 2, w // 2, 2).permute(1, 3, 0, 2, 4).reshape(h // 2 * w // 2, -1))
    patched.append(torch.ones_like(patched[0]))  # the prompt: the whole image
    image = patched[0].shape[0]
    total = sum(seq_lens) + image
    mask = torch.ones(total, total, dtype=torch.bool)
    cum = np.cumsum([0, *seq_lens])
    for i, p in enumerate(patched):
        region = (p.sum(-1) > 0)[None].repeat(seq_lens[i], 1)
        mask[cum[i]:cum[i + 1], sum(seq_lens):] = region
        mask[sum(seq_lens):, cum[i]:cum[i + 1]] = region.T
    for i in range(len(patched)):
        for j in range(len(patched)):
            if i != j:
                mask[cum[i]:cum[i + 1], cum[j]:cum[j + 1]] = False
    return mask


def test_eligen_attention_mask_is_the_reference_definition():
    height, width = 64, 96  # 4 x 6 tokens
    masks = []
    for box in [(0, 0, 40, 63), (30, 20, 95, 50)]:
        m = Image.new("RGB", (width, height))
        m.paste((255, 255, 255), box)
        masks.append(m)
    lengths, prompt_len, dim = [3, 5], 4, 8
    token_masks = entity_token_masks(masks, height, width, vae_scale=8)
    assert token_masks.shape == (2, 24) and 0 < token_masks[0].sum() < 24 and 0 < token_masks[1].sum() < 24
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    entity = torch.randn(1, sum(lengths), dim)
    prompt = torch.randn(1, prompt_len, dim)
    text, valid, segment, position, regions = entity_sequence(
        prompt, torch.ones(1, prompt_len), entity, torch.ones(1, sum(lengths)), ids, token_masks[None],
        torch.ones(1, 2))
    got = entity_attention_mask(valid, segment, regions, image_len=24)[0, 0]
    want = _reference_eligen_mask(masks, [*lengths, prompt_len], height, width)
    assert torch.equal(got, want)
    assert torch.equal(text[0], torch.cat([entity[0], prompt[0]]))
    # each segment's RoPE positions start again, as each entity prompt's own pos_embed call gives them
    dit = tiny_qwen_transformer(TinyQwenImageSpec())
    shapes = [[(1, 4, 6)]]
    freqs = segment_freqs(dit, shapes, position, "cpu")
    per_segment = [dit.pos_embed(shapes, max_txt_seq_len=n, device="cpu")[1] for n in [*lengths, prompt_len]]
    assert torch.equal(freqs, torch.cat(per_segment))


def test_eligen_inputs_change_the_output_and_batch_like_single_samples(ws):
    pipe = _pipe(ws)
    samples = _values(pipe, ws, "eligen")[:2]  # one entity, then two
    assert samples[0]["entity_masks"].shape == (1, 1, 6) and samples[1]["entity_masks"].shape == (1, 2, 6)
    plain = _predict(pipe, samples[1], entity_prompt_embeds=None)
    with_entities = _predict(pipe, samples[1])
    assert (with_entities - plain).abs().max() > 1e-3
    # a batch of both (different entity counts and prompt lengths: padded) predicts what each does alone
    from difftune.core.batch import collate_values, split_batch

    per = [split_batch(v, 1, pipe.batching, pipe.model_fn_kwargs(v).keys() | {"input_latents"})[0] for v in samples]
    batch = collate_values(per, pipe.batching)
    torch.manual_seed(0)
    latents = torch.randn_like(batch["input_latents"])
    with torch.no_grad():
        together = pipe.model_fn(latents=latents, timestep=torch.tensor([500.0, 500.0]), **pipe.model_fn_kwargs(batch))
        alone = [pipe.model_fn(latents=latents[i:i + 1], timestep=torch.tensor([500.0]),
                               **pipe.model_fn_kwargs(collate_values([per[i]], pipe.batching))) for i in range(2)]
    assert (together - torch.cat(alone)).abs().max() < 1e-5


def control_training_inputs(data):
    """The control features' columns of a training row, as each feature reads them."""
    from difftune.families.qwen_image.context import CONTEXT
    from difftune.families.qwen_image.controlnet import BLOCKWISE
    from difftune.families.qwen_image.eligen import ELIGEN

    out = {}
    for feature in (CONTEXT, ELIGEN, BLOCKWISE):
        out.update(feature.row_values(None, data, {}))
    return out


def test_eligen_rows_must_pair_prompts_with_masks():

    mask = Image.new("RGB", (16, 16))
    with pytest.raises(UserError, match="row 3: eligen_entity_masks without its other half"):
        control_training_inputs({"_row": 2, "eligen_entity_masks": [mask]})
    with pytest.raises(UserError, match="row 1: eligen_entity_prompts must be a list of strings"):
        control_training_inputs({"_row": 0, "eligen_entity_prompts": [1, 2], "eligen_entity_masks": [mask, mask]})
    # columns no flag names stay file names and are not used (the reference passes only --extra_inputs)
    assert control_training_inputs({"eligen_entity_prompts": ["a"], "eligen_entity_masks": ["m.png"],
                                    "context_image": "c.png"}) == dict.fromkeys(
        ["context_image", "eligen_entity_prompts", "eligen_entity_masks", "blockwise_controlnet_image",
         "blockwise_controlnet_inpaint_mask"])


# -- In-Context control ---------------------------------------------------------------------------------------

def test_context_tokens_follow_the_noisy_ones_and_only_those_are_predicted(ws):
    pipe = _pipe(ws)
    values = _values(pipe, ws, "context")[0]
    context = values["context_latents"]
    assert context.shape == values["input_latents"].shape == (1, 16, 4, 6)
    pred = _predict(pipe, values)
    assert pred.shape == values["input_latents"].shape  # the loss compares the noisy latents' prediction only
    plain = _predict(pipe, values, context_latents=None)
    assert (pred - plain).abs().max() > 1e-3
    # the reference's definition: [noisy tokens, context tokens], the context as a second RoPE frame
    torch.manual_seed(0)
    latents = torch.randn_like(values["input_latents"])
    with torch.no_grad():
        out = pipe.dit(hidden_states=torch.cat([pack_latents(latents), pack_latents(context)], 1),
                       timestep=torch.tensor([0.5]), encoder_hidden_states=values["prompt_embeds"],
                       encoder_hidden_states_mask=values["prompt_embeds_mask"], img_shapes=[[(1, 2, 3), (1, 2, 3)]],
                       return_dict=False)[0]
    assert (pack_latents(pred) - out[:, :6]).abs().max() < 1e-6


# -- Blockwise ControlNet -------------------------------------------------------------------------------------

def test_controlnet_residuals(ws, tmp_path):
    zero = str(write_tiny_blockwise_controlnet(tmp_path / "zero", zero_init=True))
    pipe = _pipe(ws, zero)
    values = _values(pipe, ws, "controlnet")[0]
    assert values["blockwise_controlnet_conditioning"].shape == (1, 16, 4, 6)
    base = _predict(pipe, values, blockwise_controlnet_conditioning=None)
    pipe.models["blockwise_controlnet"] = None
    assert torch.equal(base, _predict(pipe, values, blockwise_controlnet_conditioning=None))  # plain DiT
    pipe.models["blockwise_controlnet"] = models_pkg.load_component(zero, FAMILY.components,
                                                                    torch_dtype=torch.float32).module
    assert (_predict(pipe, values) - base).abs().max() < 1e-6  # zero-initialised: no change
    net = pipe.blockwise_controlnet.net
    torch.manual_seed(4)
    with torch.no_grad():  # perturb the zero projections (the training start): the output changes
        for linear in (net.img_in, *(b.output_proj for b in net.controlnet_blocks)):
            linear.weight.normal_(std=0.2)
    assert (_predict(pipe, values) - base).abs().max() > 1e-3
    # one block's residual is the reference's formula
    x, y = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    block = net.controlnet_blocks[0]

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    want = block.output_proj(torch.nn.functional.gelu(block.input_proj(rms(x, block.x_rms.weight) +
                                                                       rms(y, block.y_rms.weight))))
    assert torch.allclose(pipe.blockwise_controlnet.residual(0, x, y), want, atol=1e-6)


def test_inpaint_controlnet_conditioning_carries_the_mask(ws):
    pipe = _pipe(ws, ws["inpaint"])
    values = _values(pipe, ws, "inpaint")[0]
    cond = values["blockwise_controlnet_conditioning"]
    assert cond.shape == (1, 17, 4, 6)
    # the mask file is white on the right half: 0 there (to fill), 1 on the left (kept)
    assert torch.equal(cond[0, 16], torch.tensor([[1.0, 1, 1, 0, 0, 0]] * 4))
    assert pipe.blockwise_controlnet.condition(cond).shape == (1, 6, 32)
    with pytest.raises(UserError, match="inpaint mask"):
        pipe.blockwise_controlnet.condition(cond[:, :16])


def test_controlnet_file_is_recognised_and_round_trips(ws, tmp_path):
    """The released layout loads into the slot; full training saves it back in that layout, which loads again."""
    from difftune.core.family import recognise

    spec, found = recognise([ModelConfig(ws["controlnet"])], None, log=lambda *a: None)
    assert (spec.name, found[0][0]) == ("qwen_image", "blockwise_controlnet")
    released = load_file(ws["controlnet"])
    run_train("--task", "sft", "--dataset_base_path", ws["data_controlnet"].parent, "--output_path", tmp_path / "out",
              "--trainable_models", "blockwise_controlnet", "--remove_prefix_in_ckpt",
              "pipe.blockwise_controlnet.models.0.", "--max_steps", 1,
              *_flags([*ws["base"], ws["controlnet"]], ws["data_controlnet"], "controlnet"))
    trained_path = tmp_path / "out" / "step-1.safetensors"
    if not trained_path.exists():
        trained_path = next((tmp_path / "out").glob("*.safetensors"))
    trained = load_file(str(trained_path))
    assert {k: v.shape for k, v in trained.items()} == {k: v.shape for k, v in released.items()}
    assert any(not torch.equal(trained[k], released[k]) for k in released)  # it trained
    loaded = models_pkg.load_component(ModelConfig(str(trained_path)), FAMILY.components, torch_dtype=torch.float32)
    assert isinstance(loaded.module, QwenImageBlockwiseMultiControlNet)
    state = loaded.module.state_dict()
    assert all(torch.equal(state["models.0." + k], v) for k, v in trained.items())
    # --resume_from_checkpoint with the reference's prefix puts it back in the same place
    from difftune.training.builders import load_full_weights

    pipe = _pipe(ws, ws["controlnet"])
    load_full_weights(pipe, str(trained_path), "pipe.blockwise_controlnet.models.0.")
    assert all(torch.equal(pipe.blockwise_controlnet.state_dict()["models.0." + k], v) for k, v in trained.items())


def test_controlnet_loaded_without_control_images_is_refused(ws, tmp_path):
    with pytest.raises(UserError, match="no blockwise_controlnet_image"):
        run_train("--task", "sft", "--dataset_base_path", ws["data_context"].parent, "--output_path", tmp_path / "o",
                  "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--max_steps", 1,
                  *_flags([*ws["base"], ws["controlnet"]], ws["data_context"], "context"))


# -- the split ------------------------------------------------------------------------------------------------

def test_split_of_a_trainable_controlnet(ws):
    from conftest import setup_run

    split = setup_run("--trainable_models", "blockwise_controlnet", "--dataset_base_path", ws["data_controlnet"].parent,
                      *_flags([*ws["base"], ws["controlnet"]], ws["data_controlnet"], "controlnet")).split
    assert "QwenImageBlockwiseControlNetEmbedder" in [u.name for u in split.stage1]
    assert split.stage2 == ()
    assert "blockwise_controlnet_conditioning" in split.frontier
    assert split.stage2_models == ("blockwise_controlnet", "dit")  # no VAE, no text encoder


@pytest.mark.slow
def test_split_equals_one_stage_for_a_trainable_controlnet(ws, tmp_path, monkeypatch):
    built = []
    real = models_pkg.load_component

    def record(config, *a, **k):
        built.append(real(config, *a, **k))
        return built[-1]

    flags = ["--trainable_models", "blockwise_controlnet", "--remove_prefix_in_ckpt",
             "pipe.blockwise_controlnet.models.0.", "--use_gradient_checkpointing",
             *_flags([*ws["base"], ws["controlnet"]], ws["data_controlnet"], "controlnet")]
    monkeypatch.setattr(models_pkg, "load_component", record)
    run_train("--task", "sft:data_process", "--dataset_base_path", ws["data_controlnet"].parent, "--output_path",
              tmp_path / "probe", *flags)
    assert sorted(c.name for c in built) == ["text_encoder", "vae"]  # stage 1 needs no ControlNet, no DiT
    built.clear()
    _, _, diff = _one_stage_and_split(tmp_path, flags, ws["data_controlnet"].parent)
    assert diff <= 1e-5
    assert sorted(c.name for c in built[-2:]) == ["blockwise_controlnet", "dit"]  # stage 2: no VAE / text encoder


@pytest.mark.slow
@pytest.mark.parametrize("lora", [("dit", "to_q,to_k,add_k_proj,to_out.0"), ("text_encoder", "q_proj,v_proj")])
def test_split_equals_one_stage_for_an_eligen_lora(ws, tmp_path, lora):
    """A DiT LoRA caches the entity embeddings; a text-encoder LoRA moves the entity encoding to stage 2, which
    then reads the cached entity prompts and mask images."""
    flags = ["--lora_base_model", lora[0], "--lora_target_modules", lora[1], "--lora_rank", 4,
             "--use_gradient_checkpointing",
             *_flags(ws["base"], ws["data_eligen"], "eligen")]
    _, _, diff = _one_stage_and_split(tmp_path, flags, ws["data_eligen"].parent)
    assert diff <= 1e-5


@pytest.mark.slow
def test_eligen_and_context_change_what_a_lora_learns(ws, tmp_path):
    """The trained LoRA differs with and without the feature's inputs (they were dropped before)."""
    for kind in ("eligen", "context"):
        lora = ["--lora_base_model", "dit", "--lora_target_modules", "to_q,to_k,add_k_proj", "--lora_rank", 4,
                "--max_steps", 2]
        run_train("--task", "sft", "--dataset_base_path", ws[f"data_{kind}"].parent, "--output_path",
                  tmp_path / kind, *lora, *_flags(ws["base"], ws[f"data_{kind}"], kind))
        plain = _flags(ws["base"], ws[f"data_{kind}"], kind)
        plain[plain.index("--extra_inputs") + 1] = ""
        plain[plain.index("--data_file_keys") + 1] = "image"
        run_train("--task", "sft", "--dataset_base_path", ws[f"data_{kind}"].parent, "--output_path",
                  tmp_path / f"{kind}_plain", *lora, *plain)
        a = load_file(str(next((tmp_path / kind).glob("*.safetensors"))))
        b = load_file(str(next((tmp_path / f"{kind}_plain").glob("*.safetensors"))))
        assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-6, kind


def test_inference_takes_the_control_inputs(ws):
    """Sampling with each control (classifier-free guidance on, units under the enforcing runner) changes the
    image; EliGen on the negative side changes it again."""
    pipe = _pipe(ws, ws["controlnet"])
    pipe.scheduler.training = False
    w, h = SIZE
    entity = Image.new("RGB", SIZE)
    entity.paste((255, 255, 255), (0, 0, w // 2, h))
    control = Image.new("RGB", SIZE, (200, 200, 200))

    def sample(**kw):
        return pipe("a red circle", negative_prompt="blurry", cfg_scale=2.0, height=h, width=w, num_inference_steps=2,
                    seed=0, progress=False, output_type="latent", **kw)

    plain = sample()
    outs = {"context": sample(context_image=control), "controlnet": sample(blockwise_controlnet_image=control),
            "eligen": sample(eligen_entity_prompts=["a red circle"], eligen_entity_masks=[entity]),
            "eligen_negative": sample(eligen_entity_prompts=["a red circle"], eligen_entity_masks=[entity],
                                      eligen_enable_on_negative=True)}
    for name, out in outs.items():
        assert out.shape == plain.shape and (out - plain).abs().max() > 1e-4, name
    assert (outs["eligen"] - outs["eligen_negative"]).abs().max() > 1e-5
    from difftune.families.qwen_image import ControlNetInput

    # the reference's way of passing the control image gives the same
    assert torch.equal(sample(blockwise_controlnet_inputs=[ControlNetInput(image=control)]), outs["controlnet"])
    with pytest.raises(UserError, match="scale 1"):
        sample(blockwise_controlnet_inputs=[ControlNetInput(image=control, scale=0.5)])


@pytest.mark.slow
def test_a_lora_on_the_controlnet_trains_and_splits(ws, tmp_path):
    flags = ["--lora_base_model", "blockwise_controlnet", "--lora_target_modules", "img_in,input_proj,output_proj",
             "--lora_rank", 4, *_flags([*ws["base"], ws["controlnet"]], ws["data_controlnet"], "controlnet")]
    one, _, diff = _one_stage_and_split(tmp_path, flags, ws["data_controlnet"].parent)
    assert diff <= 1e-5
    assert all(k.startswith("blockwise_controlnet.models.0.") for k in one)
    assert any(v.abs().max() > 0 for k, v in one.items() if ".lora_B." in k)


def test_eligen_prompt_and_mask_counts_are_checked_up_front_naming_the_row(tmp_path):
    from difftune.data import DataError, UnifiedDataset
    from difftune.families.qwen_image.pipeline import QwenImagePipeline

    meta = write_control_dataset(tmp_path, "eligen", n=2)
    rows = json.loads(meta.read_text())
    rows[1]["eligen_entity_prompts"] = rows[1]["eligen_entity_prompts"] + ["a third entity"]
    meta.write_text(json.dumps(rows))
    with pytest.raises(DataError) as err:
        UnifiedDataset(tmp_path, meta, data_file_keys=("image", "eligen_entity_masks"),
                       extra_inputs=("eligen_entity_prompts", "eligen_entity_masks"),
                       paired_columns=QwenImagePipeline.paired_columns())
    assert f"{meta} row 2" in str(err.value) and "'eligen_entity_prompts' has 3 entries" in str(err.value)
    assert "'eligen_entity_masks' 2" in str(err.value)


def test_an_eligen_mask_of_any_size_is_taken(tmp_path):
    from difftune.data import UnifiedDataset
    from difftune.families.qwen_image.pipeline import QwenImagePipeline

    meta = write_control_dataset(tmp_path, "eligen", n=1)
    rows = json.loads(meta.read_text())
    Image.new("RGB", (10, 90), (255, 255, 255)).save(tmp_path / "thin.png")
    rows[0]["eligen_entity_masks"][0] = "thin.png"
    meta.write_text(json.dumps(rows))
    run_config = type("C", (), {"dataset_base_path": str(tmp_path), "height": None, "width": None,
                                "max_pixels": 4096})
    ops = QwenImagePipeline.data_operators(run_config)
    data = UnifiedDataset(tmp_path, meta, data_file_keys=("image", "eligen_entity_masks"),
                          extra_inputs=("eligen_entity_prompts", "eligen_entity_masks"), special_operator_map=ops,
                          main_data_operator=UnifiedDataset.default_image_operator(tmp_path, max_pixels=4096))
    assert data[0]["eligen_entity_masks"][0].size == (10, 90)  # whole: the unit resizes it to the latent grid
    assert entity_token_masks(data[0]["eligen_entity_masks"], 32, 48, vae_scale=8).shape == (1, 2 * 3)
