"""FlowMatchScheduler: diffusers-identical inference sigmas, DiffSynth-compatible training draws."""

import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as diffusers_calculate_shift
from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import QwenImageImg2ImgPipeline

from difftune.errors import UserError
from difftune.families.qwen_image.components import TRAINING_MU
from difftune.schedulers import FlowMatchScheduler, calculate_shift
from support import QWEN_IMAGE_SCHEDULER_CONFIG as QWEN

SIZES = [(1024, 1024, 50), (1328, 1328, 30), (512, 768, 20), (928, 1664, 8), (2048, 2048, 4), (256, 256, 3),
         (1000, 600, 25)]


def qwen_scheduler():
    """Qwen-Image's scheduler (its official config and the reference's training shift)."""
    from difftune.families.qwen_image import QwenImagePipeline

    return QwenImagePipeline.default_scheduler()


def diffusers_schedule(config, height, width, steps):
    """What QwenImagePipeline feeds diffusers' scheduler: sigmas linspace(1, 1/N, N), mu from (H/16)(W/16)."""
    ref = FlowMatchEulerDiscreteScheduler.from_config(config)
    seq = (height // 16) * (width // 16)
    mu = diffusers_calculate_shift(seq, ref.config.get("base_image_seq_len", 256),
                                   ref.config.get("max_image_seq_len", 4096), ref.config.get("base_shift", 0.5),
                                   ref.config.get("max_shift", 1.15))
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return ref, seq


@pytest.mark.parametrize("height,width,steps", SIZES)
def test_inference_sigmas_match_diffusers_qwen_image(height, width, steps):
    ref, seq = diffusers_schedule(QWEN, height, width, steps)
    ours = FlowMatchScheduler.from_config(QWEN)
    timesteps = ours.set_timesteps(steps, image_seq_len=seq)
    assert ours.sigmas.shape == (steps + 1,) and ours.timesteps.shape == (steps,)
    assert (ours.sigmas - ref.sigmas).abs().max().item() <= 1e-6
    assert (ours.timesteps - ref.timesteps).abs().max().item() <= 1e-6
    assert timesteps is ours.timesteps
    assert ours.sigmas[0].item() == 1.0 and ours.sigmas[-1].item() == 0.0
    assert ours.sigmas[-2].item() == pytest.approx(0.02, abs=1e-6)  # shift_terminal


@pytest.mark.parametrize("steps,strength", [(10, 0.7), (20, 0.5), (30, 0.33), (10, 0.9), (50, 1.0)])
def test_img2img_strength_drops_first_steps_like_diffusers(steps, strength):
    ref, seq = diffusers_schedule(QWEN, 1024, 768, steps)
    timesteps, n = QwenImageImg2ImgPipeline.get_timesteps(SimpleNamespace(scheduler=ref), steps, strength, "cpu")
    ours = qwen_scheduler()
    ours.set_timesteps(steps, image_seq_len=seq, denoising_strength=strength)
    assert len(ours.timesteps) == n
    assert (ours.timesteps - timesteps).abs().max().item() <= 1e-6
    assert (ours.sigmas - ref.sigmas[ref.begin_index or 0:]).abs().max().item() <= 1e-6
    if (steps, strength) == (10, 0.9):  # int(10 - 10*0.9) = 1 step dropped; int(10*(1-0.9)) would drop 0
        assert n == 9


def test_img2img_strength_diffsynth_mode_keeps_all_steps():
    """DiffSynth-Studio: N steps from a raw sigma of `strength`: linspace(strength, 0, N+1)[:-1], then shift."""
    s = qwen_scheduler()
    s.set_timesteps(4, mu=0.8, denoising_strength=0.5, strength_mode="diffsynth")
    e = math.exp(0.8)
    shifted = [e / (e + 1 / r - 1) for r in (0.5, 0.375, 0.25, 0.125)]
    stretched = [1 - (1 - x) / ((1 - shifted[-1]) / 0.98) for x in shifted]
    assert s.sigmas.tolist() == pytest.approx(stretched + [0.0], abs=1e-6)
    assert len(s.timesteps) == 4


@pytest.mark.parametrize("config", [
    {"shift": 3.0, "use_dynamic_shifting": False},  # SD3-style static shift
    {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "max_image_seq_len": 4096},  # FLUX.1
    {**QWEN, "time_shift_type": "linear"},
])
def test_other_family_configs_match_diffusers(config):
    ref, seq = diffusers_schedule(config, 1024, 1024, 28)
    ours = FlowMatchScheduler.from_config(config)
    ours.set_timesteps(28, image_seq_len=seq)
    assert (ours.sigmas - ref.sigmas).abs().max().item() <= 1e-6


def test_one_step_is_finite():
    s = qwen_scheduler()  # diffusers' stretch divides 0 by 0 here
    s.set_timesteps(1, image_seq_len=4096)
    assert s.sigmas.tolist() == [1.0, 0.0] and s.timesteps.tolist() == [1000.0]


def test_defaults_are_qwen_image_and_from_pretrained(tmp_path):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN))
    a, b, c = qwen_scheduler(), FlowMatchScheduler.from_pretrained(tmp_path), FlowMatchScheduler.from_pretrained(
        tmp_path / "scheduler")
    for s in (a, b, c):
        s.set_timesteps(20, image_seq_len=4096)
    assert torch.equal(a.sigmas, b.sigmas) and torch.equal(a.sigmas, c.sigmas)
    assert calculate_shift(4096) == pytest.approx(0.5 + 0.4 * (4096 - 256) / (8192 - 256))
    a.set_timesteps(4, image_seq_len=4096)  # 1024², the example in docs/scheduler.md
    assert [round(v, 4) for v in a.sigmas.tolist()] == [1.0, 0.7667, 0.4556, 0.02, 0.0]
    with pytest.raises(UserError, match="no scheduler_config.json"):
        FlowMatchScheduler.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="image_seq_len"):
        a.set_timesteps(20)
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        FlowMatchScheduler.from_config({**QWEN, "use_karras_sigmas": True})


def test_step_integrates_a_linear_path_exactly():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    s = qwen_scheduler()
    s.set_timesteps(13, image_seq_len=1024, denoising_strength=0.8)
    x = s.add_noise(x0, noise, s.sigmas[0])
    for i in range(len(s.timesteps)):
        x = s.step(s.training_target(x0, noise), i, x)  # the exact velocity of the straight path
    assert torch.allclose(x, x0, atol=1e-5)
    # one step lands exactly on the path at the next sigma
    y = s.step(noise - x0, 0, s.add_noise(x0, noise, s.sigmas[0]))
    assert torch.allclose(y, s.add_noise(x0, noise, s.sigmas[1]), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_equals_diffusers_step_bit_for_bit(dtype):
    ref, seq = diffusers_schedule(QWEN, 768, 1024, 12)
    ours = qwen_scheduler()
    ours.set_timesteps(12, image_seq_len=seq)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, 16, generator=g).to(dtype)
    y = x.clone()
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(2, 48, 16, generator=g).to(dtype)
        x = ref.step(v, t, x, return_dict=False)[0]
        y = ours.step(v, i, y)
        assert y.dtype == x.dtype == dtype
        assert torch.equal(x, y), (i, (x.float() - y.float()).abs().max().item())


def test_img2img_noising_equals_diffusers_scale_noise():
    """img2img noises the image latents to the first kept sigma: diffusers' scale_noise, our add_noise."""
    ref, seq = diffusers_schedule(QWEN, 1024, 1024, 20)
    timesteps, _ = QwenImageImg2ImgPipeline.get_timesteps(SimpleNamespace(scheduler=ref), 20, 0.6, "cpu")
    ours = qwen_scheduler()
    ours.set_timesteps(20, image_seq_len=seq, denoising_strength=0.6)
    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(1, 64, 16, generator=g), torch.randn(1, 64, 16, generator=g)
    expected = ref.scale_noise(x0, timesteps[:1], noise)
    assert torch.equal(ours.add_noise(x0, noise, ours.sigmas[0]), expected)


def test_add_noise_and_target_recover_x0_and_noise():
    """x_t = (1 - s) x0 + s noise and v = noise - x0 give x0 = x_t - s v and noise = x_t + (1 - s) v."""
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    sigma = torch.tensor([0.02, 0.3, 0.7, 1.0])
    xt = FlowMatchScheduler.add_noise(x0, noise, sigma)
    v = FlowMatchScheduler.training_target(x0, noise)
    s = sigma.view(-1, 1, 1, 1)
    assert torch.allclose(xt - s * v, x0, atol=1e-6)
    assert torch.allclose(xt + (1 - s) * v, noise, atol=1e-6)
    assert torch.equal(FlowMatchScheduler.add_noise(x0, noise, 1.0), noise)
    assert torch.equal(FlowMatchScheduler.add_noise(x0, noise, 0.0), x0)


def test_add_noise_per_sample_sigma_and_target():
    x0, noise = torch.zeros(3, 2, 2), torch.ones(3, 2, 2)
    out = FlowMatchScheduler.add_noise(x0, noise, torch.tensor([0.0, 0.25, 1.0]))
    assert out[:, 0, 0].tolist() == [0.0, 0.25, 1.0]
    assert FlowMatchScheduler.add_noise(x0, noise, 0.5).unique().tolist() == [0.5]
    assert torch.equal(FlowMatchScheduler.training_target(x0, noise), noise - x0)


def test_training_table_matches_hand_computed_values():
    s = qwen_scheduler()
    s.set_training()
    assert s.training and (s.timestep_sampling, s.shift_mode, s.weighting) == ("uniform", "fixed", "bell")
    sigmas, timesteps, weights = s.training_table(TRAINING_MU)
    assert sigmas.shape == (1000,)
    e = math.exp(0.8)

    def shift(raw):
        return e / (e + 1 / raw - 1)

    scale = (1 - shift(0.001)) / (1 - 0.02)
    for i in (0, 1, 250, 500, 999):
        expected = 1 - (1 - shift(1 - i / 1000)) / scale
        assert sigmas[i].item() == pytest.approx(expected, abs=1e-6)
    assert sigmas[500].item() == pytest.approx(0.695492, abs=1e-5)
    assert sigmas[999].item() == pytest.approx(0.02, abs=1e-7)
    assert torch.allclose(timesteps, sigmas * 1000)
    assert weights.mean().item() == pytest.approx(1.0, abs=1e-6)
    assert weights[0].item() == 0.0  # t = 1000 is the farthest from 500
    peak = int(weights.argmax())
    assert abs(timesteps[peak].item() - 500) < 1.5


def reference_training_table(mu=0.8, terminal=0.02):
    """DiffSynth-Studio's Qwen-Image training table written out in float64 numpy."""
    raw = np.linspace(1, 0, 1001)[:-1]
    shifted = math.exp(mu) / (math.exp(mu) + (1 / raw - 1))
    one_minus = 1 - shifted
    sigmas = 1 - one_minus / (one_minus[-1] / (1 - terminal))
    t = sigmas * 1000
    y = np.exp(-2 * ((t - 500) / 1000) ** 2)
    y = y - y.min()
    return sigmas, t, y * (1000 / y.sum())


def test_training_table_and_weights_equal_the_reference_formula():
    sigmas, timesteps, weights = qwen_scheduler().training_table(TRAINING_MU)
    ref_sigmas, ref_t, ref_w = reference_training_table()
    assert np.abs(sigmas.double().numpy() - ref_sigmas).max() <= 1e-6
    assert np.abs(timesteps.double().numpy() - ref_t).max() <= 1e-3  # 1000 * float32 rounding
    assert np.abs(weights.double().numpy() - ref_w).max() <= 1e-5
    assert (np.diff(ref_sigmas) < 0).all()  # decreasing: index 0 is pure noise
    # the numbers docs/scheduler.md quotes
    assert ([round(sigmas[i].item(), 4) for i in (0, 250, 500, 698, 750, 999)]
            == [1.0, 0.8721, 0.6955, 0.4996, 0.4361, 0.02])
    assert [round(weights[i].item(), 4) for i in (250, 500, 750)] == [0.6485, 1.3679, 1.6479]
    assert weights[0].item() == 0.0
    assert weights[999].item() == pytest.approx(0.1037, abs=1e-4)  # t = 20
    assert weights.max().item() == pytest.approx(1.6826, abs=1e-4)  # at t = 499.6 (index 698)


def test_training_draws_come_only_from_the_generator():
    s = qwen_scheduler()
    s.set_training()
    torch.manual_seed(123)
    a = s.sample_training(64, torch.Generator().manual_seed(7))
    torch.manual_seed(999)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    b = s.sample_training(64, torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert (np.random.get_state()[1] == states[2]).all()
    for x, y in zip(a, b):
        assert x.shape == (64,) and torch.equal(x, y)
    c = s.sample_training(64, torch.Generator().manual_seed(8))
    assert not torch.equal(a[0], c[0])
    sigmas, timesteps, weights = s.training_table(TRAINING_MU)
    idx = [int((sigmas == v).nonzero()[0]) for v in a[0]]
    assert torch.equal(a[2], weights[idx]) and torch.equal(a[1], timesteps[idx])


def test_uniform_draws_cover_the_table_with_mean_weight_one():
    s = qwen_scheduler()
    s.set_training()
    sigma, _, weight = s.sample_training(40000, torch.Generator().manual_seed(0))
    assert weight.mean().item() == pytest.approx(1.0, abs=0.02)
    assert sigma.min().item() == pytest.approx(0.02, abs=1e-6) and sigma.max().item() == 1.0
    assert (sigma > 0.6955).float().mean().item() == pytest.approx(0.5, abs=0.02)  # median = table[500]


def table_index(table, draws):
    return [int((table == v).nonzero()[0]) for v in draws]


def test_dynamic_shift_takes_mu_from_the_sequence_length():
    fixed, dynamic = qwen_scheduler(), qwen_scheduler()
    fixed.set_training()
    dynamic.set_training(shift="dynamic")
    for seq, mu in ((256, 0.5), (4096, 0.5 + 0.4 * 3840 / 7936), (8192, 0.9)):
        assert dynamic.training_mu(seq) == pytest.approx(mu)
        a = fixed.sample_training(32, torch.Generator().manual_seed(5), image_seq_len=seq)
        b = dynamic.sample_training(32, torch.Generator().manual_seed(5), image_seq_len=seq)
        idx = table_index(fixed.training_table(TRAINING_MU)[0], a[0])
        assert idx == table_index(dynamic.training_table(mu)[0], b[0])  # same index, other table
        ref_sigmas, _, ref_w = reference_training_table(mu)
        assert np.abs(b[0].double().numpy() - ref_sigmas[idx]).max() <= 1e-6
        assert np.abs(b[2].double().numpy() - ref_w[idx]).max() <= 1e-5
    assert fixed.training_mu(256) == fixed.training_mu(8192) == 0.8  # the reference ignores the size
    assert [round(dynamic.training_table(dynamic.training_mu(seq))[0][500].item(), 4) for seq in (256, 8192)] \
        == [0.6294, 0.7160]


def test_logit_normal_concentrates_mid_range():
    uniform, logit = qwen_scheduler(), qwen_scheduler()
    uniform.set_training()
    logit.set_training(timestep_sampling="logit_normal")
    table = uniform.training_table(TRAINING_MU)[0]
    share = {}
    for name, s in (("uniform", uniform), ("logit", logit)):
        t = s.sample_training(20000, torch.Generator().manual_seed(11))[1]
        idx = torch.searchsorted(-table * 1000, -t)  # the table decreases
        assert torch.equal(table[idx] * 1000, t)
        share[name] = (((idx >= 250) & (idx < 750)).float().mean().item(),
                       ((idx < 50) | (idx >= 950)).float().mean().item())
    # raw sigma u = sigmoid(z): P(0.25 < u < 0.75) = 0.728, P(u < 0.05 or u > 0.95) = 0.0032
    assert share["uniform"][0] == pytest.approx(0.5, abs=0.02) and share["uniform"][1] == pytest.approx(0.1, abs=0.01)
    assert share["logit"][0] == pytest.approx(0.728, abs=0.02) and share["logit"][1] < 0.01
    # u plays the unshifted sigma: a positive logit mean means more noise, median u = sigmoid(1) = 0.731,
    # i.e. index floor((1 - 0.731) * 1000) = 268
    logit.set_training(timestep_sampling="logit_normal", logit_mean=1.0)
    t = logit.sample_training(20001, torch.Generator().manual_seed(11))[1]
    assert int(torch.searchsorted(-table * 1000, -t.median())) == pytest.approx(268, abs=10)


def test_logit_normal_dynamic_and_no_weighting():
    s = qwen_scheduler()
    s.set_training(timestep_sampling="logit_normal", weighting="none", shift="dynamic")
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    small, _, w = s.sample_training(20000, g(), image_seq_len=256)
    large, _, _ = s.sample_training(20000, g(), image_seq_len=8192)
    assert torch.equal(w, torch.ones(20000))
    # logit-normal(0, 1) has median 0.5: the median sigma is the table's entry for raw sigma 0.5
    assert small.median().item() == pytest.approx(s.training_table(0.5)[0][500].item(), abs=0.01)
    assert (large >= small).all() and large.mean() > small.mean()  # larger images: more noise
    with pytest.raises(ValueError, match="sequence length"):
        s.sample_training(1, g())
    s.set_training(4096, shift="dynamic")
    assert s.sample_training(4, g())[0].shape == (4,)
    with pytest.raises(UserError, match="--timestep_sampling"):
        s.set_training(timestep_sampling="cosine")


def test_set_timesteps_keeps_training_mode():
    s = qwen_scheduler()
    s.set_training(sampling="logit_normal")  # the trainer's spelling
    assert s.timestep_sampling == "logit_normal"
    s.set_timesteps(4, image_seq_len=256)  # e.g. a distillation loss unrolling a short schedule
    assert s.training


def test_the_bell_weights_are_computed_in_float32_as_the_reference_does():
    """exp(-2((t - 500)/1000)^2) - min, scaled to mean 1, each operation in float32 on float32 timesteps (the
    reference's arithmetic; float64 rounded once differed from it in most entries by ~1e-7)."""
    import torch

    from difftune.schedulers.flow_match import bell_weights

    t = torch.linspace(1000, 3, 1000, dtype=torch.float32)
    y = torch.exp(-2 * ((t - 500.0) / 1000) ** 2)
    y = y - y.min()
    want = y * (1000 / y.sum())
    got = bell_weights(t)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    t64 = t.double()
    y64 = torch.exp(-2 * ((t64 - 500.0) / 1000) ** 2)
    y64 = y64 - y64.min()
    assert not torch.equal(got, (y64 * (1000 / y64.sum())).float())  # the old float64 weights: not these
