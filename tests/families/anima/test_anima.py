"""Anima: one denoiser call equals diffusers' own CosmosTransformer3DModel + AnimaTextConditioner on the tiny split
file's weights (converted by diffusers' own functions), the sampling schedule is the reference's Z-Image template,
`--lora_target_modules ""` picks what the reference picks on its own AnimaDiT, the default LoRA file is read by
diffusers' Anima LoRA converter, and a text encoder of another width is refused naming both parts."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from difftune.errors import UserError

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from support.anima import write_tiny_anima_hub

    return write_tiny_anima_hub(tmp_path_factory.mktemp("anima_hub"))


@pytest.fixture(scope="module")
def pipe(hub):
    from support.anima import load_tiny_anima

    return load_tiny_anima(hub)


def _nearest_resize(mask, size, interpolation=None):
    return torch.nn.functional.interpolate(mask, size=size, mode="nearest")


def _diffusers_models(hub, monkeypatch):
    """diffusers' two classes at the tiny sizes, from the split file through diffusers' Cosmos-Predict2 single-file
    converter (the adapter's tensors under its own names). This venv has no torchvision, which diffusers' Cosmos
    forward uses only to resize the padding mask: a nearest resize stands in for it."""
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers
    from diffusers.models.transformers import transformer_cosmos
    from safetensors.torch import load_file

    from support.anima import DIT_FILE, REPO, tiny_dit_config

    monkeypatch.setattr(transformer_cosmos, "transforms",
                        types.SimpleNamespace(functional=types.SimpleNamespace(resize=_nearest_resize),
                                              InterpolationMode=types.SimpleNamespace(NEAREST=None)), raising=False)
    state = load_file(str(hub / REPO / DIT_FILE))
    adapter = {k[len("net.llm_adapter."):]: v for k, v in state.items() if k.startswith("net.llm_adapter.")}
    rest = {k: v for k, v in state.items() if not k.startswith("net.llm_adapter.")}
    config = tiny_dit_config()
    cosmos = CosmosTransformer3DModel(**{k: tuple(v) if isinstance(v, list) else v
                                         for k, v in config["transformer_config"].items()})
    cosmos.load_state_dict(convert_cosmos_transformer_checkpoint_to_diffusers(rest), strict=True)
    conditioner = AnimaTextConditioner(**config["conditioner_config"])
    conditioner.load_state_dict(adapter, strict=True)
    return cosmos.eval(), conditioner.eval()


def test_one_denoiser_call_equals_diffusers_anima_classes(hub, pipe, monkeypatch):
    """model_fn (the reference's call: latents as one frame, t / 1000, the adapter over Qwen3's 512 states and the T5
    ids) == diffusers' AnimaTextConditioner then CosmosTransformer3DModel with a zero padding mask. Measured: max
    |diff| 0 (same kernels, same order)."""
    cosmos, conditioner = _diffusers_models(hub, monkeypatch)
    with torch.no_grad():
        from difftune.families.anima.prompt import qwen_hidden_states, t5_token_ids

        prompts = ["a red circle", "two blue squares on grass"]
        embeds = qwen_hidden_states(pipe, prompts)
        ids, mask = t5_token_ids(pipe, prompts)
        assert embeds.shape == (2, 512, 32) and ids.shape[0] == 2
        g = torch.Generator().manual_seed(0)
        latents = torch.randn(2, 16, 4, 6, generator=g)
        t = torch.tensor([731.0, 212.0])
        ours = pipe.model_fn(latents, t, embeds, ids, mask)
        context = conditioner(embeds, ids, target_attention_mask=mask)
        theirs = cosmos(hidden_states=latents.unsqueeze(2), timestep=t / 1000, encoder_hidden_states=context,
                        padding_mask=torch.zeros(1, 1, 4, 6), return_dict=False)[0][:, :, 0]
    assert ours.shape == (2, 16, 4, 6)
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-6, diff
    assert theirs.std() > 1e-3


def test_a_prompt_in_a_batch_reads_as_it_does_alone(pipe):
    """T5 ids padded to the batch's longest (with their mask) give each prompt the velocity it gets alone: the
    reference encodes one prompt at a time, unpadded."""
    from difftune.families.anima.prompt import qwen_hidden_states, t5_token_ids

    prompts = ["a cat", "a much longer prompt about a cat on a mat"]
    with torch.no_grad():
        embeds = qwen_hidden_states(pipe, prompts)
        ids, mask = t5_token_ids(pipe, prompts)
        assert mask[0].sum() < mask[1].sum()
        latents = torch.randn(2, 16, 2, 2, generator=torch.Generator().manual_seed(1))
        t = torch.tensor([500.0, 500.0])
        both = pipe.model_fn(latents, t, embeds, ids, mask)
        alone = pipe.model_fn(latents[:1], t[:1], embeds[:1], *t5_token_ids(pipe, prompts[:1]))
    torch.testing.assert_close(both[:1], alone, rtol=0, atol=1e-5)


def test_sampling_schedule_is_the_references_z_image_template(pipe):
    """sigmas = 3 s / (1 + 2 s) over s = linspace(1, 0, N + 1)[:-1]; timesteps = 1000 sigmas."""
    pipe.set_timesteps({}, 6)
    s = torch.linspace(1, 0, 7)[:-1]
    want = 3 * s / (1 + 2 * s)
    torch.testing.assert_close(pipe.scheduler.sigmas[:6].float(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(pipe.scheduler.timesteps.float(), want * 1000, rtol=0, atol=1e-3)


def test_auto_targets_on_the_official_dit_are_the_references_340():
    """`--lora_target_modules ""` on the official Anima DiT (difftune's class: diffusers' two, the official config,
    meta tensors), in the released names, is the list the reference's own rule gives on its own AnimaDiT (the JSON
    beside this file): 28 blocks x 10 and 6 adapter blocks x 10, in the same order."""
    from difftune.families.anima.components import ANIMA_DIT_CONFIG, AnimaTransformer, original_name
    from difftune.lora.auto_targets import auto_target_modules

    reference = json.loads((HERE / "reference_auto_targets_anima.json").read_text())["targets"]
    with torch.device("meta"):
        dit = AnimaTransformer(**{k: v for k, v in ANIMA_DIT_CONFIG.items() if not k.startswith("_")})
    ours = [original_name(t) for t in auto_target_modules(dit)]
    assert len(ours) == len(reference) == 340
    assert sorted(ours) == sorted(reference)
    assert sum(t.startswith("llm_adapter.") for t in ours) == 60
    # the family's named targets (for a command that names none) are the same modules
    from difftune.families.anima.components import LORA_TARGET_MODULES

    ends = tuple("." + n for n in LORA_TARGET_MODULES.split(","))
    named = [n for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(ends)]
    assert sorted(named) == sorted(auto_target_modules(dit))


def test_the_default_lora_file_is_read_by_diffusers_anima_converter(pipe, tmp_path):
    """The default layout (ComfyUI's: diffusion_model.<released name> + alpha) is what diffusers' Anima loader converts
    onto its transformer / text_conditioner, whose module paths are this DiT's own; difftune reads it back exactly."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_anima_lora_to_diffusers
    from safetensors.torch import load_file

    from difftune.families.anima import FAMILY
    from difftune.lora.formats import load_lora_file, save_lora

    targets = ["transformer.transformer_blocks.0.attn1.to_q", "transformer.transformer_blocks.1.ff.net.2",
               "text_conditioner.blocks.0.cross_attn.k_proj"]
    modules = dict(pipe.dit.named_modules())
    g = torch.Generator().manual_seed(2)
    state = {}
    for t in targets:
        m = modules[t]
        state[f"{t}.lora_A.weight"] = torch.randn(4, m.in_features, generator=g)
        state[f"{t}.lora_B.weight"] = torch.randn(m.out_features, 4, generator=g)
    path = save_lora(tmp_path / "lora.safetensors", {"dit": state}, {"dit": (4, 8, "to_q,net.2,k_proj")},
                     layout=FAMILY.lora_default_format, native_names=FAMILY.lora_native_names)
    saved = load_file(str(path))
    assert "diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight" in saved
    assert "diffusion_model.llm_adapter.blocks.0.cross_attn.k_proj.alpha" in saved
    converted = _convert_non_diffusers_anima_lora_to_diffusers(saved)
    assert {k.rpartition(".lora_")[0] for k in converted if ".lora_" in k} == set(targets)
    back = load_lora_file(path, resolve_against=pipe.dit, component="dit", converters=FAMILY.lora_converters)
    key = back.select("dit")
    for name, value in state.items():
        torch.testing.assert_close(back.components[key][name], value)
    assert set(back.alphas[key].values()) == {8}


def test_a_text_encoder_of_another_width_is_refused_naming_both(hub, tmp_path):
    from difftune.families.anima.pipeline import AnimaPipeline
    from difftune.models import ModelConfig
    from support.anima import (QWEN_REPO, T5_FOLDER, T5_REPO, TEXT_ENCODER_FILE, REPO, TinyAnimaSpec,
                               anima_model_paths, tiny_qwen3)
    from support.anima.tiny import _save

    wide = _save({f"model.{k}": v for k, v in tiny_qwen3(TinyAnimaSpec(text_hidden=48), vocab_size=300)
                  .state_dict().items()}, tmp_path / "qwen_3_wide.safetensors")
    paths = anima_model_paths(hub)
    paths[1] = str(wide)
    with pytest.raises(UserError) as err:
        AnimaPipeline.from_pretrained(torch_dtype=torch.float32, device="cpu",
                                      model_configs=[ModelConfig(p) for p in paths],
                                      tokenizer_config=ModelConfig(str(hub / QWEN_REPO)),
                                      tokenizer_t5xxl_config=ModelConfig(str(hub / T5_REPO / T5_FOLDER)))
    message = str(err.value)
    assert "\n" not in message
    assert "text_encoder" in message and "dit" in message and "48" in message and "32" in message, message
    assert str(hub / REPO / TEXT_ENCODER_FILE) not in message


def test_the_repository_root_pattern_resolves_to_the_root_folder(tmp_path):
    """`model_id:./` (the reference's spelling of a whole repository, its Qwen3 tokenizer) is the repository's root."""
    from difftune.models.download import resolve_hub

    (tmp_path / "org" / "repo").mkdir(parents=True)
    (tmp_path / "org" / "repo" / "tokenizer.json").write_text("{}")
    assert resolve_hub("org/repo", "./", base=tmp_path, skip=True, source="huggingface") == \
        str(tmp_path / "org" / "repo" / ".")


def test_kohya_layout_in_the_released_names_reads_back_exactly(pipe, tmp_path):
    """`--lora_format kohya` writes `lora_unet_<released name, flattened>`; difftune reads it back onto the DiT."""
    from safetensors.torch import load_file

    from difftune.families.anima import FAMILY
    from difftune.lora.formats import load_lora_file, save_lora

    targets = ["transformer.transformer_blocks.1.attn2.to_out.0", "text_conditioner.blocks.1.mlp.0"]
    modules = dict(pipe.dit.named_modules())
    g = torch.Generator().manual_seed(3)
    state = {}
    for t in targets:
        m = modules[t]
        state[f"{t}.lora_A.weight"] = torch.randn(2, m.in_features, generator=g)
        state[f"{t}.lora_B.weight"] = torch.randn(m.out_features, 2, generator=g)
    path = save_lora(tmp_path / "kohya.safetensors", {"dit": state}, {"dit": (2, 2, "to_out.0,mlp.0")},
                     layout="kohya", native_names=FAMILY.lora_native_names)
    saved = load_file(str(path))
    assert "lora_unet_blocks_1_cross_attn_output_proj.lora_down.weight" in saved
    assert "lora_unet_llm_adapter_blocks_1_mlp_0.lora_up.weight" in saved
    back = load_lora_file(path, resolve_against=pipe.dit, component="dit", converters=FAMILY.lora_converters)
    key = back.select("dit")
    assert sorted(back.components[key]) == sorted(state)
    for name, value in state.items():
        torch.testing.assert_close(back.components[key][name], value)
