"""Tiny random ACE-Step 1.5 models in the release's layouts. `ACE-Step/Ace-Step1.5`: the DiT and its condition
encoder in one original file (`decoder.*`, `encoder.*`, `null_condition_emb`, a few FSQ tokenizer tensors the family
leaves unread) with its original `config.json` and `silence_latent.pt` beside it, `Qwen3-Embedding-0.6B/` (a tiny
Qwen3, its `Qwen3ForCausalLM` config and its tokenizer) and `vae/` (an Oobleck VAE at the release's strides: 1920
samples a latent frame at 48 kHz). `ACE-Step/acestep-v15-xl-*`: a wider DiT (hidden size 48, its condition states
24 wide, as the XL's 2560 and 2048) with the same condition encoder, in two shards and their index. Latent channels
are 8 here (64 in the release), which keeps the VAE's full-rate layers small."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from support.common import TinyFamily, register_tiny

REPO = "ACE-Step/Ace-Step1.5"
DIT_FILE = "acestep-v15-turbo/model.safetensors"
TEXT_FOLDER = "Qwen3-Embedding-0.6B"
CHANNELS = 8
RATE = 48000
COND_WIDTH, TEXT_WIDTH = 24, 16
XL_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def tiny_ace_step_dit(xl: bool = False):
    """The turbo-sized tiny DiT, or the XL's (wider than the condition states it attends to)."""
    from diffusers import AceStepTransformer1DModel

    heads, layers = (3, 2) if xl else (2, 2)
    return AceStepTransformer1DModel(hidden_size=16 * heads, intermediate_size=32 * heads, num_hidden_layers=layers,
                                     num_attention_heads=heads, num_key_value_heads=1, head_dim=16,
                                     in_channels=3 * CHANNELS, audio_acoustic_hidden_dim=CHANNELS, patch_size=2,
                                     sliding_window=4, encoder_hidden_size=COND_WIDTH)


def tiny_ace_step_conditioner():
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder

    return AceStepConditionEncoder(hidden_size=COND_WIDTH, intermediate_size=48, text_hidden_dim=TEXT_WIDTH,
                                   timbre_hidden_dim=CHANNELS, num_lyric_encoder_hidden_layers=1,
                                   num_timbre_encoder_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=12, sliding_window=4)


def tiny_ace_step_models(seed: int = 0):
    from diffusers import AutoencoderOobleck
    from transformers import Qwen3Config, Qwen3Model

    from support.z_image.tiny import z_image_tokenizer

    c = CHANNELS
    torch.manual_seed(seed)
    dit = tiny_ace_step_dit()
    cond = tiny_ace_step_conditioner()
    tokenizer = z_image_tokenizer()
    # the release's RoPE base: the family builds Qwen3-Embedding's config from the weights' sizes and its values
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                          head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                          tie_word_embeddings=True))
    vae = AutoencoderOobleck(encoder_hidden_size=2 * c, downsampling_ratios=[2, 4, 4, 6, 10],
                             channel_multiples=[1, 1, 1, 1, 1], decoder_channels=8, decoder_input_channels=c,
                             audio_channels=2, sampling_rate=RATE)
    silence = torch.randn(1, c, 800) * 0.1
    return dit, cond, text_encoder, tokenizer, vae, silence


def _original_state(dit, cond) -> dict:
    """One release file's tensors: the DiT, its condition encoder and the (unread) FSQ tokenizer's."""
    from difftune.families.ace_step.components import original_conditioner_keys, original_dit_keys

    g = torch.Generator().manual_seed(7)
    state = {**original_dit_keys(dit.state_dict()), **original_conditioner_keys(cond.state_dict()),
             "tokenizer.quantizer.project_in.weight": torch.randn(4, CHANNELS, generator=g),
             "tokenizer.quantizer.project_out.weight": torch.randn(CHANNELS, 4, generator=g),
             "detokenizer.proj_out.weight": torch.randn(CHANNELS, 4, generator=g)}
    return {k: v.contiguous() for k, v in state.items()}


def _original_config(dit, cond) -> dict:
    """config.json as the release writes it beside model.safetensors (its own class, not diffusers')."""
    d, e = dit.config, cond.config
    return {"architectures": ["AceStepConditionGenerationModel"], "model_type": "acestep", "is_turbo": True,
            "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
            "num_hidden_layers": d.num_hidden_layers, "num_attention_heads": d.num_attention_heads,
            "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim, "in_channels": d.in_channels,
            "audio_acoustic_hidden_dim": d.audio_acoustic_hidden_dim, "patch_size": d.patch_size,
            "encoder_hidden_size": d.encoder_hidden_size, "text_hidden_dim": e.text_hidden_dim,
            "timbre_hidden_dim": e.timbre_hidden_dim, "num_lyric_encoder_hidden_layers": 1,
            "num_timbre_encoder_hidden_layers": 1, "sliding_window": d.sliding_window, "fsq_dim": 4}


def write_tiny_ace_step_hub(hub: str | Path, seed: int = 0) -> Path:
    """The tiny release under `hub/ACE-Step/Ace-Step1.5` (once per folder); returns the repository folder."""
    from safetensors.torch import save_file

    repo = Path(hub) / REPO
    if (repo / DIT_FILE).is_file():
        return repo
    dit, cond, text_encoder, tokenizer, vae, silence = tiny_ace_step_models(seed)
    folder = (repo / DIT_FILE).parent
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(silence, folder / "silence_latent.pt")
    (folder / "config.json").write_text(json.dumps(_original_config(dit, cond)))
    text_encoder.save_pretrained(repo / TEXT_FOLDER)
    config = repo / TEXT_FOLDER / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "architectures": ["Qwen3ForCausalLM"]}))
    tokenizer.save_pretrained(repo / TEXT_FOLDER)
    vae.save_pretrained(repo / "vae")
    save_file(_original_state(dit, cond), str(repo / DIT_FILE))  # last: its presence marks the hub complete
    return repo


def write_tiny_ace_step_xl(folder: str | Path, seed: int = 1) -> list[Path]:
    """An XL release folder (`ACE-Step/acestep-v15-xl-*`): the wider DiT and a condition encoder as the original
    file, in two shards with their index and the original config.json; returns the shards."""
    from safetensors.torch import save_file

    folder = Path(folder)
    shards = [folder / name for name in XL_SHARDS]
    if all(p.is_file() for p in shards):
        return shards
    torch.manual_seed(seed)
    dit, cond = tiny_ace_step_dit(xl=True), tiny_ace_step_conditioner()
    state = _original_state(dit, cond)
    keys = sorted(state)
    # the DiT over both shards, as a split by size lands it
    parts = (keys[: len(keys) // 3], keys[len(keys) // 3:])
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for path, part in zip(shards, parts):
        save_file({k: state[k] for k in part}, str(path))
        weight_map.update({k: path.name for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({**_original_config(dit, cond), "is_turbo": False}))
    return shards


XL_REPO = "ACE-Step/acestep-v15-xl-base"


def write_tiny_ace_step_hubs(hub: str | Path) -> Path:
    """Both layouts under `hub`: the release (`ACE-Step/Ace-Step1.5`) and one XL repository; returns `hub`."""
    write_tiny_ace_step_hub(hub)
    write_tiny_ace_step_xl(Path(hub) / XL_REPO)
    return Path(hub)


def ace_step_model_paths(repo: Path) -> list[str]:
    return [str(repo / DIT_FILE), str(repo / TEXT_FOLDER / "model.safetensors"),
            str(repo / "vae" / "diffusion_pytorch_model.safetensors")]


def write_ace_step_dataset(root: Path, n: int = 2, seconds: float = 1.3) -> Path:
    """`n` short stereo 48 kHz clips with prompts and lyrics, as the reference's example data: the first row gives
    every optional metadata column, the others leave some out (the reference's defaults)."""
    import numpy as np

    from difftune.media.audio import write_audio

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    t = np.arange(int(seconds * RATE)) / RATE
    for i in range(n):
        wave = np.stack([np.sin(2 * np.pi * 220 * (i + 1) * t), np.sin(2 * np.pi * 330 * (i + 1) * t)]) * 0.4
        write_audio(wave.astype(np.float32), root / f"clip{i}.wav", RATE)
        row = {"audio": f"clip{i}.wav", "prompt": f"a tone of {220 * (i + 1)} hertz",
               "lyrics": "[Instrumental]" if i % 2 else "[verse]\nla la la", "bpm": 90 + 10 * i}
        if i == 0:
            row.update(keyscale="A minor", timesignature="3", vocal_language="en")
        rows.append(row)
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

__all__ = ["CHANNELS", "DIT_FILE", "REPO", "TEXT_FOLDER", "XL_REPO", "XL_SHARDS", "ace_step_model_paths",
           "tiny_ace_step_conditioner", "tiny_ace_step_dit", "tiny_ace_step_models",
           "write_ace_step_dataset", "write_tiny_ace_step_hub", "write_tiny_ace_step_hubs",
           "write_tiny_ace_step_xl"]
