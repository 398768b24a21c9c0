"""FLUX.1's fused LoRA targets: the reference's `a_to_qkv`, `b_to_qkv` and `to_qkv_mlp` are one Linear each in its
model (DiffSynth-Studio fed7b18, diffsynth/models/flux_dit.py: `a_to_qkv = Linear(dim, 3 dim)`, `to_qkv_mlp =
Linear(dim, 7 dim)`), and peft gives each one adapter: one lora_A of rank r, one lora_B over the fused output. Given
those names, difftune trains that shape on diffusers' separate to_q / to_k / to_v (+ proj_mlp): one lora_A shared
by the parts, one lora_B whose rows are theirs; `to_q,to_k,to_v` keep three adapters."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from difftune.families.flux import FAMILY, FluxImagePipeline
from difftune.families.flux.components import LORA_TARGET_MODULES
from difftune.models import ModelConfig
from difftune.training.module import DiffusionTrainingModule
from support import tiny_flux_paths, write_tiny_flux

# examples/flux/model_training/lora/FLUX.1-dev.sh
REFERENCE_TARGETS = ("a_to_qkv,b_to_qkv,ff_a.0,ff_a.2,ff_b.0,ff_b.2,a_to_out,b_to_out,proj_out,norm.linear,"
                     "norm1_a.linear,norm1_b.linear,to_qkv_mlp")
FUSED = {"attn.to_q": "a", "attn.to_k": "a", "attn.to_v": "a", "attn.add_q_proj": "b", "attn.add_k_proj": "b",
         "attn.add_v_proj": "b"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux"), shard=False)


def fresh_pipe(repo):
    paths = tiny_flux_paths(repo)
    return FluxImagePipeline.from_pretrained(
        torch_dtype=torch.float32, device="cpu",
        model_configs=[ModelConfig(p if len(p) > 1 else p[0]) for p in paths.values()],
        tokenizer_1_config=ModelConfig(str(repo / "tokenizer")),
        tokenizer_2_config=ModelConfig(str(repo / "tokenizer_2")))


def trained_module(repo, targets, rank=4, alpha=None, checkpoint=None):
    module = DiffusionTrainingModule()
    module.switch_pipe_to_training_mode(fresh_pipe(repo), lora_base_model="dit", lora_target_modules=targets,
                                        lora_rank=rank, lora_alpha=alpha, lora_checkpoint=checkpoint)
    return module


def reference_shapes(dim=32, rank=4):
    """The reference's LoRA tensors on the tiny FLUX (1 double, 1 single block, width 32) for REFERENCE_TARGETS:
    (in, out) of each of its Linear layers it names, as its FluxDiT builds them."""
    double = {"a_to_qkv": (dim, 3 * dim), "b_to_qkv": (dim, 3 * dim), "a_to_out": (dim, dim),
              "b_to_out": (dim, dim), "ff_a.0": (dim, 4 * dim), "ff_a.2": (4 * dim, dim), "ff_b.0": (dim, 4 * dim),
              "ff_b.2": (4 * dim, dim), "norm1_a.linear": (dim, 6 * dim), "norm1_b.linear": (dim, 6 * dim)}
    single = {"to_qkv_mlp": (dim, 7 * dim), "proj_out": (5 * dim, dim), "norm.linear": (dim, 3 * dim)}
    shapes = []
    for i, o in [*double.values(), *single.values()]:
        shapes += [(rank, i), (o, rank)]
    return sorted(shapes)


def test_reference_targets_train_the_reference_shape(repo):
    """26 tensors / 8,192 parameters at rank 4 (the reference's), each of a reference module's shape; diffusers'
    separate names keep three adapters (40 / 9,088)."""
    module = trained_module(repo, REFERENCE_TARGETS)
    params = module.trainable_modules()
    assert len(reference_shapes()) == 26 and sum(a * b for a, b in reference_shapes()) == 8192
    assert len(params) == 26
    assert sum(p.numel() for p in params) == 8192
    assert sorted(tuple(p.shape) for p in params) == reference_shapes()
    # the reference's initialisation (peft's default): lora_A kaiming-uniform, bound 1/sqrt(in); lora_B zero
    dit = module.pipe.models["dit"]
    q, k, v = (dit.get_submodule(f"transformer_blocks.0.attn.{n}") for n in ("to_q", "to_k", "to_v"))
    assert q.lora_A["default"] is k.lora_A["default"] is v.lora_A["default"]
    a = q.lora_A["default"].weight
    assert a.abs().max().item() <= 1 / math.sqrt(32) and a.abs().max().item() > 0.5 / math.sqrt(32)
    assert all(torch.count_nonzero(p).item() == 0 for n, p in module.named_parameters()
               if p.requires_grad and ".lora_B." in n)

    separate = trained_module(repo, LORA_TARGET_MODULES)
    params = separate.trainable_modules()
    assert (len(params), sum(p.numel() for p in params)) == (40, 9088)


class _Rows(nn.Module):
    """One of diffusers' q / k / v (/ mlp) Linear layers as rows of the reference's fused layer."""

    def __init__(self, fused, start, stop):
        super().__init__()
        self.__dict__["fused"] = fused  # not a submodule: its parameters are the holder's
        self.start, self.stop = start, stop

    def forward(self, x):
        return self.fused(x)[..., self.start:self.stop]


def _reference_model(dit):
    """A copy of the tiny DiT whose q/k/v (+ mlp) are the reference's fused Linear layers with peft's LoRA on
    each (the reference's `inject_adapter_in_model(LoraConfig(r, alpha, target_modules))`)."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    ref = copy.deepcopy(dit)
    holder = nn.Module()
    groups = {}
    for i, block in enumerate(ref.transformer_blocks):
        groups[f"a{i}"] = (block.attn, ("to_q", "to_k", "to_v"))
        groups[f"b{i}"] = (block.attn, ("add_q_proj", "add_k_proj", "add_v_proj"))
    for i, block in enumerate(ref.single_transformer_blocks):
        groups[f"s{i}"] = (block, ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
    for name, (owner, parts) in groups.items():
        layers = [owner.get_submodule(p) for p in parts]
        fused = nn.Linear(layers[0].in_features, sum(m.out_features for m in layers))
        with torch.no_grad():
            fused.weight.copy_(torch.cat([m.weight for m in layers]))
            fused.bias.copy_(torch.cat([m.bias for m in layers]))
        setattr(holder, name, fused)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=list(groups)), holder)
    for name, (owner, parts) in groups.items():
        start = 0
        for p in parts:
            layer = owner.get_submodule(p)
            parent, _, leaf = p.rpartition(".")
            setattr(owner.get_submodule(parent) if parent else owner, leaf,
                    _Rows(getattr(holder, name), start, start + layer.out_features))
            start += layer.out_features
    return ref, holder, groups


def _dit_inputs():
    g = torch.Generator().manual_seed(3)
    return dict(hidden_states=torch.randn(1, 4, 64, generator=g), encoder_hidden_states=torch.randn(1, 3, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.7]),
                guidance=torch.tensor([3.5]), img_ids=torch.randn(4, 3, generator=g), txt_ids=torch.zeros(3, 3),
                return_dict=False)


def test_one_step_update_equals_the_reference_fused_adapter(repo):
    """Two AdamW steps on difftune's shared-A adapters and on the reference's fused layers with peft's LoRA, from
    the same A and B: the gradients and the updated A and fused B agree."""
    module = trained_module(repo, "a_to_qkv,b_to_qkv,to_qkv_mlp", alpha=8)
    dit = module.pipe.models["dit"]
    with torch.no_grad():  # a non-zero B, so A's gradient is not zero either
        for n, p in dit.named_parameters():
            if p.requires_grad and ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    base = dit.get_base_model() if hasattr(dit, "get_base_model") else dit
    from peft.tuners.lora import LoraLayer

    plain = __import__("copy").deepcopy(base)
    for name, m in list(plain.named_modules()):  # the base weights only, for the reference's copy
        if isinstance(m, LoraLayer):
            parent, _, leaf = name.rpartition(".")
            setattr(plain.get_submodule(parent), leaf, m.get_base_layer())
    ref, holder, groups = _reference_model(plain)

    def ours_of(name):
        owner, parts = groups[name]
        prefix = {"a": "transformer_blocks", "b": "transformer_blocks", "s": "single_transformer_blocks"}[name[0]]
        stem = f"{prefix}.{name[1:]}." + ("attn." if name[0] != "s" else "")
        layers = [dit.get_submodule(stem + p) for p in parts]
        return layers[0].lora_A["default"].weight, torch.cat([m.lora_B["default"].weight for m in layers])

    with torch.no_grad():
        for name in groups:
            a, b = ours_of(name)
            getattr(holder, name).lora_A["default"].weight.copy_(a)
            getattr(holder, name).lora_B["default"].weight.copy_(b)
    start = ours_of("a0")[0].detach().clone()
    ref_params = [p for n, p in holder.named_parameters() if "lora_" in n]
    for p in ref.parameters():
        p.requires_grad_(False)
    for p in ref_params:
        p.requires_grad_(True)
    ours_opt = torch.optim.AdamW(module.trainable_modules(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    target = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(9))
    for _ in range(2):
        for model, opt in ((dit, ours_opt), (ref, ref_opt)):
            opt.zero_grad()
            loss = ((model(**_dit_inputs())[0] - target) ** 2).mean()
            loss.backward()
            opt.step()
    worst = 0.0
    for name in groups:
        a, b = ours_of(name)
        worst = max(worst, (a - getattr(holder, name).lora_A["default"].weight).abs().max().item(),
                    (b - getattr(holder, name).lora_B["default"].weight).abs().max().item())
    assert worst <= 1e-6, worst
    assert (ours_of("a0")[0] - start).abs().max().item() > 1e-3  # A moved too


def _fused_delta(weights: dict, stem: str, parts) -> torch.Tensor:
    return torch.cat([weights[f"{stem}.{p}.weight"] for p in parts])


def test_saved_fused_lora_loads_in_diffusers_at_the_trained_strength(repo, tmp_path):
    """The diffusers-layout file of a run on the reference's targets: to_q / to_k / to_v share one lora_A; diffusers'
    FluxPipeline.load_lora_weights uses every key, and the fused update of each q/k/v group has the reference's rank
    (4, where three adapters give up to 12), equal to (alpha/r) B A of the trained adapter."""
    from safetensors.torch import load_file

    from conftest import run_train
    from diffusers import FluxPipeline
    from support import write_example_dataset

    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
              "--learning_rate", 1e-2, "--max_steps", 2, "--seed", 5, "--no_progress", "--enable_tensorboard_log",
              "false", "--max_pixels", 1024, "--lora_base_model", "dit", "--lora_target_modules", REFERENCE_TARGETS,
              "--lora_rank", 4, "--lora_alpha", 8)
    path = next((tmp_path / "out").glob("*.safetensors"))
    saved = load_file(str(path))
    assert len(saved) == 40  # 20 of diffusers' modules
    stem = "transformer.transformer_blocks.0.attn"
    a = saved[f"{stem}.to_q.lora_A.weight"]
    assert torch.equal(a, saved[f"{stem}.to_k.lora_A.weight"]) and torch.equal(a, saved[f"{stem}.to_v.lora_A.weight"])
    s = "transformer.single_transformer_blocks.0"
    assert all(torch.equal(saved[f"{s}.attn.to_q.lora_A.weight"], saved[k]) for k in
               (f"{s}.attn.to_k.lora_A.weight", f"{s}.attn.to_v.lora_A.weight", f"{s}.proj_mlp.lora_A.weight"))

    pipe = FluxPipeline.from_pretrained(str(repo), dtype=torch.float32)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    import logging

    import diffusers

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    level = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_warning()
    logging.getLogger("diffusers").addHandler(handler)
    try:
        pipe.load_lora_weights(str(path), adapter_name="ours")
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
        diffusers.utils.logging.set_verbosity(level)
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert [w for w in warned if "safe to ignore if LoRA state dict didn't originally have any" not in w] == []
    loaded = {k: v for k, v in pipe.transformer.state_dict().items() if ".lora_" in k}
    as_file = {"transformer." + k.replace(".ours.", "."): v for k, v in loaded.items()}
    assert as_file.keys() == saved.keys() and all(torch.equal(as_file[k], saved[k]) for k in saved)
    pipe.fuse_lora(adapter_names=["ours"], lora_scale=1.0)
    pipe.unload_lora_weights()
    after = pipe.transformer.state_dict()
    for block, parts in (("transformer_blocks.0.attn", ("to_q", "to_k", "to_v")),
                         ("transformer_blocks.0.attn", ("add_q_proj", "add_k_proj", "add_v_proj")),
                         ("single_transformer_blocks.0", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))):
        delta = _fused_delta(after, block, parts) - _fused_delta(before, block, parts)
        up = torch.cat([saved[f"transformer.{block}.{p}.lora_B.weight"] for p in parts])  # alpha/r folded in
        by_hand = up @ saved[f"transformer.{block}.{parts[0]}.lora_A.weight"]
        assert (delta - by_hand).abs().max().item() <= 1e-6
        assert torch.linalg.matrix_rank(delta).item() == 4


@pytest.mark.parametrize("layout", ["diffusers", "comfyui", "kohya"])
def test_fused_lora_round_trip_in_every_layout(repo, tmp_path, layout):
    """Written in each layout and read back with --lora_checkpoint: the shared-A form again (26 tensors), the same
    weights; comfyui / kohya hold the fused module's one adapter in BFL's names (rank 4, the reference's shape)."""
    from safetensors.torch import load_file

    from difftune.training.checkpoint import CheckpointSaver

    module = trained_module(repo, REFERENCE_TARGETS, alpha=8)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.05)
    state = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    saver = CheckpointSaver(tmp_path, lora_prefixes=dict(FAMILY.lora_prefixes), lora_format=layout, denoiser="dit",
                            native_names=FAMILY.lora_native_names)
    path, = saver.write(module, state, "lora")
    saved = load_file(str(path))
    if layout != "diffusers":
        prefix = "diffusion_model.double_blocks.0." if layout == "comfyui" else "lora_unet_double_blocks_0_"
        down, up = ("lora_A", "lora_B") if layout == "comfyui" else ("lora_down", "lora_up")
        sep = "." if layout == "comfyui" else "_"
        assert saved[f"{prefix}img_attn{sep}qkv.{down}.weight"].shape == (4, 32)
        assert saved[f"{prefix}img_attn{sep}qkv.{up}.weight"].shape == (96, 4)
        single = prefix.replace("double", "single")
        assert saved[f"{single}linear1.{down}.weight"].shape == (4, 32)
        assert saved[f"{single}linear1.{up}.weight"].shape == (224, 4)
        assert len(saved) == 3 * 13  # 13 modules of the reference, each with an alpha
    back = trained_module(repo, REFERENCE_TARGETS, checkpoint=str(path))
    params = back.trainable_modules()
    assert (len(params), sum(p.numel() for p in params)) == (26, 8192)
    from difftune.lora import lora_state_dict

    ours, theirs = lora_state_dict(module.pipe.models["dit"]), lora_state_dict(back.pipe.models["dit"])
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    assert back.lora_configs["dit"].lora_alpha == 8
