"""Tiny random ACE-Step 1.5 models in the release's layout (`ACE-Step/Ace-Step1.5`): the DiT and its condition
encoder in one original file (`decoder.*`, `encoder.*`, `null_condition_emb`, a few FSQ tokenizer tensors the family
leaves unread) with `silence_latent.pt` beside it, `Qwen3-Embedding-0.6B/` (a tiny Qwen3 and its tokenizer) and
`vae/` (an Oobleck VAE at the release's strides: 1920 samples a latent frame at 48 kHz). Latent channels are 8 here
(64 in the release), which keeps the VAE's full-rate layers small."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from support.common import TinyFamily, register_tiny

REPO = "ACE-Step/Ace-Step1.5"
DIT_FILE = "acestep-v15-turbo/model.safetensors"
CHANNELS = 8
RATE = 48000


def tiny_ace_step_models(seed: int = 0):
    from diffusers import AceStepTransformer1DModel, AutoencoderOobleck
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder
    from transformers import Qwen3Config, Qwen3Model

    from support.z_image.tiny import z_image_tokenizer

    c = CHANNELS
    torch.manual_seed(seed)
    dit = AceStepTransformer1DModel(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, in_channels=3 * c, audio_acoustic_hidden_dim=c,
                                    patch_size=2, sliding_window=4, encoder_hidden_size=24)
    cond = AceStepConditionEncoder(hidden_size=24, intermediate_size=48, text_hidden_dim=16, timbre_hidden_dim=c,
                                   num_lyric_encoder_hidden_layers=1, num_timbre_encoder_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=12, sliding_window=4)
    tokenizer = z_image_tokenizer()
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                          head_dim=8))
    vae = AutoencoderOobleck(encoder_hidden_size=2 * c, downsampling_ratios=[2, 4, 4, 6, 10],
                             channel_multiples=[1, 1, 1, 1, 1], decoder_channels=8, decoder_input_channels=c,
                             audio_channels=2, sampling_rate=RATE)
    silence = torch.randn(1, c, 800) * 0.1
    return dit, cond, text_encoder, tokenizer, vae, silence


def write_tiny_ace_step_hub(hub: str | Path, seed: int = 0) -> Path:
    """The tiny release under `hub/ACE-Step/Ace-Step1.5` (once per folder); returns the repository folder."""
    from safetensors.torch import save_file

    from difftune.families.ace_step.components import original_conditioner_keys, original_dit_keys

    repo = Path(hub) / REPO
    if (repo / DIT_FILE).is_file():
        return repo
    dit, cond, text_encoder, tokenizer, vae, silence = tiny_ace_step_models(seed)
    state = {**original_dit_keys(dit.state_dict()), **original_conditioner_keys(cond.state_dict()),
             "tokenizer.quantizer.project_in.weight": torch.randn(4, CHANNELS),
             "detokenizer.proj_out.weight": torch.randn(CHANNELS, 4)}
    (repo / DIT_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(repo / DIT_FILE))
    (repo / DIT_FILE).with_name("config.json").write_text(json.dumps(
        {"architectures": ["AceStepConditionGenerationModel"], "model_type": "acestep", "hidden_size": 32}))
    torch.save(silence, repo / "acestep-v15-turbo" / "silence_latent.pt")
    text_encoder.save_pretrained(repo / "Qwen3-Embedding-0.6B")
    tokenizer.save_pretrained(repo / "Qwen3-Embedding-0.6B")
    vae.save_pretrained(repo / "vae")
    return repo


def ace_step_model_paths(repo: Path) -> list[str]:
    return [str(repo / DIT_FILE), str(repo / "Qwen3-Embedding-0.6B" / "model.safetensors"),
            str(repo / "vae" / "diffusion_pytorch_model.safetensors")]


def write_ace_step_dataset(root: Path, n: int = 2, seconds: float = 1.3) -> Path:
    """`n` short stereo 48 kHz clips with prompts, lyrics and a metadata column, as the reference's example data."""
    import numpy as np

    from difftune.media.audio import write_audio

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    t = np.arange(int(seconds * RATE)) / RATE
    for i in range(n):
        wave = np.stack([np.sin(2 * np.pi * 220 * (i + 1) * t), np.sin(2 * np.pi * 330 * (i + 1) * t)]) * 0.4
        write_audio(wave.astype(np.float32), root / f"clip{i}.wav", RATE)
        rows.append({"audio": f"clip{i}.wav", "prompt": f"a tone of {220 * (i + 1)} hertz",
                     "lyrics": "[Instrumental]" if i % 2 else "[verse]\nla la la", "bpm": 90 + 10 * i})
    (root / "metadata.json").write_text(json.dumps(rows))
    return root / "metadata.json"


def _tiny_ace_step(folder: Path) -> TinyFamily:
    from difftune.families.ace_step.components import LORA_TARGET_MODULES

    repo = write_tiny_ace_step_hub(Path(folder) / "hub")
    return TinyFamily(model_paths=ace_step_model_paths(repo), lora_base_model="dit",
                      lora_target_modules=LORA_TARGET_MODULES, write_dataset=write_ace_step_dataset,
                      flags=("--data_file_keys", "audio"),
                      trainable_cases={"text_encoder_lora": ("--lora_base_model", "text_encoder",
                                                             "--lora_target_modules", "q_proj,v_proj")},
                      call_args={"duration": 1})


register_tiny("ace_step", _tiny_ace_step)

__all__ = ["DIT_FILE", "REPO", "ace_step_model_paths", "tiny_ace_step_models", "write_ace_step_dataset", "write_tiny_ace_step_hub"]
