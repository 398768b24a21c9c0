"""The host-overhead options (docs/performance.md) against the default path: LoRA computing in the autocast dtype from
fp32 masters, the lazy loss read-back, the attention backend and the unpadded prompt mask."""

import csv

import pytest
import torch
from safetensors.torch import load_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train
from difftune.errors import UserError

# bf16 against an fp32 run of the same flags, after 4 steps at lr 1e-3: the largest LoRA weight difference allowed
# either way (measured: 7.0e-3 for the per-layer casts and for the master weights; 6.4e-4 between the two)
BF16_BOUND = 1e-2


def train(tmp_path, tiny_repo, name, *extra, dtype="bfloat16", steps=4):
    meta = tmp_path / "data" / "metadata.csv"
    if not meta.is_file():
        make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / name
    from difftune.training.accelerator import reset_accelerate_state

    reset_accelerate_state()  # several runs in one test
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", steps // 2, "--learning_rate", "1e-3", "--model_paths", model_paths_json(tiny_repo),
              "--output_path", out, "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS,
              "--lora_rank", 8, "--torch_dtype", dtype, "--use_gradient_checkpointing", "--no_progress",
              "--enable_csv_log", *map(str, extra))
    return load_file(str(out / "epoch-0.safetensors")), out


def max_diff(a, b):
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture()
def per_tensor_adamw(monkeypatch):
    """The optimizer as before: torch's own choice on the CPU (a loop over the tensors)."""
    import difftune.training.fit as fit

    monkeypatch.setattr(fit, "make_optimizer", lambda params, config, *_: torch.optim.AdamW(
        params, lr=config.learning_rate, weight_decay=config.weight_decay))


def test_fp32_training_is_unchanged(tmp_path, tiny_repo, monkeypatch):
    new, _ = train(tmp_path, tiny_repo, "new", dtype="float32")
    import difftune.training.fit as fit

    monkeypatch.setattr(fit, "make_optimizer", lambda params, config, *_: torch.optim.AdamW(
        params, lr=config.learning_rate, weight_decay=config.weight_decay))
    old, _ = train(tmp_path, tiny_repo, "old", "--lora_compute", "fp32", "--loss_readback_steps", 1,
                   dtype="float32")
    assert max_diff(new, old) <= 1e-6


def test_bf16_master_weights_within_bf16_noise(tmp_path, tiny_repo, monkeypatch):
    ref, _ = train(tmp_path, tiny_repo, "fp32", dtype="float32")
    new, _ = train(tmp_path, tiny_repo, "new")
    import difftune.training.fit as fit

    monkeypatch.setattr(fit, "make_optimizer", lambda params, config, *_: torch.optim.AdamW(
        params, lr=config.learning_rate, weight_decay=config.weight_decay))
    old, _ = train(tmp_path, tiny_repo, "old", "--lora_compute", "fp32")
    assert all(v.dtype == torch.float32 for v in new.values())  # the masters are saved
    d_old, d_new = max_diff(old, ref), max_diff(new, ref)
    print(f"bf16 vs fp32: per-layer casts {d_old:.3g}, master weights {d_new:.3g}, between them {max_diff(new, old):.3g}")
    assert 0 < d_old <= BF16_BOUND and 0 < d_new <= BF16_BOUND, (d_old, d_new)
    assert d_new <= 1.5 * d_old, (d_old, d_new)  # no noisier than the per-layer casts
    assert max_diff(new, old) <= 2 * d_old


def test_compute_copies_gradients_and_refresh():
    """One layer by hand: the copy computes, its gradient lands in the fp32 master (accumulated), the copy follows
    the master after a step, and removing them gives peft's layer back."""
    from difftune.lora import inject_lora
    from difftune.lora.compute import ComputeCopies

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(torch.bfloat16)
    inject_lora(model, ["0"], rank=4, init=False)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
        expected.float().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    copies = ComputeCopies(model, torch.bfloat16)
    assert len(copies) == 2
    for _ in range(2):  # two micro-batches: gradients add up in fp32
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
            out.float().sum().backward()
        copies.collect()
    # the up-projection, scaling and sum round once (one addmm) where peft rounds each: within a bf16 step
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad.dtype == torch.float32 and torch.allclose(p.grad, 2 * want[n], rtol=1e-2, atol=1e-3), n
    with torch.no_grad():
        for p in copies.masters:
            p.add_(1.0)
    copies.refresh()
    assert all(torch.equal(c, m.t().to(torch.bfloat16)) for c, m in zip(copies.copies, copies.masters))
    copies.remove()
    from peft.tuners.lora.layer import Linear as LoraLinear

    assert type(model[0].lora_A["default"]) is torch.nn.Linear and model[0].cast_input_dtype_enabled
    assert type(model[0]) is LoraLinear


def test_bf16_resume_is_exact(tmp_path, tiny_repo):
    full, _ = train(tmp_path, tiny_repo, "full", "--save_state_steps", 2)
    _, out = train(tmp_path, tiny_repo, "parts", "--save_state_steps", 2, "--max_steps", 2)
    resumed, _ = train(tmp_path, tiny_repo, "parts", "--save_state_steps", 2, "--resume_from_checkpoint", "latest")
    assert max_diff(full, resumed) == 0


def test_losses_read_back_in_batches_are_every_steps(tmp_path, tiny_repo):
    _, every = train(tmp_path, tiny_repo, "every", "--loss_readback_steps", 1, dtype="float32", steps=6)
    _, batched = train(tmp_path, tiny_repo, "batched", "--loss_readback_steps", 4, dtype="float32", steps=6)

    def rows(out):
        with open(next(out.glob("**/loss.csv"))) as f:
            return [(r["step"], r["loss"]) for r in csv.DictReader(f)]

    assert rows(every) == rows(batched) and len(rows(every)) == 6


def test_loss_readback_steps_must_be_positive(tmp_path, tiny_repo):
    with pytest.raises(UserError, match="--loss_readback_steps must be at least 1"):
        train(tmp_path, tiny_repo, "zero", "--loss_readback_steps", 0)


def test_attention_backends(tmp_path, tiny_repo):
    from difftune.core.attention import resolve_backend

    assert resolve_backend("auto", "cpu") == "native"
    with pytest.raises(UserError, match="--attention_backend flash: needs a CUDA GPU"):
        resolve_backend("flash", "cpu")
    with pytest.raises(UserError, match="--attention_backend nope: unknown"):
        resolve_backend("nope", "cpu")
    default, _ = train(tmp_path, tiny_repo, "default", dtype="float32", steps=2)
    native, _ = train(tmp_path, tiny_repo, "native", "--attention_backend", "native", dtype="float32", steps=2)
    math, _ = train(tmp_path, tiny_repo, "math", "--attention_backend", "math", dtype="float32", steps=2)
    assert max_diff(default, native) == 0
    assert max_diff(default, math) <= 1e-5


def test_unpadded_prompt_mask_is_dropped_with_equal_results(tiny_repo):
    from diffusers import QwenImageTransformer2DModel

    from difftune.core.attention import unpadded

    ones = torch.ones(1, 7, dtype=torch.long)
    assert unpadded(ones) is None
    padded = torch.tensor([[1, 1, 1, 0]])
    assert unpadded(padded) is padded
    dit = QwenImageTransformer2DModel.from_pretrained(str(tiny_repo / "transformer")).eval()
    torch.manual_seed(0)
    tokens = torch.randn(1, 16, dit.config.in_channels)
    text = torch.randn(1, 7, dit.config.joint_attention_dim)
    kw = dict(hidden_states=tokens, timestep=torch.tensor([0.5]), encoder_hidden_states=text,
              img_shapes=[[(1, 4, 4)]], return_dict=False)
    with torch.no_grad():
        masked = dit(encoder_hidden_states_mask=ones, **kw)[0]
        unmasked = dit(encoder_hidden_states_mask=None, **kw)[0]
    assert torch.allclose(masked, unmasked, atol=1e-6, rtol=0)


def test_z_image_prompt_rows_without_an_unpadded_mask_are_equal():
    from difftune.core.attention import unpadded
    from difftune.families.z_image.model_fn import prompt_rows
    from difftune.families.z_image.pipeline import ZImagePipeline

    assert ZImagePipeline.padding_masks == ("prompt_embeds_mask",)
    embeds, ones = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.long)
    kept, dropped = prompt_rows(embeds, ones), prompt_rows(embeds, unpadded(ones))
    assert unpadded(ones) is None and all(torch.equal(a, b) for a, b in zip(kept, dropped))


@pytest.mark.slow
def test_compiled_blocks_equal_eager(tmp_path, tiny_repo, capsys):
    """--compile (inductor on this CPU) with gradient checkpointing and LoRA trains the same LoRA as eager."""
    import shutil

    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("cc")):
        pytest.skip("inductor needs a C++ compiler on a CPU, and none is installed")
    eager, _ = train(tmp_path, tiny_repo, "eager", dtype="float32", steps=2)
    compiled, _ = train(tmp_path, tiny_repo, "compiled", "--compile", dtype="float32", steps=2)
    assert "compile: dit's 2 QwenImageTransformerBlock blocks compile on the first step" in capsys.readouterr().out
    assert max_diff(eager, compiled) <= 1e-4
