"""Train the tiny Qwen-Image VAE (`AutoencoderKLQwenImage`) of the bundled base model on generic flat shapes.

A randomly initialised VAE decodes garbage, so the base model's VAE is trained first (this script), then the
DiT is trained on its latents (`make_base_model.py`, with difftune's own training).

Speed: the Qwen-Image VAE is a video VAE whose causal 3-D convolutions see one real frame and two frames of
zero padding for a still image. For a single frame that is exactly a 2-D convolution with the kernel's last
temporal slice, which is several times faster on a CPU; `single_frame_convolutions()` swaps that in while
training. The other temporal slices get no gradient (a still image never reaches them) and the saved model
is the unchanged diffusers class.

    python scripts/train_tiny_vae.py --output /tmp/vae --steps 1600
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@contextlib.contextmanager
def single_frame_convolutions():
    """Run `QwenImageCausalConv3d` on one uncached frame as the equivalent 2-D convolution (and the RMS
    norm as one fused expression): the same function, several times faster to train on a CPU."""
    from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen_vae

    original = qwen_vae.QwenImageCausalConv3d.forward

    def forward(self, x, cache_x=None):
        if x.shape[2] != 1 or cache_x is not None:
            return original(self, x, cache_x)
        pad = self._padding  # (w, w, h, h, 2t, 0): causal zeros in front, so only the last slice sees x
        y = F.conv2d(x[:, :, 0], self.weight[:, :, -1], self.bias, self.stride[1:], (pad[2], pad[0]))
        return y.unsqueeze(2)

    original_norm = qwen_vae.QwenImageRMS_norm.forward

    def norm(self, x):  # F.normalize over channels, as one expression (fewer autograd nodes)
        d = 1 if self.channel_first else -1
        return x * torch.rsqrt(x.pow(2).sum(d, keepdim=True).clamp_min(1e-24)) * (self.scale * self.gamma) + self.bias

    qwen_vae.QwenImageCausalConv3d.forward = forward
    qwen_vae.QwenImageRMS_norm.forward = norm
    try:
        yield
    finally:
        qwen_vae.QwenImageCausalConv3d.forward = original
        qwen_vae.QwenImageRMS_norm.forward = original_norm


@torch.no_grad()
def rescale_single_frame_init(vae) -> None:
    """A still image reaches one of the three temporal slices of each 3x3x3 kernel, so the default
    initialisation (scaled for 27 taps) is sqrt(3) too small for it; scaling that slice up trains faster."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    for m in vae.modules():
        if isinstance(m, QwenImageCausalConv3d) and m.kernel_size[0] == 3:
            m.weight[:, :, -1] *= 3 ** 0.5


def _batch(rng: random.Random, n: int, shape_fraction: float = 0.5) -> torch.Tensor:
    """(n, 3, 1, 64, 64) in [-1, 1]: generic random shapes, and part of the base model's captioned shapes."""
    from difftune.shapes import random_spec, random_vae_image, render

    images = [render(random_spec(rng)) if rng.random() < shape_fraction else random_vae_image(rng) for _ in range(n)]
    x = np.stack([np.asarray(i, dtype=np.float32) / 127.5 - 1.0 for i in images])
    return torch.from_numpy(x).permute(0, 3, 1, 2).unsqueeze(2).contiguous()


def train_vae(vae, steps: int = 1600, batch_size: int = 8, lr: float = 3e-3, latent_noise: float = 0.0,
              latent_penalty: float = 1e-4, seed: int = 0, progress: bool = True) -> dict:
    """Train `vae` in place; returns stats.

    The pipeline encodes with the posterior mode, so the encoder's mean is what matters: the loss is
    L1 + MSE reconstruction from the mean (optionally plus Gaussian noise of `latent_noise` times the
    latents' std) and a small L2 penalty that keeps the latents' scale bounded. The log-variance head is
    left as initialised (nothing reads it). Noise slowed early training a lot in short runs, so it is off.
    """
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rescale_single_frame_init(vae)
    opt = torch.optim.Adam(vae.parameters(), lr=lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    vae.train()
    started = time.perf_counter()
    history = []
    with single_frame_convolutions():
        bar = tqdm(range(steps), desc="vae", disable=not progress, dynamic_ncols=True, mininterval=2.0)
        for _ in bar:
            x = _batch(rng, batch_size)
            mean = vae.encode(x).latent_dist.mean
            scale = mean.detach().std()
            y = vae.decode(mean + latent_noise * scale * torch.randn(mean.shape, generator=gen)).sample
            rec = (y - x).abs().mean() + (y - x).pow(2).mean()
            penalty = mean.pow(2).mean()
            loss = rec + latent_penalty * penalty
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            sched.step()
            history.append(rec.item())
            bar.set_postfix(rec=f"{np.mean(history[-20:]):.4f}", z2=f"{penalty.item():.2f}", refresh=False)
    vae.eval()
    return {"steps": steps, "batch_size": batch_size, "seconds": time.perf_counter() - started,
            "final_reconstruction_loss": float(np.mean(history[-50:]))}


@torch.no_grad()
def set_latent_statistics(vae, n: int = 512, seed: int = 1) -> None:
    """Store the per-channel mean and std of the captioned shapes' latents in the VAE config, so the
    pipeline's normalisation ((z - mean) / std) hands the DiT unit-variance latents, as on the real model."""
    rng = random.Random(seed)
    with single_frame_convolutions():
        z = torch.cat([vae.encode(_batch(rng, 64, shape_fraction=1.0)).latent_dist.mode() for _ in range(n // 64)])
    dims = (0, 2, 3, 4)
    vae.register_to_config(latents_mean=[round(v, 4) for v in z.mean(dims).tolist()],
                           latents_std=[round(v, 4) for v in z.std(dims).tolist()])


@torch.no_grad()
def reconstruction_error(vae, n: int = 64, seed: int = 2) -> float:
    """Mean absolute pixel error (0-255 scale) on fresh captioned shapes, through the unpatched VAE."""
    x = _batch(random.Random(seed), n, shape_fraction=1.0)
    y = vae.decode(vae.encode(x).latent_dist.mode()).sample
    return float((y - x).abs().mean() * 127.5)


def main(argv=None) -> int:
    from difftune.families.qwen_image.tiny import TinyQwenImageSpec, tiny_qwen_vae

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="folder for config.json + diffusion_pytorch_model.safetensors")
    p.add_argument("--spec", default=None, help="JSON of TinyQwenImageSpec fields (sizes)")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    spec = TinyQwenImageSpec(**json.loads(args.spec)) if args.spec else TinyQwenImageSpec()
    vae = tiny_qwen_vae(spec)
    stats = train_vae(vae, steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    set_latent_statistics(vae)
    stats["pixel_error"] = reconstruction_error(vae)
    vae.save_pretrained(args.output)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
