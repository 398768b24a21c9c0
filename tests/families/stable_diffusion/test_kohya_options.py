"""kohya sd-scripts' loss options on an epsilon / v model: --min_snr_gamma, --debiased_estimation_loss,
--noise_offset (+ random strength), --min_timestep / --max_timestep, on values; a flow family refuses them."""

from __future__ import annotations

import json

import pytest
import torch

from difftune.errors import UserError
from difftune.schedulers.diffusion import DiffusionScheduler


def _snr(scheduler, t):
    from diffusers.training_utils import compute_snr

    return compute_snr(scheduler.train, t)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_and_debiased_weights_are_kohyas(prediction):
    s = DiffusionScheduler(prediction)
    t = torch.tensor([0, 10, 250, 500, 999])
    snr = _snr(s, t).double()
    s.set_training(min_snr_gamma=5.0)
    want = snr.clamp(max=5) / (snr + 1 if prediction == "v_prediction" else snr)
    torch.testing.assert_close(s.loss_weight(t), want.float())
    s.set_training(debiased_estimation_loss=True)
    snr_t = snr.clamp(max=1000)
    torch.testing.assert_close(s.loss_weight(t), (1 / (snr_t + 1 if prediction == "v_prediction" else snr_t).sqrt()).float())
    s.set_training(min_snr_gamma=5.0, debiased_estimation_loss=True)
    both = want * (1 / (snr_t + 1 if prediction == "v_prediction" else snr_t).sqrt())
    torch.testing.assert_close(s.loss_weight(t), both.float())
    s.set_training()
    assert torch.equal(s.loss_weight(t), torch.ones(5))
    assert s.loss_weight(t)[0] == 1 and want[0] < 0.01  # t = 0 (SNR ~ 1e3) is weighed down by min-SNR


def test_noise_offset_is_one_normal_per_sample_and_channel_from_the_samples_generator():
    s = DiffusionScheduler()
    s.set_training(noise_offset=0.1)
    noise = torch.zeros(2, 4, 3, 3)
    gens = [torch.Generator().manual_seed(i) for i in (1, 2)]
    out = s.training_noise(noise, gens)
    for i, seed in enumerate((1, 2)):
        want = 0.1 * torch.randn(4, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(out[i], want[:, None, None].expand(4, 3, 3))
    s.set_training(noise_offset=0.1, noise_offset_random_strength=True)
    out = s.training_noise(noise[:1], [torch.Generator().manual_seed(1)])
    g = torch.Generator().manual_seed(1)
    strength = 0.1 * torch.rand(1, generator=g).item()
    torch.testing.assert_close(out[0], (strength * torch.randn(4, generator=g))[:, None, None].expand(4, 3, 3))


def test_min_and_max_timestep_bound_the_draw():
    s = DiffusionScheduler()
    s.set_training(min_timestep=290, max_timestep=300)
    draws = torch.cat([s.sample_training(1, torch.Generator().manual_seed(i))[0] for i in range(200)])
    assert draws.min() == 290 and draws.max() == 299
    for kwargs, says in (({"min_timestep": 500, "max_timestep": 500}, "0 <= min < max <= 1000"),
                         ({"max_timestep": 1001}, "0 <= min < max <= 1000"),
                         ({"min_timestep": 10, "boundaries": (0.5, 1.0)}, "give one"),
                         ({"noise_offset": float("nan")}, "--noise_offset nan"),
                         ({"noise_offset_random_strength": True}, "--noise_offset, which is not set"),
                         ({"min_snr_gamma": 0.0}, "--min_snr_gamma 0.0")):
        with pytest.raises(UserError, match=says):
            s.set_training(**kwargs)


def test_the_options_change_what_sd_trains_and_a_flow_family_refuses_them(tmp_path):
    from safetensors.torch import load_file

    from conftest import run_train
    from support import write_example_dataset
    from support.stable_diffusion import sd_model_paths, write_tiny_sd_hub

    hub = write_tiny_sd_hub(tmp_path / "hub")
    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    common = ("--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta, "--height", 32, "--width", 32,
              "--model_paths", json.dumps(sd_model_paths(hub)), "--lora_base_model", "unet", "--lora_target_modules",
              "to_q,to_v", "--lora_rank", 2, "--learning_rate", 1e-2, "--max_steps", 2, "--no_progress",
              "--torch_dtype", "float32")
    runs = {"plain": (), "kohya": ("--min_snr_gamma", 5, "--noise_offset", 0.05, "--min_timestep", 100,
                                   "--max_timestep", 900, "--debiased_estimation_loss")}
    saved = {}
    for name, extra in runs.items():
        run_train(*common, *extra, "--output_path", tmp_path / name)
        (f,) = sorted((tmp_path / name).glob("*.safetensors"))
        saved[name] = load_file(str(f))
    assert saved["plain"].keys() == saved["kohya"].keys()
    from safetensors import safe_open

    with safe_open(str(next((tmp_path / "plain").glob("*.safetensors"))), "pt") as f:
        meta = f.metadata()  # kohya's training metadata, which A1111, Forge and Civitai show
    assert {k: meta[k] for k in ("ss_network_module", "ss_network_dim", "ss_base_model_version")} == {
        "ss_network_module": "networks.lora", "ss_network_dim": "2", "ss_base_model_version": "sd_v1"}
    assert float(meta["ss_network_alpha"]) == 2.0
    assert any(not torch.equal(saved["plain"][k], saved["kohya"][k]) for k in saved["plain"])

    from difftune.schedulers.flow_match import FlowMatchScheduler

    with pytest.raises(UserError, match="--min_snr_gamma: an option of epsilon / v-prediction models"):
        FlowMatchScheduler().set_training(min_snr_gamma=5.0)
