"""A tiny Wan-AI/Wan2.2-S2V-14B in the released layout: `diffusion_pytorch_model.safetensors` (Wan's key names,
with its config.json, class WanModel_S2V), `wav2vec2-large-xlsr-53-english/` (a Wav2Vec2ForCTC file in the older
weight-norm names, config.json, preprocessor_config.json, vocab), the UMT5 / VAE .pth files and the tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .common import TEXT_DIM, randomise, wan_common_files

WAV2VEC_FOLDER = "wav2vec2-large-xlsr-53-english"
WAV2VEC_HIDDEN = 32
WAV2VEC_LAYERS = 2


def tiny_wav2vec2(seed: int = 7):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(seed)
    config = Wav2Vec2Config(hidden_size=WAV2VEC_HIDDEN, num_hidden_layers=WAV2VEC_LAYERS, num_attention_heads=2,
                            intermediate_size=37, conv_dim=[16] * 7, num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=2, do_stable_layer_norm=True, feat_extract_norm="layer",
                            vocab_size=33, architectures=["Wav2Vec2ForCTC"])
    return Wav2Vec2ForCTC(config).eval()


def write_tiny_wav2vec2(folder: str | os.PathLike, seed: int = 7) -> Path:
    """The wav2vec2 folder as Wan-AI/Wan2.2-S2V-14B holds it: model.safetensors with the positional convolution's
    weight norm as `weight_g` / `weight_v` (older transformers' names), config.json, the feature extractor's
    preprocessor_config.json and the CTC tokenizer's vocab."""
    from safetensors.torch import save_file
    from transformers import Wav2Vec2FeatureExtractor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_wav2vec2(seed)
    old = {"parametrizations.weight.original0": "weight_g", "parametrizations.weight.original1": "weight_v"}
    state = {}
    for key, value in model.state_dict().items():
        for new, name in old.items():
            key = key.replace(new, name)
        state[key] = value.contiguous()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=True).save_pretrained(str(folder))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4,
             **{chr(ord("A") + i): 5 + i for i in range(26)}, "'": 31, "-": 32}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    return folder


def tiny_s2v_dit(seed: int = 11, num_layers: int = 2):
    from difftune.families.wan.s2v.model import WanModel_S2V

    torch.manual_seed(seed)
    dit = WanModel_S2V(dim=16, in_dim=16, ffn_dim=32, out_dim=16, text_dim=TEXT_DIM, freq_dim=16, num_heads=2,
                       num_layers=num_layers, cond_dim=16, audio_dim=WAV2VEC_HIDDEN, num_audio_token=4,
                       audio_layers=WAV2VEC_LAYERS + 1, audio_inject_layers=list(range(num_layers)))
    return randomise(dit, seed)


def write_tiny_s2v(root: str | os.PathLike, seed: int = 11) -> Path:
    """`root` laid out as Wan-AI/Wan2.2-S2V-14B (the files the reference's S2V scripts name)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tiny_s2v_dit(seed).save_pretrained(str(root))
    write_tiny_wav2vec2(root / WAV2VEC_FOLDER)
    wan_common_files(root)
    return root


__all__ = ["WAV2VEC_FOLDER", "tiny_s2v_dit", "tiny_wav2vec2", "write_tiny_s2v", "write_tiny_wav2vec2"]
