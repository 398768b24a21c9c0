"""What the toy families share: a byte-level prompt encoder and a denoiser over token sequences (a modulated MLP
stack), each tiny and built as diffusers models (config.json + safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from difftune import PipelineUnit, gradient_checkpoint_forward

PROMPT_LENGTH = 16


def tokenize(prompts) -> torch.Tensor:
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    rows = [list(p.encode("utf-8"))[:PROMPT_LENGTH] for p in prompts]
    return torch.tensor([r + [0] * (PROMPT_LENGTH - len(r)) for r in rows])


class TextEncoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, ids):
        return self.proj(self.embed(ids))


class AudioVAE(ModelMixin, ConfigMixin):
    """Waveform (1, T) <-> latents (channels, T / 4): the audio toys' VAE (each family subclasses it under its own
    name, which recognition tells families apart by)."""

    @register_to_config
    def __init__(self, channels: int = 4, step: int = 4):
        super().__init__()
        self.encoder = nn.Conv1d(1, channels, step, stride=step)
        self.decoder = nn.ConvTranspose1d(channels, 1, step, stride=step)

    def encode(self, wave):
        return self.encoder(wave)

    def decode(self, latents):
        return torch.tanh(self.decoder(latents))


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.modulation = nn.Linear(dim, 2 * dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x, cond):
        scale, shift = self.modulation(cond)[:, None].chunk(2, dim=-1)
        return x + torch.tanh(self.mlp(x * (1 + scale) + shift))


class SeqDenoiser(ModelMixin, ConfigMixin):
    """Tokens of every stream in one sequence (a joint model sees its video and its sound together); per stream
    an input and an output projection."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, channels: tuple = (4,), dim: int = 16, num_blocks: int = 2):
        super().__init__()
        self.proj_in = nn.ModuleList(nn.Linear(c, dim) for c in channels)
        self.proj_out = nn.ModuleList(nn.Linear(dim, c) for c in channels)
        self.time_embed = nn.Linear(1, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(num_blocks))

    def run(self, tokens, timestep, prompt_emb, checkpointing=False, offload=False):
        """tokens: one (B, N_i, C_i) per stream -> one prediction each, the same shapes."""
        t = timestep.to(tokens[0].dtype).reshape(-1, 1).expand(tokens[0].shape[0], 1)
        cond = self.time_embed(t / 1000) + prompt_emb.mean(dim=1)
        x = torch.cat([proj(tok) for proj, tok in zip(self.proj_in, tokens)], dim=1)
        for block in self.blocks:
            x = gradient_checkpoint_forward(block, checkpointing, offload, x, cond=cond)
        sizes = [tok.shape[1] for tok in tokens]
        return [proj(part) for proj, part in zip(self.proj_out, x.split(sizes, dim=1))]


class PromptUnit(PipelineUnit):
    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"prompt_emb": ("prompt_emb", "negative_prompt_emb")}
    models = ("text_encoder",)

    def process(self, pipe, prompt):
        if prompt is None:
            return {}
        return {"prompt_emb": pipe.text_encoder(tokenize(prompt).to(pipe.device)).to(pipe.torch_dtype)}


def seeded(shape, seed, pipe) -> torch.Tensor:
    generator = torch.Generator("cpu")
    generator.manual_seed(int(seed)) if seed is not None else generator.seed()
    return torch.randn(shape, generator=generator).to(pipe.device, pipe.torch_dtype)


def save_models(root, models: dict, seed: int = 0) -> list[str]:
    """Random weights saved as diffusers does, one folder per slot: the --model_paths entries."""
    torch.manual_seed(seed)
    paths = []
    for slot, make in models.items():
        make().save_pretrained(Path(root) / slot)
        paths.append(str(Path(root) / slot / "diffusion_pytorch_model.safetensors"))
    return paths


def components(module: str, classes: dict):
    from difftune import ComponentSpec

    return tuple(ComponentSpec(name=slot, library=module, class_name=cls.__name__) for slot, cls in classes.items())


def tone(seconds: float, rate: int, pitch: float, seed: int = 0):
    """A short tone with a little noise, (1, samples) in [-1, 1]."""
    import numpy as np

    t = np.arange(int(round(seconds * rate))) / rate
    noise = np.random.default_rng(seed).normal(0, 0.05, t.shape)
    return (0.5 * np.sin(2 * np.pi * pitch * t) + noise).clip(-1, 1).astype(np.float32)[None]
