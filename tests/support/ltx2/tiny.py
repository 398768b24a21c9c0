"""Tiny random LTX-2 / LTX-2.3 models in the layouts users download.

* `Lightricks/LTX-2` `ltx-2-19b-dev.safetensors`, `Lightricks/LTX-2.3` `ltx-2.3-22b-dev.safetensors` and
  `jd-opensource/JoyAI-Echo` `JoyAI-Echo-release.safetensors` (LTX-2.3's architecture): one file, every part in the
  official (Lightricks) names (`write_tiny_ltx2_official`, `write_tiny_joyai_echo`).
* `DiffSynth-Studio/LTX-2-Repackage`, `LTX-2.3-Repackage`: that file split in seven, still in the official names
  (`write_tiny_ltx2_repackage`).
* `google/gemma-3-12b-it-qat-q4_0-unquantized`: a Gemma-3 folder as the hub has it (transformers 4 names in two
  shards with their index, config.json with text and vision configs, a Gemma-style tokenizer) (`write_tiny_gemma3`).

The tiny sizes keep the real structure (the block types and counts of each VAE, 2.3's gated attention, cross-attention
AdaLN and per-modality projections, the vocoder's bandwidth extension) at small widths and one or two layers; the head widths
recognition cannot see in the weights are the real ones (2.0's 128 / 64; 2.3's heads show in its attention gates)
and Gemma keeps its 48 layers (the connectors' 49 inputs):

| | real | tiny |
|---|---|---|
| DiT video | 48 layers, 32 heads x 128, latents 128 | 2 layers; 2.0: 1 head x 128; 2.3: 2 heads x 8 (16); latents 8 |
| DiT audio | 32 heads x 64, in 128 (8 ch x 16 mel) | 2.0: 1 head x 64; 2.3: 2 heads x 4 (8); in 32 (2 ch x 16 mel) |
| Gemma-3 | 3840 wide, 48 layers (factor 49), 16 heads | 128 wide, 48 layers (factor 49), 1 head, vocabulary 320 |
| connectors 2.0 | 2 layers, 30 x 128, 128 registers | 2 layers, 1 x 128 (= Gemma width), 16 registers |
| connectors 2.3 | 8 layers, video 32 x 128, audio 32 x 64 | 2 layers, video 2 x 8, audio 2 x 4 |
| video VAE | 32x space, 8x time; widths 128..2048 | the same blocks and compression; widths 8..128, 1 layer a block |
| audio VAE | 16 kHz, 64 mel, hop 160, 4x time and mel, 8 latent ch, base 128 | the same, 2 latent ch, base 32 (= 2 x 16) |
| vocoder 2.0 | 1024 wide, 5 upsamplers (x240: 24 kHz) | 64 wide, the same upsamplers |
| vocoder 2.3 | 1536 + BWE 512, x160 then x3 (48 kHz) | 64 + BWE 32, the same rates; the real STFT and mel bases |

The audio VAE's latent statistics have `base_channels` entries and normalise the packed latent (channels x latent mel
bins), so base_channels = latent channels x 16 is kept (both shrunk together: 2 x 16 = 32, the DiT's audio input).
Every parameter gets seeded random values (nothing left zero or constant: a swapped name shows in a value check); the
tensors are written in float32 unless `dtype` says otherwise. The real files are bf16 and carry a `config` JSON in
their safetensors metadata, which these do not.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from difftune.families.ltx2 import names as N

VERSIONS = ("2", "2.3")
VIDEO_LATENT_CHANNELS = 8
AUDIO_LATENT_CHANNELS = 2
MEL_BINS = 64
LATENT_MEL_BINS = MEL_BINS // 4
AUDIO_IN_CHANNELS = AUDIO_LATENT_CHANNELS * LATENT_MEL_BINS
GEMMA_HIDDEN = 128  # a connector head of 2.0 (128 wide, as recognition expects)
GEMMA_LAYERS = 48  # Gemma-3-12B's: 49 hidden states, the connectors' text_proj_in_factor
JOYAI_DIT_SEED_OFFSET = 1000  # JoyAI-Echo's DiT: a fine-tune of LTX-2.3's, so other values; the rest is LTX-2.3's


def _version(version) -> str:
    v = str(version)
    if v in ("2", "2.0"):
        return "2"
    if v == "2.3":
        return "2.3"
    raise ValueError(f"LTX-2 version {version!r}: one of {VERSIONS}")


# -- configs -------------------------------------------------------------------------------------------------------

def tiny_dit_config(version="2") -> dict:
    v = _version(version)
    cfg = dict(in_channels=VIDEO_LATENT_CHANNELS, out_channels=VIDEO_LATENT_CHANNELS, patch_size=1, patch_size_t=1,
               num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, vae_scale_factors=(8, 32, 32),
               pos_embed_max_pos=20, base_height=2048, base_width=2048, audio_in_channels=AUDIO_IN_CHANNELS,
               audio_out_channels=AUDIO_IN_CHANNELS, audio_patch_size=1, audio_patch_size_t=1,
               audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
               audio_scale_factor=4, audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160,
               num_layers=2, activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
               norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=GEMMA_HIDDEN, attention_bias=True,
               attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
               timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
               use_prompt_embeddings=True, perturbed_attn=False, gated_attn=False, cross_attn_mod=False,
               audio_gated_attn=False, audio_cross_attn_mod=False)
    if v == "2":  # 2.0's heads are 128 (video) and 64 (audio) wide, as recognition expects: one of each
        cfg.update(num_attention_heads=1, attention_head_dim=128, cross_attention_dim=128,
                   audio_num_attention_heads=1, audio_attention_head_dim=64, audio_cross_attention_dim=64)
    if v == "2.3":
        cfg.update(gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
                   use_prompt_embeddings=False, perturbed_attn=True)
    return cfg


def tiny_connectors_config(version="2") -> dict:
    v = _version(version)
    cfg = dict(caption_channels=GEMMA_HIDDEN, text_proj_in_factor=GEMMA_LAYERS + 1,
               video_connector_num_attention_heads=1, video_connector_attention_head_dim=GEMMA_HIDDEN,
               video_connector_num_layers=2, video_connector_num_learnable_registers=16, video_gated_attn=False,
               audio_connector_num_attention_heads=1, audio_connector_attention_head_dim=GEMMA_HIDDEN,
               audio_connector_num_layers=2, audio_connector_num_learnable_registers=16, audio_gated_attn=False,
               connector_rope_base_seq_len=4096, rope_theta=10000.0, rope_double_precision=True,
               causal_temporal_positioning=False, rope_type="split", per_modality_projections=False, proj_bias=False)
    if v == "2.3":
        dit = tiny_dit_config(v)
        cfg.update(video_connector_num_attention_heads=dit["num_attention_heads"],
                   video_connector_attention_head_dim=dit["attention_head_dim"], video_gated_attn=True,
                   audio_connector_num_attention_heads=dit["audio_num_attention_heads"],
                   audio_connector_attention_head_dim=dit["audio_attention_head_dim"], audio_gated_attn=True,
                   per_modality_projections=True, proj_bias=True,
                   video_hidden_dim=dit["num_attention_heads"] * dit["attention_head_dim"],
                   audio_hidden_dim=dit["audio_num_attention_heads"] * dit["audio_attention_head_dim"])
    return cfg


def tiny_video_vae_config(version="2") -> dict:
    c = VIDEO_LATENT_CHANNELS
    common = dict(in_channels=3, out_channels=3, latent_channels=c, patch_size=4, patch_size_t=1, resnet_norm_eps=1e-6,
                  down_block_types=("LTX2VideoDownBlock3D",) * 4, spatio_temporal_scaling=(True,) * 4,
                  downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                  layers_per_block=(1, 1, 1, 1, 1), timestep_conditioning=False, encoder_causal=True,
                  decoder_causal=False, encoder_spatial_padding_mode="zeros", spatial_compression_ratio=32,
                  temporal_compression_ratio=8)
    if _version(version) == "2":  # real: (256, 512, 1024, 2048) / (256, 512, 1024), layers (4,6,6,2,2) / (5,5,5,5)
        return dict(common, block_out_channels=(2 * c, 4 * c, 8 * c, 16 * c), decoder_block_out_channels=(2 * c, 4 * c, 8 * c),
                    decoder_layers_per_block=(1, 1, 1, 1), decoder_spatio_temporal_scaling=(True,) * 3,
                    decoder_inject_noise=(False,) * 4, upsample_type=("spatiotemporal",) * 3,
                    upsample_residual=(True,) * 3, upsample_factor=(2, 2, 2), decoder_spatial_padding_mode="reflect")
    # real: (256, 512, 1024, 1024) / (256, 512, 512, 1024), layers (4,6,4,2,2) both
    return dict(common, block_out_channels=(2 * c, 4 * c, 8 * c, 8 * c), decoder_block_out_channels=(2 * c, 4 * c, 4 * c, 8 * c),
                decoder_layers_per_block=(1, 1, 1, 1, 1), decoder_spatio_temporal_scaling=(True,) * 4,
                decoder_inject_noise=(False,) * 5, upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
                upsample_residual=(False,) * 4, upsample_factor=(2, 2, 1, 2), decoder_spatial_padding_mode="zeros")


def tiny_audio_vae_config(version="2") -> dict:
    _version(version)  # the same in 2.0 and 2.3
    return dict(base_channels=AUDIO_LATENT_CHANNELS * LATENT_MEL_BINS, output_channels=2, ch_mult=(1, 2, 4),
                num_res_blocks=1, attn_resolutions=None, in_channels=2, resolution=256,
                latent_channels=AUDIO_LATENT_CHANNELS, norm_type="pixel", causality_axis="height", dropout=0.0,
                mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
                mel_bins=MEL_BINS, double_z=True)


def tiny_vocoder_config(version="2") -> dict:
    if _version(version) == "2":
        return dict(in_channels=2 * MEL_BINS, hidden_channels=64, out_channels=2, upsample_kernel_sizes=[16, 15, 8, 4, 4],
                    upsample_factors=[6, 5, 2, 2, 2], resnet_kernel_sizes=[3, 7], resnet_dilations=[[1, 3, 5], [1, 3, 5]],
                    act_fn="leaky_relu", leaky_relu_negative_slope=0.1, antialias=False, final_act_fn="tanh",
                    final_bias=True, output_sampling_rate=24000)
    return dict(in_channels=2 * MEL_BINS, hidden_channels=64, out_channels=2, upsample_kernel_sizes=[11, 4, 4, 4, 4, 4],
                upsample_factors=[5, 2, 2, 2, 2, 2], resnet_kernel_sizes=[3, 7], resnet_dilations=[[1, 3, 5], [1, 3, 5]],
                act_fn="snakebeta", leaky_relu_negative_slope=0.1, antialias=True, antialias_ratio=2,
                antialias_kernel_size=12, final_act_fn=None, final_bias=False, bwe_in_channels=128,
                bwe_hidden_channels=32, bwe_out_channels=2, bwe_upsample_kernel_sizes=[12, 11, 4, 4, 4],
                bwe_upsample_factors=[6, 5, 2, 2, 2], bwe_resnet_kernel_sizes=[3, 7],
                bwe_resnet_dilations=[[1, 3, 5], [1, 3, 5]], bwe_act_fn="snakebeta", bwe_leaky_relu_negative_slope=0.1,
                bwe_antialias=True, bwe_antialias_ratio=2, bwe_antialias_kernel_size=12, bwe_final_act_fn=None,
                bwe_final_bias=False, filter_length=512, hop_length=80, window_length=512, num_mel_channels=64,
                input_sampling_rate=16000, output_sampling_rate=48000)


def tiny_configs(version="2") -> dict:
    """part (`names.PARTS`) -> its tiny config."""
    return {"dit": tiny_dit_config(version), "connectors": tiny_connectors_config(version),
            "video_vae": tiny_video_vae_config(version), "audio_vae": tiny_audio_vae_config(version),
            "vocoder": tiny_vocoder_config(version)}


def ltx2_classes(version="2") -> dict:
    """part (`names.PARTS`) -> its diffusers class."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    return {"dit": LTX2VideoTransformer3DModel, "connectors": LTX2TextConnectors, "video_vae": AutoencoderKLLTX2Video,
            "audio_vae": AutoencoderKLLTX2Audio,
            "vocoder": LTX2Vocoder if _version(version) == "2" else LTX2VocoderWithBWE}


# -- the real sizes (diffusers' configs of the released models, for shape-only checks on the meta device) -----------

def real_configs(version="2") -> dict:
    """part -> the diffusers config of the released model (Lightricks/LTX-2, LTX-2.3), as diffusers' conversion
    script (`scripts/convert_ltx2_to_diffusers.py`) builds them; the audio VAE and the vocoders are the classes'
    defaults. Build them on the meta device: the DiT alone is 19B / 22B parameters."""
    v = _version(version)
    dit = dict(tiny_dit_config(v), in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128,
               cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32,
               audio_attention_head_dim=64, audio_cross_attention_dim=2048, num_layers=48, caption_channels=3840)
    connectors = dict(tiny_connectors_config("2"), caption_channels=3840, text_proj_in_factor=49,
                      video_connector_num_attention_heads=30, video_connector_attention_head_dim=128,
                      video_connector_num_learnable_registers=128, audio_connector_num_attention_heads=30,
                      audio_connector_attention_head_dim=128, audio_connector_num_learnable_registers=128)
    video_vae = dict(tiny_video_vae_config(v), latent_channels=128, layers_per_block=(4, 6, 6, 2, 2),
                     block_out_channels=(256, 512, 1024, 2048), decoder_block_out_channels=(256, 512, 1024),
                     decoder_layers_per_block=(5, 5, 5, 5))
    if v == "2.3":
        connectors.update(video_connector_num_attention_heads=32, video_connector_num_layers=8, video_gated_attn=True,
                          audio_connector_num_attention_heads=32, audio_connector_attention_head_dim=64,
                          audio_connector_num_layers=8, audio_gated_attn=True, per_modality_projections=True,
                          video_hidden_dim=4096, audio_hidden_dim=2048, proj_bias=True)
        video_vae.update(layers_per_block=(4, 6, 4, 2, 2), block_out_channels=(256, 512, 1024, 1024),
                         decoder_block_out_channels=(256, 512, 512, 1024), decoder_layers_per_block=(4, 6, 4, 2, 2))
    return {"dit": dit, "connectors": connectors, "video_vae": video_vae, "audio_vae": {}, "vocoder": {}}


# -- Gemma-3 ---------------------------------------------------------------------------------------------------------

GEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                 "<end_of_image>", "<image_soft_token>")
_GEMMA_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()\n\u2581"
# a chat template in Gemma's turn format (the tokenizer's own is longer: system prompts, images, tools)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('')) | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def gemma3_tokenizer():
    """A Gemma-style BPE tokenizer (spaces as "\u2581", byte fallback for anything else, `<bos>` in front): Gemma's
    special ids (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4), its turn and image tokens, 256 byte tokens, single
    characters and a few merges. Built by hand, so identical in every process."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(GEMMA_SPECIAL)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in _GEMMA_CHARS:
        vocab.setdefault(ch, len(vocab))
    merges = [("\u2581", "a"), ("c", "a"), ("ca", "t"), ("\u2581", "ca"), ("\u2581ca", "t"), ("t", "h"), ("\u2581", "th")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False,
                         extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                               "image_token": "<image_soft_token>"})
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    return tok


def tiny_gemma3_config(vocab_size: int) -> dict:
    """config.json of a Gemma3ForConditionalGeneration as the hub has it (transformers 4.5x keys) at a tiny size."""
    ids = {t: i for i, t in enumerate(GEMMA_SPECIAL)}
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "initializer_range": 0.02, "mm_tokens_per_image": 4, "torch_dtype": "float32",
        "transformers_version": "4.50.0.dev0",
        "text_config": {
            "model_type": "gemma3_text", "vocab_size": vocab_size, "hidden_size": GEMMA_HIDDEN,
            "intermediate_size": 64, "num_hidden_layers": GEMMA_LAYERS, "num_attention_heads": 1,
            "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 8, "sliding_window_pattern": 2, "attention_bias": False, "attention_dropout": 0.0,
            "attn_logit_softcapping": None, "final_logit_softcapping": None, "pad_token_id": ids["<pad>"],
            "bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"], "use_cache": True,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_channels": 3, "image_size": 28, "patch_size": 14,
            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "attention_dropout": 0.0,
            "vision_use_head": False,
        },
    }


# transformers 5's Gemma3ForConditionalGeneration names -> the hub files' (transformers 4's), first match
GEMMA3_TO_HUB = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower.vision_model."),
                 ("model.multi_modal_projector.", "multi_modal_projector."))
GEMMA3_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def gemma3_hub_names(state: dict) -> dict:
    """A transformers 5 Gemma3ForConditionalGeneration state dict in the hub files' names (the tied `lm_head` left
    out, as the hub leaves it)."""
    out = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            continue
        for new, old in GEMMA3_TO_HUB:
            if key.startswith(new):
                key = old + key[len(new):]
                break
        out[key] = value
    return out


def tiny_gemma3(seed: int = 0):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = gemma3_tokenizer()
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(Gemma3Config.from_dict(tiny_gemma3_config(len(tok))))
    _randomize(model, seed)
    return model.eval()


def write_tiny_gemma3(folder, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> Path:
    """`folder` as google/gemma-3-12b-it-qat-q4_0-unquantized has it: config.json, the weights in two shards (the
    language model in the first, the vision tower and projector in the second) with model.safetensors.index.json,
    tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = gemma3_tokenizer()
    model = tiny_gemma3(seed)
    state = gemma3_hub_names({k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()})
    shards = ({k: v for k, v in state.items() if k.startswith("language_model.")},
              {k: v for k, v in state.items() if not k.startswith("language_model.")})
    weight_map, total = {}, 0
    for name, shard in zip(GEMMA3_SHARDS, shards):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (folder / "config.json").write_text(json.dumps(tiny_gemma3_config(len(tok)), indent=2))
    tok.save_pretrained(str(folder))
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return folder


# -- the LTX-2 models ------------------------------------------------------------------------------------------------

def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded values for every parameter: each keeps its init's scale plus noise of its own (a norm's weight stays near
    its 1 or 0, a zero-initialised table or projection gets random entries); scalars (a VAE's timestep multiplier)
    are left as they are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim == 0 or not p.is_floating_point():
                continue
            scale = 0.1 if p.ndim == 1 else 0.3 / math.sqrt(p[0].numel())
            p.add_(torch.randn(p.shape, generator=g), alpha=scale)


def _latent_statistics(vae, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 17)
    n = vae.latents_mean.numel()
    vae.latents_mean.copy_(torch.randn(n, generator=g) * 0.2)
    vae.latents_std.copy_(0.5 + torch.rand(n, generator=g))


def _mel_stft_bases(vocoder) -> None:
    """LTX-2.3's vocoder reads its STFT and mel bases from the file (zeros in diffusers' init): a causal Hann-windowed
    DFT (real rows, then imaginary) and a triangular mel filterbank on the HTK mel scale (16 kHz, 512-point FFT)."""
    stft = vocoder.mel_stft.stft_fn
    n_fft = stft.forward_basis.shape[-1]
    n_freqs = n_fft // 2 + 1
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(n_freqs, dtype=torch.float64)[:, None]
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    angle = 2 * math.pi * k * n / n_fft
    basis = torch.cat([torch.cos(angle) * window, -torch.sin(angle) * window])[:, None, :]
    stft.forward_basis.copy_(basis.float())
    stft.inverse_basis.copy_((basis / n_fft).float())
    sr = vocoder.config.input_sampling_rate
    n_mels = vocoder.mel_stft.mel_basis.shape[0]
    mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)  # noqa: E731
    edges = torch.linspace(mel(0.0), mel(sr / 2), n_mels + 2, dtype=torch.float64)
    hz = 700.0 * (10 ** (edges / 2595.0) - 1.0)
    freqs = torch.linspace(0, sr / 2, n_freqs, dtype=torch.float64)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    tri = torch.clamp(torch.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), min=0.0)
    vocoder.mel_stft.mel_basis.copy_(tri.float())


def tiny_ltx2_models(version="2", seed: int = 0) -> dict:
    """The tiny models of one version: "dit" (LTX2VideoTransformer3DModel), "connectors" (LTX2TextConnectors),
    "video_vae" (AutoencoderKLLTX2Video), "audio_vae" (AutoencoderKLLTX2Audio), "vocoder" (LTX2Vocoder; 2.3:
    LTX2VocoderWithBWE) and "text_encoder" (Gemma3ForConditionalGeneration; `gemma3_tokenizer()` is its
    tokenizer), seeded: the same seed gives the same values in every process."""
    v = _version(version)
    classes, configs = ltx2_classes(v), tiny_configs(v)
    built = {}
    for i, part in enumerate(N.PARTS):
        torch.manual_seed(seed * 100 + i)
        model = classes[part](**configs[part])
        _randomize(model, seed * 100 + i)
        built[part] = model
    with torch.no_grad():
        _latent_statistics(built["video_vae"], seed)
        _latent_statistics(built["audio_vae"], seed + 1)
        if v == "2.3":
            _mel_stft_bases(built["vocoder"])
    built["text_encoder"] = tiny_gemma3(seed)
    return {k: m.eval() for k, m in built.items()}


def tiny_joyai_echo_models(seed: int = 0) -> dict:
    """JoyAI-Echo's tiny models: LTX-2.3's, the DiT at other values (the fine-tune's)."""
    models = tiny_ltx2_models("2.3", seed)
    models["dit"] = tiny_ltx2_dit("2.3", seed + JOYAI_DIT_SEED_OFFSET)
    return models


def tiny_ltx2_dit(version="2", seed: int = 0):
    """`tiny_ltx2_models(version, seed)["dit"]` alone."""
    torch.manual_seed(seed * 100)
    dit = ltx2_classes(version)["dit"](**tiny_dit_config(version))
    _randomize(dit, seed * 100)
    return dit.eval()


def dropped_statistics(version="2", seed: int = 0) -> dict:
    """The video VAE statistics LTX-2.0's file has and diffusers drops (LTX-2.3's file has none): `channel` (the
    index), `mean-of-stds` and `mean-of-stds_over_std-of-means`, one entry a latent channel."""
    if _version(version) != "2":
        return {}
    g = torch.Generator().manual_seed(seed + 29)
    c = VIDEO_LATENT_CHANNELS
    stds = 0.5 + torch.rand(c, generator=g)
    return {"vae.per_channel_statistics.channel": torch.arange(c, dtype=torch.float32),
            "vae.per_channel_statistics.mean-of-stds": stds,
            "vae.per_channel_statistics.mean-of-stds_over_std-of-means": stds / (0.5 + torch.rand(c, generator=g))}


def official_state(models: dict, version="2", seed: int = 0, *, dtype: torch.dtype = torch.float32) -> dict:
    """The official single file's tensors for these models (as `tiny_ltx2_models` returns them)."""
    parts = {p: {k: t.detach() for k, t in models[p].state_dict().items()} for p in N.PARTS}
    state = {**N.diffusers_to_single_file(parts), **dropped_statistics(version, seed)}
    return {k: v.to(dtype).contiguous() for k, v in state.items()}


@functools.lru_cache(maxsize=8)
def _official(kind: str, seed: int, dtype: torch.dtype) -> dict:
    """One process builds each tiny set once (the writers only read it)."""
    if kind == "joyai":
        return official_state(tiny_joyai_echo_models(seed), "2.3", seed, dtype=dtype)
    return official_state(tiny_ltx2_models(kind, seed), kind, seed, dtype=dtype)


def _save(state: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def write_tiny_ltx2_official(folder, version="2", seed: int = 0, *, dtype: torch.dtype = torch.float32) -> Path:
    """`folder/ltx-2-19b-dev.safetensors` (2) or `folder/ltx-2.3-22b-dev.safetensors` (2.3): every part in one file,
    in the official names."""
    v = _version(version)
    return _save(_official(v, seed, dtype), Path(folder) / N.OFFICIAL_FILES[v])


def write_tiny_ltx2_repackage(folder, version="2", seed: int = 0, *, dtype: torch.dtype = torch.float32) -> dict:
    """The seven files of DiffSynth-Studio/LTX-2-Repackage (or LTX-2.3-Repackage) in `folder`: file name -> path."""
    parts = N.split_single_file(_official(_version(version), seed, dtype))
    return {name: _save(part, Path(folder) / name) for name, part in parts.items()}


def write_tiny_joyai_echo(folder, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> Path:
    """`folder/JoyAI-Echo-release.safetensors`: the official single-file layout, LTX-2.3's architecture."""
    return _save(_official("joyai", seed, dtype), Path(folder) / N.JOYAI_ECHO_FILE)


# a diffusers repository's folder of each part (Lightricks/LTX-2's diffusers layout)
DIFFUSERS_FOLDERS = {"dit": "transformer", "connectors": "connectors", "video_vae": "vae", "audio_vae": "audio_vae",
                     "vocoder": "vocoder", "text_encoder": "text_encoder"}


def write_tiny_ltx2_diffusers(folder, version="2", seed: int = 0) -> Path:
    """`folder` in diffusers' layout: each part's save_pretrained folder (config.json beside its weights, the whole
    VAEs in vae/ and audio_vae/) and tokenizer/ beside text_encoder/; the same models as the official file's."""
    folder = Path(folder)
    models = tiny_ltx2_models(version, seed)
    for part, name in DIFFUSERS_FOLDERS.items():
        models[part].save_pretrained(str(folder / name), safe_serialization=True)
    gemma3_tokenizer().save_pretrained(str(folder / "tokenizer"))
    return folder


__all__ = [
    "DIFFUSERS_FOLDERS", "write_tiny_ltx2_diffusers",
    "AUDIO_IN_CHANNELS", "AUDIO_LATENT_CHANNELS", "GEMMA3_SHARDS", "GEMMA_HIDDEN", "GEMMA_LAYERS", "LATENT_MEL_BINS",
    "MEL_BINS", "VERSIONS", "VIDEO_LATENT_CHANNELS", "dropped_statistics", "ltx2_classes", "gemma3_hub_names", "gemma3_tokenizer",
    "official_state", "real_configs", "tiny_audio_vae_config", "tiny_configs", "tiny_connectors_config", "tiny_dit_config", "tiny_gemma3",
    "tiny_gemma3_config", "tiny_joyai_echo_models", "tiny_ltx2_dit", "tiny_ltx2_models", "tiny_video_vae_config",
    "tiny_vocoder_config", "write_tiny_gemma3", "write_tiny_joyai_echo", "write_tiny_ltx2_official",
    "write_tiny_ltx2_repackage",
]
