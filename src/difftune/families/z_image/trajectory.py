"""The reference's `--task trajectory_imitation`: a few-step student learns the trajectory a frozen teacher samples
with more steps and guidance (DiffSynth-Studio's `TrajectoryImitationLoss`, written for Z-Image-Turbo).

Its definition, which this module follows number for number:

1. The student's schedule: 8 steps of Z-Image's schedule (sigmas linspace(1, 0, 9)[:-1] shifted by 3).
2. The teacher's: 50 steps of the same schedule, each student timestep written over the nearest of the 50
   timesteps (the 50 sigmas are left as they are: a step still moves by the 50-step sigma difference). From the
   initial noise the teacher samples all 50 steps with guidance 2 (negative prompt ""), keeping every latent:
   trajectory[0] = noise, trajectory[j + 1] = trajectory[j] + pred_j * (sigma_{j+1} - sigma_j) (0 after the last).
3. The loss: for each student step k at timestep t_k, the student (guidance 1) predicts from the teacher's latent at
   t_k (the trajectory entry of the nearest teacher timestep) and is matched, by MSE, to the velocity that takes it
   to the teacher's latent at t_{k+1} (the final latent after the last step) over the student's sigma step:
   (x_teacher(t_{k+1}) - x_teacher(t_k)) / (sigma_{k+1} - sigma_k) (|denominator| clamped to 1e-6, sign kept),
   weighted by the bell weight of t_k in an 8-entry training table; the 8 terms are summed.
4. The reference then adds an LPIPS distance between the VAE-decoded 8-step student sample (its predictions
   detached) and the teacher's final image. Every prediction in it is detached, so it adds to the loss's value and
   nothing to its gradient: the weights trained are those of step 3 alone. It is added here when a `perceptual`
   function is given (LPIPS needs downloaded network weights, which difftune never fetches).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...core.loss import Loss
from ...errors import UserError

STUDENT_STEPS = 8
TEACHER_STEPS = 50
TEACHER_CFG = 2.0
SHIFT = 3.0  # Z-Image's schedule


def z_image_schedule(steps: int, shift: float = SHIFT, target_timesteps: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, timesteps) of the reference's Z-Image schedule (float32), the target timesteps written over the
    nearest entries of `timesteps` (not of `sigmas`)."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    timesteps = sigmas * 1000
    if target_timesteps is not None:
        timesteps = timesteps.clone()
        for t in target_timesteps.to(timesteps.dtype):
            timesteps[torch.argmin((timesteps - t).abs())] = t
    return sigmas, timesteps


def table_weights(sigmas: torch.Tensor) -> torch.Tensor:
    """The reference's bell weights of a short training table (its `set_training_weight` for len != 1000)."""
    x = sigmas * 1000
    y = torch.exp(-2 * ((x - 500) / 1000) ** 2)
    y = y - y.min()
    w = y * (1000 / y.sum()) * (len(sigmas) / 1000)
    return w + w[1]


def _step_of(timesteps: torch.Tensor, t) -> int:
    return int(torch.argmin((timesteps - t).abs()))


@torch.no_grad()
def teacher_trajectory(teacher: Callable[..., torch.Tensor], noise: torch.Tensor, student_timesteps: torch.Tensor,
                       posi: dict, nega: dict, steps: int = TEACHER_STEPS, cfg_scale: float = TEACHER_CFG,
                       combine: Callable | None = None, shift: float = SHIFT) -> tuple[torch.Tensor, list]:
    """(the teacher's timesteps, its latents [noise, after step 1, ..., after the last step])."""
    combine = combine or (lambda p, n, s: n + s * (p - n))
    sigmas, timesteps = z_image_schedule(steps, shift, student_timesteps)
    latents, trajectory = noise, [noise]
    for j, t in enumerate(timesteps):
        tt = t.expand(noise.shape[0]).to(noise.device)
        pred = teacher(latents=latents, timestep=tt, **posi)
        if cfg_scale != 1.0:
            pred = combine(pred, teacher(latents=latents, timestep=tt, **nega), cfg_scale)
        i = _step_of(timesteps, t)
        nxt = sigmas[i + 1] if i + 1 < len(timesteps) else 0.0
        latents = latents + pred * (nxt - sigmas[i])
        trajectory.append(latents)
    return timesteps, trajectory


def trajectory_imitation_loss(student: Callable[..., torch.Tensor], teacher: Callable[..., torch.Tensor],
                              noise: torch.Tensor, posi: dict, nega: dict, *, combine: Callable | None = None,
                              decode: Callable | None = None, perceptual: Callable | None = None,
                              student_steps: int = STUDENT_STEPS, teacher_steps: int = TEACHER_STEPS,
                              teacher_cfg: float = TEACHER_CFG, shift: float = SHIFT) -> torch.Tensor:
    """The reference's loss (module docstring) for a batch: `student` / `teacher` are model_fn callables
    (latents, timestep, **inputs) -> velocity, `posi` / `nega` the model_fn inputs of the prompt and of the
    negative prompt "", `noise` the initial latents."""
    s_sigmas, s_timesteps = z_image_schedule(student_steps, shift)
    t_timesteps, trajectory = teacher_trajectory(teacher, noise, s_timesteps, posi, nega, teacher_steps, teacher_cfg,
                                                 combine, shift)
    weights = table_weights(s_sigmas)
    loss = noise.new_zeros((), dtype=torch.float32)
    for k, t in enumerate(s_timesteps):
        start = trajectory[_step_of(t_timesteps, t)]
        pred = student(latents=start, timestep=t.expand(noise.shape[0]).to(noise.device), **posi)
        if k + 1 < len(s_timesteps):
            end, nxt = trajectory[_step_of(t_timesteps, s_timesteps[k + 1])], s_sigmas[k + 1]
        else:
            end, nxt = trajectory[-1], torch.tensor(0.0)
        d = nxt - s_sigmas[k]
        d = torch.sign(d) * torch.clamp(d.abs(), min=1e-6)
        target = (end - start) / d
        loss = loss + torch.nn.functional.mse_loss(pred.float(), target.float()) * weights[k]
    if perceptual is not None and decode is not None:
        loss = loss + regularization(student, trajectory, s_timesteps, s_sigmas, posi, decode, perceptual)
    return loss


@torch.no_grad()
def regularization(student, trajectory: Sequence[torch.Tensor], timesteps, sigmas, posi, decode, perceptual):
    """The reference's second term: the student's own 8-step sample from the noise (guidance 1) against the
    teacher's final latent, both decoded, by `perceptual` (LPIPS in the reference). It carries no gradient."""
    latents = trajectory[0]
    for k, t in enumerate(timesteps):
        pred = student(latents=latents, timestep=t.expand(latents.shape[0]).to(latents.device), **posi)
        latents = latents + pred * ((sigmas[k + 1] if k + 1 < len(timesteps) else 0.0) - sigmas[k])
    return perceptual(decode(latents).float(), decode(trajectory[-1]).float()).mean()


def trajectory_imitation_task_loss(pipe, values: dict[str, Any], generators: Sequence[torch.Generator],
                                   settings: dict[str, Any], perceptual: Callable | None = None,
                                   **schedule: Any) -> torch.Tensor:
    """The loss in the shape of `training/losses.py`'s table: the initial noise from each sample's generator (never
    from the data or the cache), the prompt's and the negative prompt's model_fn inputs from the values, the teacher
    the one `make_teacher` froze."""
    teacher = getattr(pipe, "trajectory_teacher", None)
    if teacher is None:
        raise UserError("--task trajectory_imitation: no teacher (the training module was not prepared for it)")
    shape_of = values.get("input_latents") if values.get("input_latents") is not None else values["latents"]
    noise = torch.stack([torch.randn(shape_of.shape[1:], generator=g, dtype=torch.float32) for g in generators])
    noise = noise.to(device=shape_of.device, dtype=shape_of.dtype)
    posi = pipe.model_fn_kwargs(values)
    nega = {k: values.get(pipe.negative_name(k), v) for k, v in posi.items()}
    student = lambda **kw: pipe.model_fn(**kw, **settings)  # noqa: E731
    decode = pipe.decode if pipe.models.get("vae") is not None else None
    return trajectory_imitation_loss(student, teacher.model_fn, noise, posi, nega, combine=pipe.combine_cfg,
                                     decode=decode, perceptual=perceptual, **schedule)


def make_teacher(module) -> None:
    """The reference's teacher: a frozen copy of the denoiser (and ControlNet) as they are once the trainable
    weights are set up (its LoRA injected, --lora_checkpoint loaded), kept beside the pipeline (not a parameter of
    the training module, so it is neither trained nor synchronised)."""
    pipe = module.pipe
    teacher = type(pipe)(device=pipe.device, torch_dtype=pipe.torch_dtype)
    for slot in pipe.loss_models:
        model = pipe.models.get(slot)
        if model is not None:
            teacher.models[slot] = copy.deepcopy(model).requires_grad_(False).eval()
    pipe.trajectory_teacher = teacher


# Names the loss reads besides model_fn's inputs: a latent's shape, and the negative prompt's values (the teacher's
# guidance; `cfg=True` has the units compute them in both stages).
TRAJECTORY_READS = ("input_latents", "negative_prompt_embeds", "negative_prompt_embeds_mask")
TRAJECTORY_IMITATION = Loss(trajectory_imitation_task_loss, TRAJECTORY_READS, cfg=True, prepare=make_teacher)
