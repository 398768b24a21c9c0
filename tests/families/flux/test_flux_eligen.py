"""FLUX.1 EliGen: the shared mask helpers (parts/eligen.py, Qwen-Image's too) read the masks as Qwen-Image's own
copies did, the FLUX attention mask equals a step-by-step rewrite of the reference's construct_mask, and entities
reach the denoiser; a row whose prompts and masks do not pair is named before training."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.data.operators import DataError
from difftune.errors import UserError
from difftune.families.flux.eligen import FluxEntityControl, eligen_text_and_mask
from difftune.families.flux.model_fn import model_fn_flux
from support.flux import run_unit_on
from difftune.parts.eligen import entity_token_masks, segment_attention_mask


def _masks(n, size=(48, 32), seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0]), dtype=np.uint8)).convert("RGB")
            for _ in range(n)]


def _latent_grid_tokens(masks, height, width, vae_scale=8):
    """Qwen-Image's own reading of entity masks before they were shared: PIL's nearest resize to the latent grid,
    channels averaged above mid-grey, a 2x2 patch inside when any of its latent pixels is."""
    out = []
    for mask in masks:
        small = mask.convert("RGB").resize((width // vae_scale, height // vae_scale), resample=Image.NEAREST)
        inside = torch.from_numpy(np.asarray(small, dtype=np.float32) / 127.5 - 1.0).mean(dim=-1) > 0
        h, w = inside.shape
        out.append(inside.view(h // 2, 2, w // 2, 2).any(dim=3).any(dim=1).flatten())
    return torch.stack(out).float()


def test_shared_helpers_equal_qwen_image_eligen():
    from difftune.families.qwen_image import eligen as qwen

    masks = _masks(3)
    assert torch.equal(entity_token_masks(masks, 32, 48, vae_scale=8), _latent_grid_tokens(masks, 32, 48))
    g = torch.Generator().manual_seed(0)
    valid = torch.rand(2, 9, generator=g) > 0.3
    segment = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    regions = torch.rand(2, 3, 6, generator=g) > 0.5
    one = segment_attention_mask(valid, segment, regions, 6)
    for image_len in (6, 12):
        assert torch.equal(segment_attention_mask(valid, segment, regions, image_len),
                           qwen.entity_attention_mask(valid, segment, regions, image_len))
    # a second image of the output's size: text sees the same region in each copy
    two = segment_attention_mask(valid, segment, regions, 12)
    assert torch.equal(two[:, 0, :9, 9:], one[:, 0, :9, 9:].repeat(1, 1, 2))
    assert torch.equal(two[:, 0, 9:, :9], one[:, 0, 9:, :9].repeat(1, 2, 1))
    with pytest.raises(UserError, match="not a multiple of the output's 6"):
        qwen.entity_attention_mask(valid, segment, regions, 9)


def _reference_mask(entity_masks, prompt_len, image_len):
    """The reference's FluxDiT.construct_mask (global prompt appended as an all-ones entity), as booleans."""
    n = entity_masks.shape[1] + 1
    masks = torch.cat([entity_masks, torch.ones_like(entity_masks[:, :1])], 1) > 0
    total = n * prompt_len + image_len
    mask = torch.ones(entity_masks.shape[0], total, total, dtype=torch.bool)
    start = n * prompt_len
    for i in range(n):
        rows = slice(i * prompt_len, (i + 1) * prompt_len)
        mask[:, rows, start:] = masks[:, i][:, None, :]
        mask[:, start:, rows] = masks[:, i][:, :, None]
        for j in range(n):
            if i != j:
                mask[:, rows, j * prompt_len:(j + 1) * prompt_len] = False
    return mask


def test_flux_attention_mask_is_the_reference_construct_mask():
    g = torch.Generator().manual_seed(1)
    entity_masks = (torch.rand(2, 2, 6, generator=g) > 0.5).float()
    prompt, entities = torch.randn(2, 4, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g)
    text, mask = eligen_text_and_mask(prompt, entities, entity_masks, 6)
    assert torch.equal(text[:, :4], entities[:, 0]) and torch.equal(text[:, 8:], prompt)
    assert torch.equal(mask[:, 0], _reference_mask(entity_masks, 4, 6))


@torch.no_grad()
def test_entities_are_encoded_and_change_the_prediction(flux_models):
    models = {"text_encoder_2": flux_models["text_encoder_2"], "tokenizer_2": flux_models["tokenizer_2"]}
    masks = [Image.new("RGB", (32, 32), (0, 0, 0)), Image.new("RGB", (32, 32), (0, 0, 0))]
    masks[0].paste((255, 255, 255), (0, 0, 16, 32))
    masks[1].paste((255, 255, 255), (16, 0, 32, 16))
    out = run_unit_on(FluxEntityControl(), models, eligen_entity_prompts=["a red cat", "a blue hat"],
                      eligen_entity_masks=masks, height=32, width=32, batch_size=1)
    assert out["entity_prompt_embeds"].shape == (1, 2, 512, 32)
    assert out["entity_masks"].tolist() == [[[1, 0, 1, 0], [0, 1, 0, 0]]]
    from difftune.families.flux.units import t5_hidden
    from support.flux import UnitPipe
    assert torch.equal(out["entity_prompt_embeds"][0, 1],
                       t5_hidden(UnitPipe(**models), ["a blue hat"])[0])
    dit = flux_models["dit"]
    g = torch.Generator().manual_seed(2)
    latents, pooled = torch.randn(1, 16, 4, 4, generator=g), torch.randn(1, 32, generator=g)
    prompt = torch.randn(1, 512, 32, generator=g)
    args = (dit, latents, torch.tensor([500.0]), prompt, pooled, torch.tensor([1.0]))
    plain = model_fn_flux(*args)
    a = model_fn_flux(*args, entity_prompt_embeds=out["entity_prompt_embeds"],
                               entity_masks=out["entity_masks"])
    swapped = model_fn_flux(*args, entity_prompt_embeds=out["entity_prompt_embeds"],
                                     entity_masks=out["entity_masks"].flip(1))
    assert (a - plain).abs().max() > 1e-4 and (a - swapped).abs().max() > 1e-4
    with pytest.raises(UserError, match="one entity prompt"):
        run_unit_on(FluxEntityControl(), models, eligen_entity_prompts=["one"], eligen_entity_masks=masks,
                    height=32, width=32)


def test_flux_eligen_prompts_and_masks_are_counted_up_front_naming_the_row(tmp_path):
    """FLUX.1 EliGen with 3 prompts and 2 masks named no row (it failed in the denoiser); the prompts may be a JSON
    list written in a CSV cell."""
    from difftune.core.family import get_family
    from difftune.data import UnifiedDataset

    for name in ("a.png", "m1.png", "m2.png"):
        Image.new("RGB", (32, 32)).save(tmp_path / name)
    rows = [{"image": "a.png", "prompt": "two", "eligen_entity_prompts": ["a", "b"],
             "eligen_entity_masks": ["m1.png", "m2.png"]},
            {"image": "a.png", "prompt": "three", "eligen_entity_prompts": ["a", "b", "c"],
             "eligen_entity_masks": ["m1.png", "m2.png"]}]
    (tmp_path / "meta.json").write_text(json.dumps(rows))
    pairs = get_family("flux").pipeline.paired_columns()
    assert ("eligen_entity_prompts", "eligen_entity_masks") in pairs
    keys = dict(data_file_keys=("image", "eligen_entity_masks"),
                extra_inputs=("eligen_entity_prompts", "eligen_entity_masks"), paired_columns=pairs)
    with pytest.raises(DataError, match=r"meta.json row 2: 'eligen_entity_prompts' has 3 entries and "
                                        r"'eligen_entity_masks' 2; they go in pairs"):
        UnifiedDataset(tmp_path, tmp_path / "meta.json", **keys)
    (tmp_path / "meta.csv").write_text('image,prompt,eligen_entity_prompts,eligen_entity_masks\n'
                                       'a.png,one,"[""a"", ""b""]",m1.png\n')
    with pytest.raises(DataError, match=r"meta.csv row 1: 'eligen_entity_prompts' has 2 entries and "
                                        r"'eligen_entity_masks' 1"):
        UnifiedDataset(tmp_path, tmp_path / "meta.csv", **keys)
