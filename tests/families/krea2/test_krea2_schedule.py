"""Krea-2's time shift as the reference computes it (its FlowMatchScheduler "Krea-2" template, rewritten here):
training draws from 1000 sigmas at a fixed mu of 0.8; sampling shifts linspace(1, 0, N + 1)[:-1] by mu linear in
the token count between (256, 0.5) and (6400, 1.15), or by a given mu (Turbo's 1.15)."""

from __future__ import annotations

import math

import pytest
import torch

from difftune.families.krea2 import Krea2Pipeline


def reference_krea2_sigmas(steps: int, tokens: int | None = None, mu: float | None = None) -> torch.Tensor:
    ts = torch.linspace(1.0, 0, steps + 1, dtype=torch.float64)
    if mu is None:
        mu = 0.8 if tokens is None else 0.5 + (1.15 - 0.5) / (6400 - 256) * (tokens - 256)
    return (math.exp(mu) / (math.exp(mu) + (1.0 / ts - 1.0)))[:-1]


def test_training_table_is_the_references():
    sched = Krea2Pipeline.default_scheduler()
    sched.set_training()
    sigmas, _, _ = sched.training_table(sched.training_mu())
    assert torch.allclose(sigmas.double(), reference_krea2_sigmas(1000), atol=1e-6)


@pytest.mark.parametrize("height,width,mu", [(1024, 1024, None), (512, 768, None), (2048, 2048, 1.15)])
def test_sampling_schedule_is_the_references(height, width, mu):
    pipe = Krea2Pipeline()
    pipe.set_timesteps({"height": height, "width": width, "mu": mu}, 8)
    want = reference_krea2_sigmas(8, (height // 16) * (width // 16), mu)
    assert torch.allclose(pipe.scheduler.sigmas[:-1].double(), want, atol=1e-6)
    assert torch.allclose(pipe.scheduler.timesteps.double(), want * 1000, atol=1e-3)
