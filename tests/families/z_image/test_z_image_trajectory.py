"""--task trajectory_imitation: the loss equals a step-by-step rewrite of the reference's formula (values and
gradients), its teacher schedule keeps the student's timesteps, and its LPIPS-like term changes no gradient."""

from __future__ import annotations

import math

import pytest
import torch

from difftune.families.z_image.trajectory import (teacher_trajectory, trajectory_imitation_loss,
                                                  trajectory_imitation_task_loss, z_image_schedule)
from support.z_image import load_tiny_z_image, write_tiny_z_image_hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_z_image_hub(tmp_path_factory.mktemp("z_image_hub"))


class Toy(torch.nn.Module):
    """A velocity model with weights: a channel mix of the latents, a timestep gain, the prompt's mean."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.mix = torch.nn.Parameter(torch.randn(4, 4, generator=g) * 0.3)
        self.gain = torch.nn.Parameter(torch.randn(1, generator=g))

    def forward(self, latents, timestep, prompt_embeds):
        mixed = torch.einsum("oc,bchw->bohw", self.mix, latents)
        t = timestep.reshape(-1, 1, 1, 1) / 1000
        return mixed * (1 + self.gain * t) + prompt_embeds.mean(dim=(1, 2)).reshape(-1, 1, 1, 1)


def reference_rewrite(student, teacher, noise, posi, nega):
    """The reference's TrajectoryImitationLoss (without LPIPS) written out in float64 with plain Python lists."""
    def schedule(n, targets=None):
        sig = [3 * s / (1 + 2 * s) for s in [1 - i / n for i in range(n)]]
        ts = [s * 1000 for s in sig]
        for t in targets or []:
            ts[min(range(n), key=lambda i: abs(ts[i] - t))] = t
        return sig, ts

    s_sig, s_ts = schedule(8)
    t_sig, t_ts = schedule(50, s_ts)
    x, traj = noise.double(), [noise.double()]
    with torch.no_grad():
        for j in range(50):
            t = torch.full((noise.shape[0],), t_ts[j], dtype=torch.float64)
            p, n = teacher(x, t, **posi), teacher(x, t, **nega)
            x = x + (n + 2 * (p - n)) * ((t_sig[j + 1] if j < 49 else 0.0) - t_sig[j])
            traj.append(x)
    y = [math.exp(-2 * ((s * 1000 - 500) / 1000) ** 2) for s in s_sig]
    w = [(v - min(y)) * (1000 / sum(v - min(y) for v in y)) * 8 / 1000 for v in y]
    w = [v + w[1] for v in w]
    nearest = lambda t: min(range(50), key=lambda j: abs(t_ts[j] - t))  # noqa: E731
    loss = 0.0
    for k in range(8):
        start = traj[nearest(s_ts[k])]
        end = traj[nearest(s_ts[k + 1])] if k < 7 else traj[-1]
        d = (s_sig[k + 1] if k < 7 else 0.0) - s_sig[k]
        target = (end - start) / d
        pred = student(start, torch.full((noise.shape[0],), s_ts[k], dtype=torch.float64), **posi)
        loss = loss + ((pred - target) ** 2).mean() * w[k]
    return loss


def test_loss_equals_the_reference_formula_step_by_step():
    noise = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(0))
    posi = {"prompt_embeds": torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))}
    nega = {"prompt_embeds": torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))}
    student, teacher = Toy(3), Toy(4)
    ours = trajectory_imitation_loss(lambda **kw: student(**kw), lambda **kw: teacher(**kw), noise, posi, nega)
    ours.backward()
    mine = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    s64, t64 = Toy(3).double(), Toy(4).double()
    s64.load_state_dict(student.state_dict())
    ref = reference_rewrite(lambda x, t, **kw: s64(x, t, **{k: v.double() for k, v in kw.items()}),
                            lambda x, t, **kw: t64(x, t, **{k: v.double() for k, v in kw.items()}), noise, posi, nega)
    ref.backward()
    rel = abs(ours.item() - ref.item()) / ref.item()
    grads = max(((a - b.grad.float()).abs().max() / b.grad.abs().max()).item() for a, b in zip(mine, s64.parameters()))
    print(f"trajectory imitation: loss {ours.item():.6f} vs rewrite {ref.item():.6f} (rel {rel:.1e}), grads rel {grads:.1e}")
    assert rel < 1e-5 and grads < 1e-4 and ours.item() > 0


def test_teacher_schedule_keeps_the_student_timesteps_and_its_own_sigmas():
    s_sigmas, s_ts = z_image_schedule(8)
    sigmas, ts = z_image_schedule(50, target_timesteps=s_ts)
    plain_sigmas, plain_ts = z_image_schedule(50)
    assert all((ts == t).any() for t in s_ts)  # every student timestep is one of the teacher's
    changed = (ts != plain_ts).nonzero().flatten().tolist()
    assert torch.equal(sigmas, plain_sigmas)  # only the timesteps are written over, not the sigmas
    assert 0 < len(changed) <= 8 and all(bool((s_ts == ts[i]).any()) for i in changed)
    calls = []
    teacher_trajectory(lambda latents, timestep, **kw: calls.append(float(timestep[0])) or latents * 0,
                       torch.zeros(1, 1, 2, 2), s_ts, {}, {}, cfg_scale=1.0)
    assert calls == [float(t) for t in ts] and len(calls) == 50


def test_the_perceptual_term_adds_to_the_value_not_to_the_gradient():
    noise = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(5))
    posi, nega = {"prompt_embeds": torch.ones(1, 2, 3)}, {"prompt_embeds": torch.zeros(1, 2, 3)}
    student, teacher = Toy(6), Toy(7)
    grads, values = [], []
    for perceptual in (None, lambda a, b: (a - b).abs().mean(dim=(1, 2, 3))):
        student.zero_grad()
        loss = trajectory_imitation_loss(lambda **kw: student(**kw), lambda **kw: teacher(**kw), noise, posi, nega,
                                         decode=lambda x: x * 2, perceptual=perceptual)
        loss.backward()
        values.append(loss.item())
        grads.append([p.grad.clone() for p in student.parameters()])
    assert values[1] > values[0]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_task_loss_on_the_tiny_z_image(hub):
    """The task's loss on the real pipeline: the teacher a frozen copy (make_teacher), the noise from the sample's
    generator (the same loss twice), gradients reaching the student only."""
    from types import SimpleNamespace

    from PIL import Image

    from difftune.families.z_image.trajectory import make_teacher

    pipe = load_tiny_z_image(hub)
    values = pipe.training_inputs({"image": Image.new("RGB", (32, 32), "red"), "prompt": "a red square"})
    pipe.scheduler.set_training()
    pipe.run_units(values, cfg=True)  # the teacher's guidance needs the negative prompt's embeddings
    assert values["negative_prompt_embeds"] is not None
    pipe.dit.requires_grad_(True)
    make_teacher(SimpleNamespace(pipe=pipe))
    teacher = pipe.trajectory_teacher.dit
    assert teacher is not pipe.dit and not any(p.requires_grad for p in teacher.parameters())
    gens = lambda: [torch.Generator().manual_seed(11)]  # noqa: E731
    short = {"student_steps": 2, "teacher_steps": 6}  # the plumbing, at a test's cost
    loss = trajectory_imitation_task_loss(pipe, values, gens(), {}, **short)
    loss.backward()
    again = trajectory_imitation_task_loss(pipe, values, gens(), {}, **short)
    grad = sum(p.grad.abs().sum() for p in pipe.dit.parameters() if p.grad is not None)
    print(f"trajectory imitation on the tiny Z-Image: loss {loss.item():.4f}")
    assert torch.isfinite(loss) and loss.item() > 0 and grad > 0 and loss.item() == again.item()
    assert all(p.grad is None for p in teacher.parameters())


def _teacher_gap(pipe, teacher_samples, prompts) -> float:
    """Mean squared distance of the model's 8-step, unguided sample (Turbo's sampling) from the teacher's 50-step
    sample at guidance 2 (what trajectory imitation follows), over the prompts, each from its own seed."""
    gaps = []
    for i, prompt in enumerate(prompts):
        few = pipe(prompt, seed=100 + i, num_inference_steps=8, output_type="latent", progress=False, height=32,
                   width=32)
        gaps.append((few - teacher_samples[i]).pow(2).mean().item())
    return sum(gaps) / len(gaps)


@pytest.mark.slow
def test_trajectory_imitation_keeps_what_sft_loses(hub, tmp_path):
    """Users training a LoRA on Turbo with plain SFT lose its few-step sampling (DiffSynth-Studio #1234, #1251).
    On the tiny Turbo, the same LoRA steps on the same data: SFT moves the 8-step sample away from the teacher's
    50-step guided sample, trajectory imitation moves it closer."""
    import json

    from conftest import run_train
    from difftune.families.z_image.components import LORA_TARGET_MODULES
    from support.z_image import TURBO_REPO, hub_entry
    from support import write_example_dataset

    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    prompts = [line.split(",", 1)[1].strip('"') for line in meta.read_text().splitlines()[1:]]
    paths = [hub_entry(hub, TURBO_REPO, f) for f in ("transformer", "text_encoder", "vae")]
    base = load_tiny_z_image(hub)
    teacher = [base(p, negative_prompt="", cfg_scale=2.0, seed=100 + i, num_inference_steps=50, output_type="latent",
                    progress=False, height=32, width=32) for i, p in enumerate(prompts)]
    gaps = {"base": _teacher_gap(base, teacher, prompts)}
    for task in ("sft", "trajectory_imitation"):
        run_train("--task", task, "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
                  "--output_path", tmp_path / task, "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
                  "--learning_rate", 1e-2, "--max_steps", 4, "--dataset_repeat", 2, "--seed", 0, "--no_progress",
                  "--max_pixels", 1024, "--enable_tensorboard_log", "false", "--lora_base_model", "dit",
                  "--lora_target_modules", LORA_TARGET_MODULES, "--lora_rank", 4)
        trained = load_tiny_z_image(hub)
        trained.load_lora(trained.dit, str(next((tmp_path / task).glob("*.safetensors"))))
        gaps[task] = _teacher_gap(trained, teacher, prompts)
    print("z-image 8-step sample vs the teacher's 50-step cfg-2 sample (mean squared latent distance): "
          + ", ".join(f"{k} {v:.4f}" for k, v in gaps.items()))
    assert gaps["trajectory_imitation"] < gaps["base"] < gaps["sft"]
