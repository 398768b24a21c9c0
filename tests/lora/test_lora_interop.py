"""LoRA files load at the trained strength everywhere: diffusers, ComfyUI and difftune itself, in every layout
difftune writes (`--lora_format diffusers|comfyui|kohya`) and every Qwen-Image layout it reads.

ComfyUI's rules are re-implemented here from reading ComfyUI at commit
a125cd84b054a57729b5eecab930ca9408719832 (github.com/Comfy-Org/ComfyUI, 2025-10-12):

* key map (`comfy/lora.py`, `model_lora_keys_unet`): for every weight `diffusion_model.<path>.weight` of the
  model, the LoRA key stems `lora_unet_<path with . as _>` and `diffusion_model.<path>` (all models), and for
  `QwenImage` also `<path>`, `transformer.<path>` and `lycoris_<path with . as _>`. (`lora_transformer_`,
  OneTrainer's, is mapped for SD3 and Flux only.) ComfyUI's Qwen-Image module names equal diffusers'.
* loading (`comfy/lora.py` `load_lora`, `comfy/weight_adapter/lora.py` `LoRAAdapter`): for a stem, alpha comes
  only from a `<stem>.alpha` tensor; the up/down pair is `.lora_up/.lora_down.weight`, `_lora.up/.down.weight`,
  `.lora_B/.lora_A.weight`, `.lora.up/.down.weight`, `.lora_B/.lora_A`, `.lora_linear_layer.up/.down.weight`
  or `.lora_B/.lora_A.default.weight`, first match wins; the weight gets
  `strength * (alpha / rank if alpha else 1) * up @ down` with rank = down's rows. File metadata is never read.
  Keys no stem claims are reported as not loaded.
"""

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import make_image_dataset, model_paths_json, run_train
from difftune.errors import UserError
from difftune.lora import (fuse_lora, inject_lora, load_lora_file, load_lora_into, lora_state_dict, save_lora,
                           to_comfyui, to_kohya, write_safetensors)
from support import (TinyQwenImageSpec, qwen_tokenizer, tiny_qwen_text_encoder, tiny_qwen_transformer,
                              tiny_qwen_vae)
from test_bad_input import base_args, cli, one_line_error

TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
           "img_mlp.net.2", "img_mod.1", "txt_mlp.net.2", "txt_mod.1"]
SPEC = TinyQwenImageSpec()
RANK = 16


# -- ComfyUI, re-implemented from its rules (see the module docstring) -------------------------------------

def comfy_key_map(model_keys):
    """LoRA key stem -> model weight key, as ComfyUI builds it for a QwenImage model."""
    key_map = {}
    for k in model_keys:
        if not k.startswith("diffusion_model."):
            continue
        if not k.endswith(".weight"):
            key_map[k] = k
            continue
        path = k[len("diffusion_model."):-len(".weight")]
        key_map[f"lora_unet_{path.replace('.', '_')}"] = k
        key_map[f"diffusion_model.{path}"] = k
        key_map[path] = k  # QwenImage: bare module names
        key_map[f"transformer.{path}"] = k
        key_map[f"lycoris_{path.replace('.', '_')}"] = k
    return key_map


COMFY_PAIRS = ((".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
               (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
               (".lora_B", ".lora_A"), (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
               (".lora_B.default.weight", ".lora_A.default.weight"))


def comfy_deltas(lora, key_map, strength=1.0):
    """{model weight key: the delta ComfyUI adds}, and the file's keys it leaves unloaded."""
    deltas, loaded = {}, set()
    for stem, target in key_map.items():
        alpha = None
        if f"{stem}.alpha" in lora:
            alpha = lora[f"{stem}.alpha"].item()
            loaded.add(f"{stem}.alpha")
        for up, down in COMFY_PAIRS:
            if stem + up in lora:
                mat_up, mat_down = lora[stem + up].float(), lora[stem + down].float()
                loaded.update((stem + up, stem + down))
                scale = alpha / mat_down.shape[0] if alpha is not None else 1.0
                deltas[target] = (strength * scale) * torch.mm(mat_up, mat_down)
                break
    return deltas, set(lora) - loaded


def comfy_model_keys(transformer):
    return [f"diffusion_model.{k}" for k in transformer.state_dict()]


# -- fixtures ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parts():
    tok = qwen_tokenizer()
    return {"tokenizer": tok, "text_encoder": tiny_qwen_text_encoder(SPEC, tok), "vae": tiny_qwen_vae(SPEC)}


def make_pipe(parts):
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=parts["vae"],
                             text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"],
                             transformer=tiny_qwen_transformer(SPEC))


def trained_lora(alpha, seed=5):
    """A rank-16 LoRA with random A and B (as if trained): (canonical state dict, LoraConfig)."""
    tr = tiny_qwen_transformer(SPEC)
    torch.manual_seed(seed)
    config = inject_lora(tr, TARGETS, RANK, alpha, init=False)
    return lora_state_dict(tr), config


def intended(sd, alpha):
    """{module path: (alpha / rank) * B @ A}: what the trained adapter adds to each weight."""
    paths = sorted(k[: -len(".lora_A.weight")] for k in sd if k.endswith(".lora_A.weight"))
    return {p: (alpha / RANK) * (sd[f"{p}.lora_B.weight"] @ sd[f"{p}.lora_A.weight"]) for p in paths}


def diffusers_deltas(parts, path):
    """{module path: delta} as diffusers' QwenImagePipeline.load_lora_weights applies the file (through peft)."""
    pipe = make_pipe(parts)
    pipe.load_lora_weights(str(path))
    out = {}
    for name, layer in pipe.transformer.named_modules():
        if isinstance(layer, LoraLayer):
            (adapter,) = layer.lora_A.keys()
            out[name] = layer.get_delta_weight(adapter).detach()
    return out


def same(got, want):
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, (bad[:3], max((got[k] - want[k]).abs().max().item() for k in bad))


# -- item 9: every saved layout, at the trained strength, in diffusers, ComfyUI and difftune ------------------

@pytest.mark.parametrize("alpha", [8.0, float(RANK)])
@pytest.mark.parametrize("layout", ["diffusers", "comfyui", "kohya"])
def test_saved_lora_has_the_trained_strength_everywhere(parts, tmp_path, layout, alpha):
    sd, config = trained_lora(alpha)
    want = intended(sd, alpha)
    path = save_lora(tmp_path / f"{layout}.safetensors", {"dit": sd}, {"dit": config}, layout=layout)

    # ComfyUI: every key of the file is loaded, every layer at (alpha / rank) * B @ A
    model_keys = comfy_model_keys(tiny_qwen_transformer(SPEC))
    deltas, not_loaded = comfy_deltas(load_file(str(path)), comfy_key_map(model_keys))
    assert not_loaded == set()
    same({k[len("diffusion_model."):-len(".weight")]: v for k, v in deltas.items()}, want)

    # diffusers (peft with the file's metadata)
    same(diffusers_deltas(parts, path), want)

    # difftune: reads back the trained B and alpha, fuses the same delta
    imported = load_lora_file(path, resolve_against=tiny_qwen_transformer(SPEC), component="dit")
    assert set(imported.alphas["transformer"].values()) == {alpha}
    assert all(torch.equal(imported.components["transformer"][k], v) for k, v in sd.items())
    same({p: (imported.alphas["transformer"][p] / RANK) * (imported.components["transformer"][f"{p}.lora_B.weight"]
                                                          @ imported.components["transformer"][f"{p}.lora_A.weight"])
          for p in want}, want)


def test_unfolded_transformer_layout_is_wrong_in_comfyui_and_alpha_tensors_break_diffusers(parts, tmp_path):
    # why difftune folds: the two ways a diffusers-layout file could carry alpha fail in one tool each
    sd, config = trained_lora(8.0)
    want = intended(sd, 8.0)
    key_map = comfy_key_map(comfy_model_keys(tiny_qwen_transformer(SPEC)))
    unfolded = tmp_path / "metadata_alpha.safetensors"  # alpha in metadata only (difftune before)
    save_file({f"transformer.{k}": v for k, v in sd.items()}, str(unfolded), metadata={
        "format": "pt", "lora_adapter_metadata": json.dumps({"transformer.r": RANK, "transformer.lora_alpha": 8.0,
                                                             "transformer.target_modules": TARGETS})})
    same(diffusers_deltas(parts, unfolded), want)
    deltas, _ = comfy_deltas(load_file(str(unfolded)), key_map)
    wrong = next(iter(want))
    assert torch.equal(deltas[f"diffusion_model.{wrong}.weight"], 2 * want[wrong])  # ComfyUI: rank/alpha times
    with_alpha = tmp_path / "alpha_tensors.safetensors"
    tensors = {f"transformer.{k}": v for k, v in sd.items()}
    tensors.update({f"transformer.{p}.alpha": torch.tensor(8.0) for p in want})
    save_file(tensors, str(with_alpha))
    with pytest.raises(Exception, match="not found in the base model"):
        diffusers_deltas(parts, with_alpha)


def test_folded_file_metadata_and_continuing_training_from_it(tmp_path):
    sd, config = trained_lora(8.0)
    path = save_lora(tmp_path / "l.safetensors", {"dit": sd}, {"dit": config})
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert all(not k.endswith(".alpha") for k in f.keys())
    adapter, ours = json.loads(meta["lora_adapter_metadata"]), json.loads(meta["difftune_lora"])
    assert adapter["transformer.lora_alpha"] == RANK and adapter["transformer.alpha_pattern"] == {}
    assert ours["components"]["transformer"]["alpha"] == 8.0 and ours["components"]["transformer"]["alpha_folded"]
    # --lora_checkpoint: the trained alpha and B come back, so B's learning-rate scale is the trained one
    tr = tiny_qwen_transformer(SPEC)
    config2 = load_lora_into(tr, load_lora_file(path), component="dit", target_modules=TARGETS)
    assert (config2.r, config2.lora_alpha) == (RANK, 8.0)
    layer = tr.get_submodule("transformer_blocks.0.attn.to_q")
    assert layer.scaling["default"] == 0.5
    assert all(torch.equal(v, sd[k]) for k, v in lora_state_dict(tr).items())


def test_per_module_rank_and_alpha_fold_per_module(parts, tmp_path):
    sd, config = trained_lora(8.0)
    alphas = {p: (4.0 if ".0." in p else 32.0) for p in intended(sd, 8.0)}
    comfy = write_safetensors(tmp_path / "mixed.safetensors", to_comfyui(sd, alphas))
    imported = load_lora_file(comfy)
    out = save_lora(tmp_path / "converted.safetensors", {"dit": imported.components["transformer"]},
                    {"dit": imported.config("dit")})
    want = {p: (alphas[p] / RANK) * (sd[f"{p}.lora_B.weight"] @ sd[f"{p}.lora_A.weight"]) for p in alphas}
    same(diffusers_deltas(parts, out), want)
    deltas, not_loaded = comfy_deltas(load_file(str(out)), comfy_key_map(comfy_model_keys(tiny_qwen_transformer(SPEC))))
    assert not not_loaded
    same({k[len("diffusion_model."):-len(".weight")]: v for k, v in deltas.items()}, want)
    assert load_lora_file(out).alphas["transformer"] == alphas


def test_comfyui_and_kohya_layouts_hold_the_denoiser_only(tmp_path, tiny_repo, capsys):
    tok = qwen_tokenizer()
    te = tiny_qwen_text_encoder(SPEC, tok)
    config = inject_lora(te, ["q_proj"], 4)
    with pytest.raises(UserError, match="text_encoder .* has no comfyui key names"):
        save_lora(tmp_path / "te.safetensors", {"text_encoder": lora_state_dict(te)}, {"text_encoder": config},
                  layout="comfyui")
    meta = make_image_dataset(tmp_path / "data", n=2)
    args = base_args(meta, tmp_path / "out", tiny_repo)
    args[args.index("--lora_base_model") + 1] = "text_encoder"
    args[args.index("--lora_target_modules") + 1] = "q_proj"
    one_line_error(capsys, cli(*args, "--lora_format", "kohya"), "--lora_format kohya", "text_encoder",
                   "--lora_format diffusers")


@pytest.mark.parametrize("layout,first_key", [("diffusers", "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"),
                                              ("comfyui", "diffusion_model.transformer_blocks.0.attn.to_q.alpha"),
                                              ("kohya", "lora_unet_transformer_blocks_0_attn_to_q.alpha")])
def test_train_writes_the_chosen_lora_format(tmp_path, tiny_repo, layout, first_key):
    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--model_paths", model_paths_json(tiny_repo), "--output_path", out, "--lora_base_model", "dit",
              "--lora_target_modules", "to_q,to_k", "--lora_rank", 4, "--lora_alpha", 2, "--torch_dtype", "float32",
              "--no_progress", "--max_steps", 1, "--save_state", "--lora_format", layout, "--learning_rate", 1e-2)
    saved = load_file(str(out / "epoch-0.safetensors"))
    assert first_key in saved
    # the LoRA as trained (the exact-resume state keeps the raw peft weights), at alpha / rank = 0.5
    state = load_file(str(next((out / "state").glob("step-*")) / "weights.safetensors"))
    trained = {k.removeprefix("pipe_models.dit.").replace(".default", ""): v for k, v in state.items()}
    want = {p: 0.5 * (trained[f"{p}.lora_B.weight"] @ trained[f"{p}.lora_A.weight"])
            for p in (k[: -len(".lora_A.weight")] for k in trained if k.endswith(".lora_A.weight"))}
    deltas, not_loaded = comfy_deltas(saved, comfy_key_map(comfy_model_keys(tiny_qwen_transformer(SPEC))))
    assert not not_loaded
    same({k[len("diffusion_model."):-len(".weight")]: v for k, v in deltas.items()}, want)
    imported = load_lora_file(out / "epoch-0.safetensors", resolve_against=tiny_qwen_transformer(SPEC),
                              component="dit")
    assert set(imported.alphas["transformer"].values()) == {2.0}


# -- item 10: every name ComfyUI maps for Qwen-Image (and OneTrainer's) imports at exact strength ---------------

def _flat(sd, alpha, prefix):
    return to_kohya(sd, alpha, prefix=prefix)


LAYOUTS = {
    "lycoris": lambda sd, a: _flat(sd, a, "lycoris_"),
    "onetrainer": lambda sd, a: _flat(sd, a, "lora_transformer_"),
    "kohya": lambda sd, a: _flat(sd, a, "lora_unet_"),
    "comfyui": lambda sd, a: to_comfyui(sd, a),
    "bare_with_alpha": lambda sd, a: to_comfyui(sd, a, prefix=""),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_qwen_image_layout_imports_and_fuses_like_the_diffusers_file(tmp_path, layout):
    sd, config = trained_lora(8.0, seed=7)
    reference = save_lora(tmp_path / "diffusers.safetensors", {"dit": sd}, {"dit": config})
    path = write_safetensors(tmp_path / f"{layout}.safetensors", LAYOUTS[layout](sd, 8.0))
    if layout in ("lycoris", "kohya"):  # names ComfyUI maps for Qwen-Image: it must load every key
        _, not_loaded = comfy_deltas(load_file(str(path)), comfy_key_map(comfy_model_keys(tiny_qwen_transformer(SPEC))))
        assert not not_loaded
    ref = load_lora_file(reference, resolve_against=tiny_qwen_transformer(SPEC), component="dit")
    got = load_lora_file(path, resolve_against=tiny_qwen_transformer(SPEC), component="dit")
    key = got.select("dit")
    assert got.components[key].keys() == ref.components["transformer"].keys()
    assert all(torch.equal(got.components[key][k], v) for k, v in ref.components["transformer"].items())
    assert got.alphas[key] == ref.alphas["transformer"]
    a, b = tiny_qwen_transformer(SPEC), tiny_qwen_transformer(SPEC)
    fuse_lora(a, load_lora_file(reference), component="dit")
    fuse_lora(b, load_lora_file(path), component="dit")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_lora_checkpoint_in_lycoris_layout_continues_training(tmp_path, tiny_repo, capsys):
    sd, config = trained_lora(8.0)
    sd = {k: v for k, v in sd.items() if ".to_q." in k}
    path = write_safetensors(tmp_path / "lycoris.safetensors", to_kohya(sd, 8.0, prefix="lycoris_"))
    meta = make_image_dataset(tmp_path / "data", n=2)
    args = base_args(meta, tmp_path / "out", tiny_repo)
    args[args.index("--lora_rank") + 1] = RANK
    assert cli(*args, "--lora_checkpoint", path, "--max_steps", 1) == 0, capsys.readouterr().err


def test_sample_with_a_lycoris_or_onetrainer_lora_equals_the_diffusers_file(tmp_path, tiny_repo):
    import numpy as np
    from PIL import Image

    sd, config = trained_lora(8.0, seed=9)
    sd = {k: v * 0.3 for k, v in sd.items()}
    files = {"diffusers": save_lora(tmp_path / "diffusers.safetensors", {"dit": sd}, {"dit": config}),
             "lycoris": write_safetensors(tmp_path / "lycoris.safetensors", to_kohya(sd, 8.0, prefix="lycoris_")),
             "onetrainer": write_safetensors(tmp_path / "onetrainer.safetensors",
                                             to_kohya(sd, 8.0, prefix="lora_transformer_"))}
    common = ["sample", "--model_dir", tiny_repo, "--prompt", "a dog", "--height", 32, "--width", 32,
              "--num_inference_steps", 2, "--torch_dtype", "float32", "--seed", 1]
    images = {}
    for name, path in files.items():
        assert cli(*common, "--output", tmp_path / f"{name}.png", "--lora", path) == 0
        images[name] = np.asarray(Image.open(tmp_path / f"{name}.png"))
    assert cli(*common, "--output", tmp_path / "base.png") == 0
    assert not np.array_equal(images["diffusers"], np.asarray(Image.open(tmp_path / "base.png")))
    assert np.array_equal(images["lycoris"], images["diffusers"]) and np.array_equal(images["onetrainer"],
                                                                                     images["diffusers"])


def test_imported_rank_patterns_are_anchored_to_the_full_module_path():
    """A per-module rank for the top-level `proj_out` must not also apply to `blocks.0.proj_out` (peft matches
    a pattern as a suffix of the module path)."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    from difftune.lora.formats import ImportedLora

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"proj_out": torch.nn.Linear(4, 4)})])
            self.proj_out = torch.nn.Linear(4, 4)

    ranks = {"blocks.0.proj_out": 2, "blocks.1.proj_out": 2, "proj_out": 3}  # rank 2 the common one
    sd = {}
    for path, r in ranks.items():
        sd[f"{path}.lora_A.weight"], sd[f"{path}.lora_B.weight"] = torch.zeros(r, 4), torch.zeros(4, r)
    lora = ImportedLora(source="test", layout="peft", components={"": sd}, alphas={"": dict(ranks)},
                        targets={"": list(ranks)}, alpha_source="file")
    cfg = lora.config()
    assert list(cfg["rank_pattern"]) == ["^proj_out"]
    net = Net()
    net.blocks.append(torch.nn.ModuleDict({"proj_out": torch.nn.Linear(4, 4)}))
    net = inject_adapter_in_model(LoraConfig(**cfg), net)
    assert net.proj_out.lora_A["default"].weight.shape[0] == 3
    assert [b["proj_out"].lora_A["default"].weight.shape[0] for b in net.blocks] == [2, 2]
