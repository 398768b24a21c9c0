"""Quantisation and offload flags that contradict each other or do nothing (issue 48): one line naming the flags,
before a run trains something other than what it was told."""

import json
import re

import pytest

from conftest import LORA_TARGETS, make_image_dataset, run_train, setup_run
from difftune.errors import UserError
from support import tiny_qwen_image_paths


def args(repo, tmp_path, *extra):
    meta = make_image_dataset(tmp_path / "data", n=1, size=(32, 32))
    paths = tiny_qwen_image_paths(repo)
    return ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 1024,
            "--model_paths", json.dumps([paths["transformer"], paths["text_encoder"], paths["vae"][0]]),
            "--torch_dtype", "float32", "--learning_rate", 1e-3, "--no_progress", "--output_path", tmp_path / "out",
            *extra]


LORA = ("--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4)


def one_line(err, message):
    assert "\n" not in str(err.value) and message in str(err.value), str(err.value)


def test_a_split_threshold_without_model_offload_is_refused(tiny_repo, tmp_path):
    """It did nothing, silently."""
    with pytest.raises(UserError) as err:
        setup_run(*args(tiny_repo, tmp_path, *LORA, "--cpu_offload_split_threshold", 64))
    one_line(err, "--cpu_offload_split_threshold 64: it sets how model offload streams a block, and no model is "
                  "offloaded; add --enable_model_cpu_offload or --blocks_to_swap N, or drop it")
    setup_run(*args(tiny_repo, tmp_path, *LORA, "--cpu_offload_split_threshold", 64, "--blocks_to_swap", 1))


def test_one_model_quantised_two_ways_is_refused_naming_both(tiny_repo, tmp_path):
    """The later entry won, the other was dropped silently."""
    dit = tiny_repo / "transformer"
    with pytest.raises(UserError) as err:
        setup_run(*args(tiny_repo, tmp_path, *LORA, "--quant_options",
                        f"{dit}:bitsandbytes_nf4;{dit}:torchao_int8_w8a16"))
    one_line(err, f"{dit}:bitsandbytes_nf4 and {dit}:torchao_int8_w8a16); give one method per model")
    assert re.search(r"--quant_options: .* is quantised twice", str(err.value))


def test_quant_options_and_fp8_models_on_one_model_are_refused_naming_both_flags(tiny_repo, tmp_path):
    """`--fp8_models dit` (a slot) made every Linear fp8 and the quantisation found none to quantise."""
    dit = tiny_repo / "transformer"
    with pytest.raises(UserError) as err:
        setup_run(*args(tiny_repo, tmp_path, *LORA, "--fp8_models", "dit", "--quant_options",
                        f"{dit}:torchao_int8_w8a16"))
    one_line(err, ":torchao_int8_w8a16 and --fp8_models dit name the same model (dit); choose one storage")
    assert str(err.value).startswith(f"--quant_options {dit}")


def test_full_training_of_an_int8_model_names_int8(tiny_repo, tmp_path):
    """It said '4-bit weights cannot be trained'."""
    with pytest.raises(UserError) as err:
        run_train(*args(tiny_repo, tmp_path, "--trainable_models", "dit", "--quant_options",
                        f"{tiny_repo / 'transformer'}:torchao_int8_w8a16"))
    one_line(err, "--quant_options: dit is also in --trainable_models; int8 weights (torchao_int8_w8a16) cannot be "
                  "trained")


def test_model_offload_with_full_training_says_the_model_is_trained(tiny_repo, tmp_path):
    """It said the model 'has no list of repeated blocks'."""
    with pytest.raises(UserError) as err:
        run_train(*args(tiny_repo, tmp_path, "--trainable_models", "dit", "--enable_model_cpu_offload"))
    one_line(err, "--enable_model_cpu_offload: dit is trained in full (--trainable_models dit), and model offload "
                  "streams frozen weights only")


def test_a_split_threshold_below_a_module_whose_forward_reads_its_norms_weights_trains_the_same():
    """Z-Image's attention reads `norm_q.weight` / `norm_k.weight` without calling the norms: split into its
    children, the norms' weights were placeholders when read (a shape error). A split module's non-layer children
    (norms) now go with its own unit."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from difftune.training.offload import ModelOffloader

    class Attention(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.to_q, self.to_k = nn.Linear(d, d), nn.Linear(d, d)
            self.norm_q, self.norm_k = nn.RMSNorm(d), nn.RMSNorm(d)

        def forward(self, x):  # the norms' weights read directly, as a fused processor does
            q, k = self.to_q(x), self.to_k(x)
            return q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_q.weight + \
                k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_k.weight

    class Model(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(Attention(d), nn.Linear(d, d)) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = x + checkpoint(block, x, use_reentrant=False)
            return x

    def build():
        from peft import LoraConfig, inject_adapter_in_model

        torch.manual_seed(0)
        model = Model()
        for norm in (m for m in model.modules() if isinstance(m, nn.RMSNorm)):
            nn.init.normal_(norm.weight)
        model.requires_grad_(False)
        return inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"], init_lora_weights=False), model)

    x = torch.randn(2, 5, 16)
    plain, off = build(), build()
    offloader = ModelOffloader(off, "cpu", split_threshold_mb=1e-9)
    grads = []
    for model in (plain, off):
        model(x).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    assert all(g.abs().max() > 0 for g in grads[1].values())
    assert {u.name for u in offloader.units if u.block == 0} == {
        "blocks.0.0", "blocks.0.0.to_q.base_layer", "blocks.0.0.to_k", "blocks.0.1"}  # the norms with their module
