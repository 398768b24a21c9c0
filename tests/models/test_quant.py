"""`--quant_options` (QLoRA): frozen Linear weights in NF4 through bitsandbytes, a LoRA trained on top."""

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from conftest import LORA_TARGETS, make_image_dataset, run_train
from difftune.errors import UserError
from difftune.models import ModelConfig
from difftune.models.quant import QuantOption, parse_quant_options
from support import TinyQwenImageSpec, tiny_qwen_image_paths, write_tiny_qwen_image

SCRIPT = (Path(__file__).resolve().parents[1] / "reference_scripts" / "qwen_image" / "model_training" / "special" / "quant_training"
          / "Qwen-Image-2512-bitsandbytes_nf4.sh")
KEEP = ("img_mod.1", "txt_mod.1", "norm_out.linear", "img_in", "txt_in", "proj_out", "timestep_embedder.linear_1",
        "timestep_embedder.linear_2")


def test_the_reference_scripts_option_parses():
    tokens = shlex.split(SCRIPT.read_text().replace("\\\n", " "))
    value = tokens[tokens.index("--quant_options") + 1]
    assert parse_quant_options(value) == [
        ("Qwen/Qwen-Image-2512:transformer/diffusion_pytorch_model*.safetensors", QuantOption("bitsandbytes_nf4", KEEP))]
    assert parse_quant_options("a.safetensors:bitsandbytes_nf4;b.safetensors:bitsandbytes_fp4/x") == [
        ("a.safetensors", QuantOption("bitsandbytes_nf4")), ("b.safetensors", QuantOption("bitsandbytes_fp4", ("x",)))]


@pytest.mark.parametrize("value, message", [
    ("dit.safetensors:int3", "--quant_options: unknown method 'int3' for dit.safetensors (known: bitsandbytes_nf4"),
    ("bitsandbytes_nf4", "--quant_options: 'bitsandbytes_nf4' is not <model entry>:<method>"),
    ("elsewhere.safetensors:bitsandbytes_nf4", "--quant_options: 'elsewhere.safetensors' matches no entry of"),
])
def test_bad_quant_options_are_one_line_errors(tiny_repo, value, message):
    from difftune.models import parse_model_configs

    paths = tiny_qwen_image_paths(tiny_repo)
    with pytest.raises(UserError, match=re.escape(message)) as err:
        parse_model_configs(json.dumps([paths["vae"][0]]), quant_options=value)
    assert "\n" not in str(err.value)


def test_missing_bitsandbytes_is_one_line_naming_what_to_install(tiny_repo, monkeypatch):
    from difftune.families.qwen_image.components import DIT
    from difftune.models import load_component

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    config = ModelConfig(str(tiny_repo / "transformer"), quant=QuantOption("bitsandbytes_nf4"))
    with pytest.raises(UserError, match=re.escape("--quant_options needs bitsandbytes, which is not installed: "
                                                  "pip install 'difftune[quant]' (bitsandbytes)")):
        load_component(config, [DIT], torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def quant_repo(tmp_path_factory):
    """Layers 64 wide: bitsandbytes' CPU inference path packs weights in blocks of 64 input features."""
    spec = TinyQwenImageSpec(attention_head_dim=32, axes_dims_rope=(8, 12, 12))
    return write_tiny_qwen_image(tmp_path_factory.mktemp("quant"), spec)


def test_linears_become_nf4_except_the_kept_ones(quant_repo, bnb):
    from difftune.families.qwen_image.components import DIT
    from difftune.models import load_component

    plain = load_component(ModelConfig(str(quant_repo / "transformer")), [DIT], torch_dtype=torch.float32).module
    config = ModelConfig(str(quant_repo / "transformer"), quant=QuantOption("bitsandbytes_nf4", KEEP))
    quant = load_component(config, [DIT], torch_dtype=torch.float32).module
    kept, four_bit = [], []
    for name, module in quant.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            four_bit.append(name)
            assert module.weight.dtype == torch.uint8 and module.weight.quant_state.quant_type == "nf4"
        elif type(module) is torch.nn.Linear:
            kept.append(name)
            assert module.weight.dtype == torch.float32
            assert torch.equal(module.weight, plain.get_submodule(name).weight)  # full precision, untouched
    assert sorted(kept) == sorted(n for n, m in plain.named_modules() if type(m) is torch.nn.Linear
                                  and any(n == k or n.endswith("." + k) for k in KEEP))
    assert "img_in" in kept and "transformer_blocks.0.img_mod.1" in kept and "transformer_blocks.0.attn.to_q" in four_bit
    assert len(four_bit) == 2 * 12  # per block: 6 projections, 2 outputs, 2 MLPs of 2; 2 blocks
    # NF4 keeps the weights to a few percent: the layer's output stays close to the full-precision one
    x = torch.randn(3, quant.transformer_blocks[0].attn.to_q.in_features)
    with torch.no_grad():  # eval mode: bitsandbytes' CPU inference kernel
        full, nf4 = plain.transformer_blocks[0].attn.to_q(x), quant.transformer_blocks[0].attn.to_q(x)
    assert 0 < ((full - nf4).norm() / full.norm()).item() < 0.2
    with pytest.raises(UserError, match="layer.s. to keep in full precision nope match no module"):
        load_component(ModelConfig(str(quant_repo / "transformer"), quant=QuantOption("bitsandbytes_nf4", ("nope",))),
                       [DIT], torch_dtype=torch.float32)


def _qlora_args(repo, meta, out, *extra):
    paths = tiny_qwen_image_paths(repo)
    return ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
            "--model_paths", json.dumps([paths["transformer"], paths["text_encoder"], paths["vae"][0]]),
            "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4,
            "--learning_rate", 1e-3, "--num_epochs", 2, "--output_path", out, "--torch_dtype", "float32",
            "--use_gradient_checkpointing", *extra]


def test_qlora_trains_and_its_lora_loads_into_the_unquantised_model(quant_repo, tmp_path, bnb):
    from safetensors.torch import load_file

    from difftune.families.qwen_image import QwenImagePipeline

    meta = make_image_dataset(tmp_path / "data", n=2)
    option = f"{quant_repo / 'transformer'}:bitsandbytes_nf4/{','.join(KEEP)}"
    summary = run_train(*_qlora_args(quant_repo, meta, tmp_path / "out", "--quant_options", option))
    losses = summary["losses"]
    assert len(losses) == 4 and all(0 < v < 10 for v in losses) and len(set(losses)) == 4
    lora = load_file(str(tmp_path / "out" / "epoch-1.safetensors"))
    b = "diffusion_model.transformer_blocks.0.attn.to_q.lora_B.weight"  # on a 4-bit layer
    assert b in lora and lora[b].abs().max().item() > 0  # B starts at zero: it trained
    assert "diffusion_model.transformer_blocks.0.img_mod.1.lora_B.weight" in lora  # and on a kept layer
    # the file loads into the full-precision model: each weight moves by B @ A (alpha = rank)
    pipe = QwenImagePipeline.from_pretrained(torch_dtype=torch.float32,
                                             model_configs=[ModelConfig(str(quant_repo / "transformer"))])
    before = pipe.dit.transformer_blocks[0].attn.to_q.weight.detach().clone()
    pipe.load_lora(pipe.dit, str(tmp_path / "out" / "epoch-1.safetensors"))
    a = lora["diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight"]
    delta = pipe.dit.transformer_blocks[0].attn.to_q.weight - before
    assert torch.allclose(delta, lora[b].float() @ a.float(), atol=1e-6) and delta.abs().max() > 0


def test_full_training_of_a_quantised_model_is_refused(quant_repo, tmp_path, bnb):
    meta = make_image_dataset(tmp_path / "data", n=1)
    args = _qlora_args(quant_repo, meta, tmp_path / "out", "--quant_options", f"{quant_repo / 'transformer'}:bitsandbytes_nf4")
    at = args.index("--lora_base_model")
    args[at:at + 6] = ["--trainable_models", "dit"]
    with pytest.raises(UserError, match=re.escape("--quant_options: dit is also in --trainable_models; 4-bit weights "
                                                  "(bitsandbytes_nf4) cannot be")):
        run_train(*args)


def test_a_quantised_stage_1_model_is_part_of_the_cache_fingerprint(tiny_repo, tmp_path):
    from conftest import setup_run

    from difftune.models import parse_model_configs
    from difftune.training.stage1 import stage1_fingerprint

    paths = tiny_qwen_image_paths(tiny_repo)
    meta = make_image_dataset(tmp_path / "data", n=1)
    run = setup_run("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--lora_base_model", "dit",
                    "--task", "sft:data_process", "--output_path", tmp_path / "cache", "--model_paths",
                    json.dumps([paths["text_encoder"]]))
    models = json.dumps([paths["text_encoder"]])

    def fingerprint(quant):
        configs = parse_model_configs(models, quant_options=quant)
        return stage1_fingerprint(run.replace(models=[("text_encoder", c) for c in configs]))

    plain, nf4 = fingerprint(None), fingerprint(f"{tiny_repo / 'text_encoder'}:bitsandbytes_nf4/lm_head")
    assert "storage" not in plain and nf4["storage"] == {"text_encoder": "bitsandbytes_nf4/lm_head"}


@pytest.mark.slow
def test_the_reference_nf4_script_trains(tmp_path, monkeypatch, bnb):
    """special/quant_training/Qwen-Image-2512-bitsandbytes_nf4.sh unchanged (`difftune train` for its launcher,
    two steps) on tiny models where its hub ids resolve: the LoRA file is written, with LoRA on 4-bit layers."""
    import shutil

    from safetensors.torch import load_file

    text = SCRIPT.read_text().replace("\\\n", " ")
    tokens = shlex.split(next(ln for ln in text.splitlines() if ln.startswith("accelerate launch")))
    args = tokens[next(i for i, t in enumerate(tokens) if t.endswith("train.py")) + 1:]
    repo = write_tiny_qwen_image(tmp_path / "models" / "Qwen" / "Qwen-Image")
    shutil.copytree(repo / "transformer", tmp_path / "models" / "Qwen" / "Qwen-Image-2512" / "transformer")
    make_image_dataset(tmp_path / "data" / "diffsynth_example_dataset" / "qwen_image" / "Qwen-Image-2512", n=2)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(tmp_path / "models"))
    args[args.index("--dataset_num_workers") + 1] = "0"
    run_train(*args, "--max_steps", "2", "--max_pixels", "4096", "--torch_dtype", "float32")
    out = tmp_path / args[args.index("--output_path") + 1]
    lora = load_file(str(next(out.glob("*.safetensors"))))
    assert "diffusion_model.transformer_blocks.0.attn.to_q.lora_B.weight" in lora
    assert lora["diffusion_model.transformer_blocks.0.attn.to_q.lora_B.weight"].abs().max() > 0


# -- torchao weight-only methods -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ao():
    return pytest.importorskip("torchao")


@pytest.mark.parametrize("value, message", [
    ("dit.safetensors:torchao_int8_w8a8", "--quant_options: torchao_int8_w8a8 for dit.safetensors: it quantises the "
                                          "activations too"),
    ("dit.safetensors:comfy_kitchen_fp8_w8a8", "--quant_options: comfy_kitchen_fp8_w8a8 for dit.safetensors: "
                                               "comfy-kitchen is not supported"),
])
def test_methods_that_cannot_train_a_lora_are_refused_naming_why(value, message):
    with pytest.raises(UserError, match=re.escape(message)) as err:
        parse_quant_options(value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method, weight", [("torchao_int8_w8a16", "Int8Tensor"), ("torchao_fp8_w8a16", "Float8Tensor")])
def test_torchao_weight_only_layers_pass_gradients(ao, method, weight):
    from difftune.models.quant import quantize_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    x = torch.randn(4, 64)
    full = model(x).detach()
    assert quantize_linears(model, QuantOption(method, ("2",)), torch.float32) == ["0"]
    assert type(model[0].weight).__name__ == weight and type(model[2].weight) is torch.nn.Parameter  # "2" kept
    x.requires_grad_(True)
    out = model(x)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().max() > 0
    assert 0 < ((out - full).norm() / full.norm()).item() < 0.05


def test_torchao_int8_lora_trains_and_loads_in_diffusers_with_every_key_used(quant_repo, tmp_path, ao, capsys):
    from diffusers import QwenImagePipeline as DiffusersQwenImage, QwenImageTransformer2DModel
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file

    meta = make_image_dataset(tmp_path / "data", n=2)
    option = f"{quant_repo / 'transformer'}:torchao_int8_w8a16/{','.join(KEEP)}"
    summary = run_train(*_qlora_args(quant_repo, meta, tmp_path / "out", "--quant_options", option,
                                     "--enable_model_cpu_offload"))
    assert "model offload: dit" in capsys.readouterr().out  # int8 weights stay resident, the rest streams
    losses = summary["losses"]
    assert len(losses) == 4 and all(0 < v < 10 for v in losses) and len(set(losses)) == 4
    path = tmp_path / "out" / "epoch-1.safetensors"
    lora = load_file(str(path))
    b = "diffusion_model.transformer_blocks.0.attn.to_q.lora_B.weight"  # on an int8 layer
    assert b in lora and lora[b].abs().max().item() > 0
    # diffusers reads the file (its own key conversion) onto the full-precision transformer: every LoRA of the
    # file becomes a LoRA layer with the file's B @ A
    transformer = QwenImageTransformer2DModel.from_pretrained(str(quant_repo / "transformer"))
    state = DiffusersQwenImage.lora_state_dict(str(path))
    transformer.load_lora_adapter(state, prefix="transformer", adapter_name="file")
    layers = {n: m for n, m in transformer.named_modules() if isinstance(m, LoraLayer) and "file" in m.lora_A}
    in_file = {k[len("diffusion_model."):-len(".lora_A.weight")] for k in lora if k.endswith(".lora_A.weight")}
    assert set(layers) == in_file and len(in_file) > 10
    for name, layer in layers.items():
        want = lora[f"diffusion_model.{name}.lora_B.weight"].float() @ lora[f"diffusion_model.{name}.lora_A.weight"].float()
        assert torch.allclose(layer.get_delta_weight("file").float(), want, atol=1e-6)


@pytest.mark.parametrize("keys, layout", [
    (["blocks.0.attn.to_q.weight", "blocks.0.attn.to_q.weight.absmax", "blocks.0.attn.to_q.weight.quant_map",
      "blocks.0.attn.to_q.weight.quant_state.bitsandbytes__nf4"], "a bitsandbytes 4-bit save"),
    (["scaled_fp8", "blocks.0.attn.to_q.weight", "blocks.0.attn.to_q.scale_weight"], "a ComfyUI fp8_scaled checkpoint"),
])
def test_pre_quantised_checkpoints_are_refused_in_one_line(tmp_path, keys, layout):
    """Files with the names of a bitsandbytes / fp8_scaled save but not their contents (zeros: no quant state
    record, no fp8 weight) are refused in one line; whole ones load (tests/models/test_prequant.py)."""
    from safetensors.torch import save_file

    from difftune.models.detect import check_files

    path = tmp_path / "dit.safetensors"
    save_file({k: torch.zeros(2, dtype=torch.uint8) for k in keys}, str(path))
    with pytest.raises(UserError, match=re.escape(f"{path}: {layout}")) as err:
        check_files([str(path)])
    assert "\n" not in str(err.value) and "--quant_options" in str(err.value)
