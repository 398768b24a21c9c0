"""LoRA: inject (fp32 on any base), export that diffusers loads with alpha, import every layout, fuse."""

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import save_file

from difftune.errors import UserError
from support import (TinyQwenImageSpec, qwen_tokenizer, tiny_qwen_text_encoder, tiny_qwen_transformer,
                              tiny_qwen_vae)
from difftune.lora import (fuse_lora, inject_lora, load_lora_file, load_lora_into, lora_state_dict, save_lora,
                           to_comfyui, to_kohya, write_safetensors)

TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
           "img_mlp.net.2", "img_mod.1", "txt_mlp.net.2", "txt_mod.1"]
RANK, ALPHA = 4, 8.0  # scale 2: a lost alpha changes the output
SPEC = TinyQwenImageSpec()
TOL = 1e-5


def randomize(module, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def parts():
    tok = qwen_tokenizer()
    return {"tokenizer": tok, "text_encoder": tiny_qwen_text_encoder(SPEC, tok), "vae": tiny_qwen_vae(SPEC)}


def make_pipe(parts, transformer=None):
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=parts["vae"],
                             text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"],
                             transformer=transformer if transformer is not None else tiny_qwen_transformer(SPEC))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe):
    return pipe(prompt="a cat holding a sign", height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0,
                max_sequence_length=64, output_type="pt", generator=torch.Generator().manual_seed(0)).images


def diff(a, b):
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def base_out(parts):
    return run(make_pipe(parts))


@pytest.fixture(scope="module")
def adapted(parts):
    """A transformer with a random r=4, alpha=8 LoRA, its canonical state dict, config and output."""
    tr = tiny_qwen_transformer(SPEC)
    config = inject_lora(tr, TARGETS, RANK, ALPHA)
    randomize(tr)
    out = run(make_pipe(parts, tr))
    return {"transformer": tr, "config": config, "sd": lora_state_dict(tr), "out": out}


@pytest.fixture(scope="module")
def files(adapted, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    sd = adapted["sd"]
    paths = {"difftune": save_lora(d / "difftune.safetensors", {"dit": sd}, {"dit": adapted["config"]},
                                   base_info={"model_id": "Qwen/Qwen-Image"})}
    QwenImagePipeline.save_lora_weights(d / "diffusers", transformer_lora_layers=sd,
                                        transformer_lora_adapter_metadata=adapted["config"].to_dict())
    paths["diffusers"] = d / "diffusers" / "pytorch_lora_weights.safetensors"
    paths["comfyui"] = write_safetensors(d / "comfyui.safetensors", to_comfyui(sd, ALPHA))
    paths["kohya"] = write_safetensors(d / "kohya.safetensors", to_kohya(sd, ALPHA))
    # PEFT's own save_pretrained layout: raw keys, alpha in adapter_config.json beside the weights
    (d / "peft").mkdir()
    save_file({f"base_model.model.{k}": v for k, v in sd.items()}, d / "peft" / "adapter_model.safetensors")
    (d / "peft" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS}))
    # the reference's export: peft parameter names with '.default', no alpha anywhere
    paths["reference"] = d / "reference.safetensors"
    save_file({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
               for k, v in sd.items()}, paths["reference"])
    paths["peft"] = d / "peft"
    paths["no_metadata"] = d / "no_metadata.safetensors"
    save_file({f"transformer.{k}": v for k, v in sd.items()}, paths["no_metadata"])
    return paths


# -- inject ---------------------------------------------------------------------------------------------

def test_inject_keeps_lora_fp32_on_bf16_base_and_trains_only_lora():
    tr = tiny_qwen_transformer(SPEC).to(torch.bfloat16)
    config = inject_lora(tr, TARGETS, RANK)
    assert (config.r, config.lora_alpha) == (RANK, RANK)  # alpha defaults to rank
    trainable = {n: p for n, p in tr.named_parameters() if p.requires_grad}
    assert len(trainable) == SPEC.num_layers * len(TARGETS) * 2
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    assert all(p.dtype == torch.bfloat16 for n, p in tr.named_parameters() if n not in trainable)
    randomize(tr)
    out = tr(hidden_states=torch.randn(1, 16, 64, dtype=torch.bfloat16),
             encoder_hidden_states=torch.randn(1, 8, 32, dtype=torch.bfloat16),
             encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long), timestep=torch.rand(1),
             img_shapes=[[(1, 4, 4)]], return_dict=False)[0]
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    grads = [p.grad for p in trainable.values() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)
    sd = lora_state_dict(tr)
    assert "transformer_blocks.0.attn.to_q.lora_A.weight" in sd and not any(".default" in k for k in sd)
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in sd.values())


def test_unmatched_target_is_a_user_error_naming_the_flag():
    tr = tiny_qwen_transformer(SPEC)
    with pytest.raises(UserError) as e:
        inject_lora(tr, ["to_q", "to_qq", "q_proj"], RANK)
    msg = str(e.value)
    assert "--lora_target_modules" in msg and "to_qq" in msg and "q_proj" in msg and "attn.to_q" in msg
    assert "\n" not in msg
    assert not any(isinstance(m, BaseTunerLayer) for m in tr.modules())  # nothing half-injected
    with pytest.raises(UserError, match="not a Linear"):
        inject_lora(tr, ["attn"], RANK)


def test_exclude_modules_leaves_them_out():
    tr = tiny_qwen_transformer(SPEC)
    last = SPEC.num_layers - 1
    inject_lora(tr, TARGETS, RANK, exclude_modules=[f"transformer_blocks.{last}.attn.to_add_out"])
    sd = lora_state_dict(tr)
    assert f"transformer_blocks.{last}.attn.to_add_out.lora_A.weight" not in sd
    assert "transformer_blocks.0.attn.to_add_out.lora_A.weight" in sd


# -- export ---------------------------------------------------------------------------------------------

def test_saved_file_loads_in_diffusers_with_alpha(parts, adapted, files, base_out):
    with safe_open(str(files["difftune"]), "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert keys == {f"transformer.{k}" for k in adapted["sd"]}
    assert meta["format"] == "pt"
    adapter = json.loads(meta["lora_adapter_metadata"])
    # alpha/rank is folded into lora_B (ComfyUI ignores metadata): the file says alpha = rank, scale 1
    assert adapter["transformer.r"] == RANK and adapter["transformer.lora_alpha"] == RANK
    assert sorted(adapter["transformer.target_modules"]) == sorted(TARGETS)
    ours = json.loads(meta["difftune_lora"])
    assert ours["components"]["transformer"]["rank"] == RANK and ours["components"]["transformer"]["alpha"] == ALPHA
    assert ours["components"]["transformer"]["alpha_folded"] is True
    assert ours["base_model"] == {"model_id": "Qwen/Qwen-Image"}
    with safe_open(str(files["difftune"]), "pt") as f:
        for k, v in adapted["sd"].items():
            assert torch.equal(f.get_tensor(f"transformer.{k}"), v * (ALPHA / RANK) if ".lora_B." in k else v)
    # the same keys and LoraConfig fields as diffusers' own writer (but for the folded alpha)
    with safe_open(str(files["diffusers"]), "pt") as f:
        theirs = json.loads(f.metadata()["lora_adapter_metadata"])
        assert set(f.keys()) == keys
    for k in ("r", "rank_pattern", "alpha_pattern"):
        assert adapter[f"transformer.{k}"] == theirs[f"transformer.{k}"]

    pipe = make_pipe(parts)
    pipe.load_lora_weights(str(files["difftune"]))
    out = run(pipe)
    assert diff(out, adapted["out"]) <= TOL
    assert diff(adapted["out"], base_out) > 1e-3
    # the check above can see a lost alpha: diffusers reads a file without metadata at scale 1
    bare = make_pipe(parts)
    bare.load_lora_weights(str(files["no_metadata"]))
    assert diff(run(bare), adapted["out"]) > 1e-3


@pytest.mark.parametrize("layout", ["comfyui", "kohya"])
def test_comfyui_and_kohya_exports_load_in_diffusers(parts, adapted, files, layout):
    pipe = make_pipe(parts)
    pipe.load_lora_weights(str(files[layout]))
    assert diff(run(pipe), adapted["out"]) <= TOL


# -- import ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,component,alpha", [
    ("difftune", "transformer", ALPHA), ("diffusers", "transformer", ALPHA), ("comfyui", "transformer", ALPHA),
    ("kohya", "transformer", ALPHA), ("peft", "", ALPHA), ("reference", "", RANK),
    ("no_metadata", "transformer", RANK)])
def test_every_layout_imports_to_the_same_canonical_dict(adapted, files, layout, component, alpha):
    imported = load_lora_file(files[layout], resolve_against=tiny_qwen_transformer(SPEC), component="dit")
    assert list(imported.components) == [component]
    sd = imported.components[component]
    assert sd.keys() == adapted["sd"].keys()
    assert all(torch.equal(sd[k], adapted["sd"][k]) for k in sd)
    assert set(imported.alphas[component].values()) == {alpha}
    assert set(imported.ranks(component).values()) == {RANK}
    assert not imported.unresolved
    if layout == "reference":
        assert imported.layout == "reference" and "alpha = rank" in imported.alpha_source
    if layout == "difftune":
        assert imported.layout == "difftune" and imported.info["base_model"]["model_id"] == "Qwen/Qwen-Image"
        assert sorted(imported.targets["transformer"]) == sorted(TARGETS)


def test_kohya_names_stay_flat_until_matched_against_a_model(adapted, files):
    imported = load_lora_file(files["kohya"])
    assert imported.unresolved == {"transformer"}
    assert "transformer_blocks_0_attn_to_out_0.lora_A.weight" in imported.components["transformer"]
    tr = tiny_qwen_transformer(SPEC)
    load_lora_into(tr, imported, component="dit")
    assert all(torch.equal(v, adapted["sd"][k]) for k, v in lora_state_dict(tr).items())
    assert lora_state_dict(tr).keys() == adapted["sd"].keys()


def test_load_lora_into_continues_training_from_the_file(parts, adapted, files):
    tr = tiny_qwen_transformer(SPEC)
    config = load_lora_into(tr, load_lora_file(files["difftune"]), component="dit", target_modules=TARGETS, rank=4)
    assert (config.r, config.lora_alpha) == (RANK, ALPHA)
    sd = lora_state_dict(tr)
    assert all(torch.equal(sd[k], adapted["sd"][k]) for k in adapted["sd"])
    assert all(p.requires_grad == (".lora_" in n) for n, p in tr.named_parameters())
    assert diff(run(make_pipe(parts, tr)), adapted["out"]) <= TOL
    # a target set that misses modules of the file would drop trained weights
    with pytest.raises(UserError, match="--lora_target_modules does not cover"):
        load_lora_into(tiny_qwen_transformer(SPEC), load_lora_file(files["difftune"]), target_modules=["to_q"])


def test_per_module_alpha_is_kept_exactly(parts, adapted, tmp_path):
    # ComfyUI/kohya files may give every module its own alpha; diffusers folds it into the weights
    alphas = {p: (8.0 if ".0." in p else 2.0) for p in {k.rsplit(".lora_", 1)[0] for k in adapted["sd"]}}
    comfy = write_safetensors(tmp_path / "mixed.safetensors", to_comfyui(adapted["sd"], alphas))
    ref = make_pipe(parts)
    ref.load_lora_weights(str(comfy))
    expected = run(ref)
    assert diff(expected, adapted["out"]) > 1e-3
    imported = load_lora_file(comfy)
    assert imported.alphas["transformer"] == alphas
    tr = tiny_qwen_transformer(SPEC)
    load_lora_into(tr, imported, component="dit")
    assert diff(run(make_pipe(parts, tr)), expected) <= TOL
    # re-exported in diffusers' layout, the per-module alphas travel as alpha_pattern
    out = save_lora(tmp_path / "converted.safetensors", {"dit": imported.components["transformer"]},
                    {"dit": imported.config("dit")})
    pipe = make_pipe(parts)
    pipe.load_lora_weights(str(out))
    assert diff(run(pipe), expected) <= TOL


def test_reference_layout_means_alpha_equal_rank(parts, files):
    # diffusers also reads the reference's '.default' keys at scale 1; our fused model must agree
    pipe = make_pipe(parts)
    pipe.load_lora_weights(str(files["reference"]))
    tr = tiny_qwen_transformer(SPEC)
    fuse_lora(tr, load_lora_file(files["reference"]), component="dit")
    assert diff(run(make_pipe(parts, tr)), run(pipe)) <= TOL


# -- fuse -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["difftune", "kohya"])
def test_fuse_equals_the_adapted_model(parts, adapted, files, layout):
    tr = tiny_qwen_transformer(SPEC)
    fused = fuse_lora(tr, load_lora_file(files[layout]), component="dit")
    assert len(fused) == SPEC.num_layers * len(TARGETS)
    assert not any(isinstance(m, BaseTunerLayer) for m in tr.modules())
    assert diff(run(make_pipe(parts, tr)), adapted["out"]) <= TOL


def _tiny_lora_file(path, shape=(6, 5), rank=2, alpha=3.0):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(rank, shape[1], generator=g), torch.randn(shape[0], rank, generator=g)
    write_safetensors(path, to_comfyui({"lin.lora_A.weight": a, "lin.lora_B.weight": b}, alpha))
    return (b @ a) * (alpha / rank)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fuse_on_low_precision_weights_computes_in_fp32(tmp_path, dtype):
    delta = _tiny_lora_file(tmp_path / "l.safetensors")
    module = torch.nn.Module()
    module.lin = torch.nn.Linear(5, 6)
    module.lin.weight.data = (torch.randn(6, 5) * 4).to(dtype)
    before = module.lin.weight.detach().clone()
    fuse_lora(module, load_lora_file(tmp_path / "l.safetensors"), scale=0.5)
    assert module.lin.weight.dtype == dtype
    expected = (before.float() + 0.5 * delta).to(dtype)
    assert torch.equal(module.lin.weight.float(), expected.float())
    assert not torch.equal(module.lin.weight.float(), before.float())


# -- errors ---------------------------------------------------------------------------------------------

def test_lora_for_another_model_is_a_user_error(tmp_path, files):
    wider = tiny_qwen_transformer(TinyQwenImageSpec(num_attention_heads=4))  # same names, other shapes
    with pytest.raises(UserError) as e:
        fuse_lora(wider, load_lora_file(files["difftune"]), component="dit")
    msg = str(e.value)
    assert str(files["difftune"]) in msg and "lora_A.weight" in msg and "another model" in msg and "\n" not in msg
    # keys of another architecture (Wan block names)
    wan = tmp_path / "wan.safetensors"
    save_file({"diffusion_model.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 32),
               "diffusion_model.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(32, 4)}, wan)
    with pytest.raises(UserError, match=r"wan\.safetensors: 1 of 1 LoRA modules match no Linear.*"
                                        r"diffusion_model\.blocks\.0\.attn1\.to_q\.lora_A\.weight"):
        load_lora_file(wan, resolve_against=tiny_qwen_transformer(SPEC))


def test_unreadable_or_foreign_files_are_refused(tmp_path):
    pickled = tmp_path / "lora.pt"
    torch.save({"x.lora_A.weight": torch.zeros(1, 1)}, pickled)
    with pytest.raises(UserError, match="lora.pt: pickled"):
        load_lora_file(pickled)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    with pytest.raises(UserError, match="garbage.safetensors: not a safetensors file"):
        load_lora_file(garbage)
    full = tmp_path / "full.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.weight": torch.zeros(2, 2)}, full)
    with pytest.raises(UserError, match=r"full.safetensors: not a LoRA file .*to_q\.weight"):
        load_lora_file(full)
    with pytest.raises(UserError, match="no such LoRA file"):
        load_lora_file(tmp_path / "missing.safetensors")


# -- text encoder ---------------------------------------------------------------------------------------

def test_text_encoder_lora_round_trips(parts, adapted, tmp_path):
    tok = parts["tokenizer"]
    te = tiny_qwen_text_encoder(SPEC, tok)
    config = inject_lora(te, ["q_proj", "k_proj", "v_proj", "o_proj"], RANK, ALPHA)
    randomize(te, seed=2)
    ids = tok("a cat", return_tensors="pt").input_ids
    expected = te.model.language_model(input_ids=ids).last_hidden_state
    path = save_lora(tmp_path / "both.safetensors", {"dit": adapted["sd"], "text_encoder": lora_state_dict(te)},
                     {"dit": adapted["config"], "text_encoder": config})
    imported = load_lora_file(path)
    assert set(imported.components) == {"transformer", "text_encoder"}
    fresh = tiny_qwen_text_encoder(SPEC, tok)
    load_lora_into(fresh, imported, component="text_encoder")
    assert diff(fresh.model.language_model(input_ids=ids).last_hidden_state, expected) <= TOL
    with pytest.raises(UserError, match="several"):
        fuse_lora(tiny_qwen_text_encoder(SPEC, tok), imported)  # which component is meant must be said


def test_a_variant_pipeline_class_gives_its_own_target_aliases():
    """`--lora_target_modules` in the reference's names expand through the family's aliases, unless the pipeline
    class (a variant whose model in that slot names its modules otherwise) gives its own."""
    from types import SimpleNamespace

    from difftune.training.module import lora_targets

    family = SimpleNamespace(lora_target_aliases={"dit": {"q": "attn1.to_q"}})
    plain = SimpleNamespace(spec=family, lora_target_aliases=None)
    variant = SimpleNamespace(spec=family, lora_target_aliases={"dit": {"q": "self_attn.to_q"}})
    assert lora_targets(plain, "dit", ["q", "proj"]) == ["attn1.to_q", "proj"]
    assert lora_targets(variant, "dit", ["q", "proj"]) == ["self_attn.to_q", "proj"]
    assert lora_targets(variant, "vae", ["q"]) == ["q"]  # the variant's table replaces the family's


def _lora_file(path, alpha=4.0, bad=None):
    g = torch.Generator().manual_seed(0)
    tensors = {"diffusion_model.blocks.0.attn.to_q.lora_down.weight": torch.randn(4, 16, generator=g),
               "diffusion_model.blocks.0.attn.to_q.lora_up.weight": torch.randn(16, 4, generator=g),
               "diffusion_model.blocks.0.attn.to_q.alpha": torch.tensor(alpha)}
    if bad:
        tensors[bad] = tensors[bad].clone()
        tensors[bad].view(-1)[0] = float("nan")
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("bad", ["diffusion_model.blocks.0.attn.to_q.alpha",
                                 "diffusion_model.blocks.0.attn.to_q.lora_up.weight"])
def test_nan_in_a_lora_file_names_the_tensor(tmp_path, bad):
    load_lora_file(_lora_file(tmp_path / "ok.safetensors"))
    path = _lora_file(tmp_path / "bad.safetensors", bad=bad)
    with pytest.raises(UserError) as err:
        load_lora_file(path)
    assert str(err.value) == f"{path}: tensor '{bad}' holds 1 NaN and 0 infinite value(s)"
