"""FLUX.1 trains on the reference's timestep table: `FlowMatchScheduler("FLUX.1").set_timesteps(1000, training=True)`
is linspace(1, 0.003/1.002, 1000) shifted by 3 (sigma_min kept, the last sigma 0.0089), with the bell weights of
those timesteps (DiffSynth-Studio fed7b18, diffsynth/diffusion/flow_match.py)."""

from __future__ import annotations

import torch

from difftune.families.flux import FluxImagePipeline
from difftune.schedulers.flow_match import bell_weights


def reference_flux_table():
    sigma_min = 0.003 / 1.002
    sigmas = torch.linspace(1.0, sigma_min, 1000)
    sigmas = 3 * sigmas / (1 + 2 * sigmas)
    timesteps = sigmas * 1000
    y = torch.exp(-2 * ((timesteps - 500) / 1000) ** 2)
    y = y - y.min()
    return sigmas, timesteps, y * (1000 / y.sum())


def test_flux_trains_on_the_reference_table():
    scheduler = FluxImagePipeline.default_scheduler()
    scheduler.set_training()  # fixed shift, the reference's
    sigmas, timesteps, weights = scheduler.training_table(scheduler.training_mu())
    ref_sigmas, ref_t, ref_w = reference_flux_table()
    assert abs(float(sigmas[-1]) - 0.0089) < 1e-4
    assert torch.allclose(sigmas, ref_sigmas, atol=1e-6) and torch.allclose(timesteps, ref_t, atol=1e-3)
    assert torch.allclose(weights, ref_w, atol=1e-5)
    assert torch.allclose(bell_weights(timesteps), weights)
