"""LTX-2 / LTX-2.3 / JoyAI-Echo components: the released configs, how the files are recognised, the slots.

The slots are the reference's (`dit`, `text_encoder`, `text_encoder_post_modules`, `video_vae_encoder`,
`video_vae_decoder`, `audio_vae_encoder`, `audio_vae_decoder`, `audio_vocoder`), so its `--trainable_models` and
`--remove_prefix_in_ckpt pipe.dit.` mean what they say. The classes are diffusers' (`LTX2VideoTransformer3DModel`,
`LTX2TextConnectors`, the two VAEs' halves in `models.py`, `LTX2Vocoder` / `LTX2VocoderWithBWE`) and transformers'
`Gemma3ForConditionalGeneration` (its language model encodes the prompt; the folder's config.json describes it).

Every part is read from the official names (the single file, DiffSynth-Studio's Repackage files: `names.py`) or
from diffusers' own (a diffusers folder). The official files carry no config the loader reads, so the config is
the release's with the sizes the weights show: widths, depths, channels, kernel sizes. What the weights do not show
is the release's: 2.0's head widths (128 for video and the connectors, 64 for audio; 2.3's heads show in its
attention gates), Gemma-3-12B's 49 hidden states behind the connectors, the VAEs' and vocoder's strides.
"""

from __future__ import annotations

import re

from ...models.detect import ComponentSpec
from . import names as N

VIDEO_HEAD_DIM, AUDIO_HEAD_DIM, CONNECTOR_HEAD_DIM = 128, 64, 128  # LTX-2.0's, which its weights do not show
GEMMA_HIDDEN_STATES = 49  # Gemma-3-12B: 48 layers and the embeddings, stacked into the connectors' input

# diffusers' configs of the releases (as diffusers' conversion script builds them)
DIT_CONFIG = {
    "in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 32,
    "attention_head_dim": 128, "cross_attention_dim": 4096, "vae_scale_factors": [8, 32, 32], "pos_embed_max_pos": 20,
    "base_height": 2048, "base_width": 2048, "audio_in_channels": 128, "audio_out_channels": 128,
    "audio_patch_size": 1, "audio_patch_size_t": 1, "audio_num_attention_heads": 32, "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048, "audio_scale_factor": 4, "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000, "audio_hop_length": 160, "num_layers": 48, "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-06, "caption_channels": 3840,
    "attention_bias": True, "attention_out_bias": True, "rope_theta": 10000.0, "rope_double_precision": True,
    "causal_offset": 1, "timestep_scale_multiplier": 1000, "cross_attn_timestep_scale_multiplier": 1000,
    "rope_type": "split", "use_prompt_embeddings": True, "perturbed_attn": False, "gated_attn": False,
    "cross_attn_mod": False, "audio_gated_attn": False, "audio_cross_attn_mod": False}
DIT_CONFIG_23 = {**DIT_CONFIG, "use_prompt_embeddings": False, "perturbed_attn": True, "gated_attn": True,
                 "cross_attn_mod": True, "audio_gated_attn": True, "audio_cross_attn_mod": True}
CONNECTORS_CONFIG = {
    "caption_channels": 3840, "text_proj_in_factor": GEMMA_HIDDEN_STATES, "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128, "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128, "video_gated_attn": False,
    "audio_connector_num_attention_heads": 30, "audio_connector_attention_head_dim": 128,
    "audio_connector_num_layers": 2, "audio_connector_num_learnable_registers": 128, "audio_gated_attn": False,
    "connector_rope_base_seq_len": 4096, "rope_theta": 10000.0, "rope_double_precision": True,
    "causal_temporal_positioning": False, "rope_type": "split", "per_modality_projections": False,
    "proj_bias": False}
CONNECTORS_CONFIG_23 = {
    **CONNECTORS_CONFIG, "video_connector_num_attention_heads": 32, "video_connector_num_layers": 8,
    "video_gated_attn": True, "audio_connector_num_attention_heads": 32, "audio_connector_attention_head_dim": 64,
    "audio_connector_num_layers": 8, "audio_gated_attn": True, "per_modality_projections": True,
    "video_hidden_dim": 4096, "audio_hidden_dim": 2048, "proj_bias": True}
VIDEO_VAE_CONFIG = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4, "patch_size_t": 1,
    "resnet_norm_eps": 1e-06, "down_block_types": ["LTX2VideoDownBlock3D"] * 4,
    "spatio_temporal_scaling": [True] * 4, "downsample_type": ["spatial", "temporal", "spatiotemporal",
                                                              "spatiotemporal"],
    "layers_per_block": [4, 6, 6, 2, 2], "timestep_conditioning": False, "encoder_causal": True,
    "decoder_causal": False, "encoder_spatial_padding_mode": "zeros", "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 8, "block_out_channels": [256, 512, 1024, 2048],
    "decoder_block_out_channels": [256, 512, 1024], "decoder_layers_per_block": [5, 5, 5, 5],
    "decoder_spatio_temporal_scaling": [True] * 3, "decoder_inject_noise": [False] * 4,
    "upsample_type": ["spatiotemporal"] * 3, "upsample_residual": [True] * 3, "upsample_factor": [2, 2, 2],
    "decoder_spatial_padding_mode": "reflect"}
VIDEO_VAE_CONFIG_23 = {
    **VIDEO_VAE_CONFIG, "layers_per_block": [4, 6, 4, 2, 2], "block_out_channels": [256, 512, 1024, 1024],
    "decoder_block_out_channels": [256, 512, 512, 1024], "decoder_layers_per_block": [4, 6, 4, 2, 2],
    "decoder_spatio_temporal_scaling": [True] * 4, "decoder_inject_noise": [False] * 5,
    "upsample_type": ["spatiotemporal", "spatiotemporal", "temporal", "spatial"], "upsample_residual": [False] * 4,
    "upsample_factor": [2, 2, 1, 2], "decoder_spatial_padding_mode": "zeros"}
AUDIO_VAE_CONFIG = {
    "base_channels": 128, "output_channels": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 2, "attn_resolutions": None,
    "in_channels": 2, "resolution": 256, "latent_channels": 8, "norm_type": "pixel", "causality_axis": "height",
    "dropout": 0.0, "mid_block_add_attention": False, "sample_rate": 16000, "mel_hop_length": 160, "is_causal": True,
    "mel_bins": 64, "double_z": True}
VOCODER_CONFIG = {
    "in_channels": 128, "hidden_channels": 1024, "out_channels": 2, "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_factors": [6, 5, 2, 2, 2], "resnet_kernel_sizes": [3, 7, 11], "resnet_dilations": [[1, 3, 5]] * 3,
    "act_fn": "leaky_relu", "leaky_relu_negative_slope": 0.1, "antialias": False, "final_act_fn": "tanh",
    "final_bias": True, "output_sampling_rate": 24000}
VOCODER_CONFIG_23 = {
    "in_channels": 128, "hidden_channels": 1536, "out_channels": 2, "upsample_kernel_sizes": [11, 4, 4, 4, 4, 4],
    "upsample_factors": [5, 2, 2, 2, 2, 2], "resnet_kernel_sizes": [3, 7, 11], "resnet_dilations": [[1, 3, 5]] * 3,
    "act_fn": "snakebeta", "leaky_relu_negative_slope": 0.1, "antialias": True, "antialias_ratio": 2,
    "antialias_kernel_size": 12, "final_act_fn": None, "final_bias": False, "bwe_in_channels": 128,
    "bwe_hidden_channels": 512, "bwe_out_channels": 2, "bwe_upsample_kernel_sizes": [12, 11, 4, 4, 4],
    "bwe_upsample_factors": [6, 5, 2, 2, 2], "bwe_resnet_kernel_sizes": [3, 7, 11],
    "bwe_resnet_dilations": [[1, 3, 5]] * 3, "bwe_act_fn": "snakebeta", "bwe_leaky_relu_negative_slope": 0.1,
    "bwe_antialias": True, "bwe_antialias_ratio": 2, "bwe_antialias_kernel_size": 12, "bwe_final_act_fn": None,
    "bwe_final_bias": False, "filter_length": 512, "hop_length": 80, "window_length": 512, "num_mel_channels": 64,
    "input_sampling_rate": 16000, "output_sampling_rate": 48000}

# The reference's LoRA targets (its scripts' --lora_target_modules): diffusers' names too.
LORA_TARGET_MODULES = "to_k,to_q,to_v,to_out.0"


# -- which part a key is -----------------------------------------------------------------------------------------

def part_of(key: str) -> str | None:
    """The part (`names.PARTS`) an official key belongs to; None for a key in no official prefix."""
    if key.startswith(N.DIT_PREFIX):
        return "connectors" if key[len(N.DIT_PREFIX):].startswith(N.CONNECTOR_MODULES) else "dit"
    for prefix, part in ((N.TEXT_PROJECTION_PREFIX, "connectors"), (N.VIDEO_VAE_PREFIX, "video_vae"),
                         (N.AUDIO_VAE_PREFIX, "audio_vae"), (N.VOCODER_PREFIX, "vocoder")):
        if key.startswith(prefix):
            return part
    return None


def _official(part: str, half: str | None = None):
    """The converter of one part out of any official file (a whole single file, a Repackage file); a file in
    diffusers' names (no official prefix) passes through. `half`: only the encoder's or decoder's keys and the
    latent statistics."""
    def convert(state: dict) -> dict:
        if not any(part_of(k) for k in state):
            out = dict(state)
        else:
            out = N.TO_DIFFUSERS[part]({k: v for k, v in state.items() if part_of(k) == part})
        if half is not None:
            out = {k: v for k, v in out.items() if k.startswith(half + ".") or k in ("latents_mean", "latents_std")}
        return out

    return convert


def _count(shapes: dict, pattern: str) -> int:
    found = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


# -- configs from the weights -----------------------------------------------------------------------------------

def dit_config(shapes: dict) -> dict | None:
    if "proj_in.weight" not in shapes or "audio_proj_in.weight" not in shapes:
        return None
    v23 = "prompt_adaln.linear.weight" in shapes
    inner, cin = shapes["proj_in.weight"]
    audio_inner, audio_cin = shapes["audio_proj_in.weight"]
    gate, audio_gate = (shapes.get(f"transformer_blocks.0.{a}.to_gate_logits.weight") for a in ("attn1", "audio_attn1"))
    heads = gate[0] if gate else inner // VIDEO_HEAD_DIM
    audio_heads = audio_gate[0] if audio_gate else audio_inner // AUDIO_HEAD_DIM
    if not heads or not audio_heads or inner % heads or audio_inner % audio_heads:
        return None
    config = {**(DIT_CONFIG_23 if v23 else DIT_CONFIG),
              "in_channels": cin, "out_channels": shapes["proj_out.weight"][0], "num_attention_heads": heads,
              "attention_head_dim": inner // heads, "audio_in_channels": audio_cin,
              "audio_out_channels": shapes["audio_proj_out.weight"][0], "audio_num_attention_heads": audio_heads,
              "audio_attention_head_dim": audio_inner // audio_heads,
              "num_layers": _count(shapes, r"^transformer_blocks\.(\d+)\."),
              "cross_attention_dim": shapes["transformer_blocks.0.attn2.to_k.weight"][1],
              "audio_cross_attention_dim": shapes["transformer_blocks.0.audio_attn2.to_k.weight"][1]}
    if "caption_projection.linear_1.weight" in shapes:
        config["caption_channels"] = shapes["caption_projection.linear_1.weight"][1]
    return config


def connectors_config(shapes: dict) -> dict | None:
    if "video_connector.learnable_registers" not in shapes:
        return None
    v23 = "video_text_proj_in.weight" in shapes
    config = dict(CONNECTORS_CONFIG_23 if v23 else CONNECTORS_CONFIG)
    for side in ("video", "audio"):
        registers, inner = shapes[f"{side}_connector.learnable_registers"]
        gate = shapes.get(f"{side}_connector.transformer_blocks.0.attn1.to_gate_logits.weight")
        heads = gate[0] if gate else inner // (AUDIO_HEAD_DIM if v23 and side == "audio" else CONNECTOR_HEAD_DIM)
        if not heads or inner % heads:
            return None
        config.update({f"{side}_connector_num_attention_heads": heads,
                       f"{side}_connector_attention_head_dim": inner // heads,
                       f"{side}_connector_num_learnable_registers": registers,
                       f"{side}_connector_num_layers": _count(shapes, rf"^{side}_connector\.transformer_blocks\.(\d+)\.")})
        if v23:
            config[f"{side}_hidden_dim"] = inner
    text_in = shapes["video_text_proj_in.weight" if v23 else "text_proj_in.weight"][1]
    if text_in % GEMMA_HIDDEN_STATES:
        return None
    config["caption_channels"] = text_in // GEMMA_HIDDEN_STATES
    return config


def _video_blocks(shapes: dict, half: str, kind: str) -> list[tuple[int, int]]:
    """(width, resnets) of each block of one half, in the module order."""
    out = []
    for i in range(_count(shapes, rf"^{half}\.{kind}\.(\d+)\.")):
        conv = shapes.get(f"{half}.{kind}.{i}.resnets.0.conv1.conv.weight")
        if conv is None:
            return []
        out.append((conv[0], _count(shapes, rf"^{half}\.{kind}\.{i}\.resnets\.(\d+)\.")))
    return out


def video_vae_config(shapes: dict) -> dict | None:
    if "latents_mean" not in shapes or not any(".down_blocks." in k or ".up_blocks." in k for k in shapes):
        return None  # (the audio VAE's blocks are down.N / up.N)
    has_encoder = "encoder.conv_in.conv.weight" in shapes
    has_decoder = "decoder.conv_in.conv.weight" in shapes
    if not (has_encoder or has_decoder):
        return None
    ups = _video_blocks(shapes, "decoder", "up_blocks") if has_decoder else []
    v23 = len(ups) == 4 if has_decoder else _encoder_is_23(shapes)
    config = dict(VIDEO_VAE_CONFIG_23 if v23 else VIDEO_VAE_CONFIG)
    config["latent_channels"] = shapes["latents_mean"][0]
    if has_encoder:
        downs = _video_blocks(shapes, "encoder", "down_blocks")
        mid = shapes.get("encoder.mid_block.resnets.0.conv1.conv.weight")
        if len(downs) != 4 or mid is None:
            return None
        config["block_out_channels"] = [w for w, _ in downs[1:]] + [mid[0]]  # a block's resnets: its input width
        config["layers_per_block"] = [n for _, n in downs] + [_count(shapes, r"^encoder\.mid_block\.resnets\.(\d+)\.")]
    if has_decoder:
        mid = shapes.get("decoder.mid_block.resnets.0.conv1.conv.weight")
        if mid is None or len(ups) != len(config["upsample_type"]):
            return None
        widths = [mid[0]] + [w for w, _ in ups[:-1]]
        config["decoder_block_out_channels"] = list(reversed(widths))
        layers = [_count(shapes, r"^decoder\.mid_block\.resnets\.(\d+)\.")] + [n for _, n in ups]
        config["decoder_layers_per_block"] = list(reversed(layers))
        config["timestep_conditioning"] = "decoder.time_embedder.emb.timestep_embedder.linear_1.weight" in shapes
    return config


def _encoder_is_23(shapes: dict) -> bool:
    """LTX-2.3's encoder keeps its last block's width in the middle block (2.0 doubles it)."""
    last = shapes.get("encoder.down_blocks.3.resnets.0.conv1.conv.weight")
    mid = shapes.get("encoder.mid_block.resnets.0.conv1.conv.weight")
    return bool(last and mid and last[0] == mid[0])


def audio_vae_config(shapes: dict) -> dict | None:
    if "latents_mean" not in shapes or not any(k.startswith(("encoder.down.0.", "decoder.up.0.")) for k in shapes):
        return None  # (the video VAE's blocks are down_blocks.N / up_blocks.N)
    config = dict(AUDIO_VAE_CONFIG)
    if "encoder.conv_in.conv.weight" in shapes:
        base, cin = shapes["encoder.conv_in.conv.weight"][:2]
        levels = _count(shapes, r"^encoder\.down\.(\d+)\.")
        mult = [shapes[f"encoder.down.{i}.block.0.conv1.conv.weight"][0] // base for i in range(levels)]
        latent2 = shapes["encoder.conv_out.conv.weight"][0]
        config.update(base_channels=base, in_channels=cin, ch_mult=mult,
                      num_res_blocks=_count(shapes, r"^encoder\.down\.0\.block\.(\d+)\."))
        config["double_z"] = latent2 != shapes["latents_mean"][0] // (config["mel_bins"] // 4)
        config["latent_channels"] = latent2 // 2 if config["double_z"] else latent2
        config["mid_block_add_attention"] = any(k.startswith("encoder.mid.attn_1.") for k in shapes)
    else:
        if "decoder.conv_in.conv.weight" not in shapes:
            return None
        top, latent = shapes["decoder.conv_in.conv.weight"][:2]
        levels = _count(shapes, r"^decoder\.up\.(\d+)\.")
        base = shapes["decoder.conv_out.conv.weight"][1]
        mult = [shapes[f"decoder.up.{i}.block.0.conv1.conv.weight"][0] // base for i in range(levels)]
        config.update(base_channels=base, latent_channels=latent, ch_mult=mult,
                      output_channels=shapes["decoder.conv_out.conv.weight"][0],
                      num_res_blocks=_count(shapes, r"^decoder\.up\.0\.block\.(\d+)\.") - 1,
                      mid_block_add_attention=any(k.startswith("decoder.mid.attn_1.") for k in shapes))
        if top != base * mult[-1]:
            return None
    return config


def _resnet_kernels(shapes: dict, prefix: str, upsamplers: int) -> list[int] | None:
    resnets = _count(shapes, rf"^{prefix}resnets\.(\d+)\.")
    if not upsamplers or resnets % upsamplers:
        return None
    return [shapes[f"{prefix}resnets.{j}.convs1.0.weight"][2] for j in range(resnets // upsamplers)]


def vocoder_config(shapes: dict) -> dict | None:
    bwe = any(k.startswith("bwe_generator.") for k in shapes)
    prefix = "vocoder." if bwe else ""
    conv_in = shapes.get(f"{prefix}conv_in.weight")
    if conv_in is None:
        return None
    config = dict(VOCODER_CONFIG_23 if bwe else VOCODER_CONFIG)
    ups = _count(shapes, rf"^{re.escape(prefix)}upsamplers\.(\d+)\.")
    kernels = _resnet_kernels(shapes, prefix, ups)
    if kernels is None or ups != len(config["upsample_factors"]):
        return None
    config.update(hidden_channels=conv_in[0], in_channels=conv_in[1], resnet_kernel_sizes=kernels,
                  resnet_dilations=[[1, 3, 5]] * len(kernels),
                  upsample_kernel_sizes=[shapes[f"{prefix}upsamplers.{i}.weight"][2] for i in range(ups)])
    if bwe:
        bwe_in = shapes["bwe_generator.conv_in.weight"]
        bwe_ups = _count(shapes, r"^bwe_generator\.upsamplers\.(\d+)\.")
        bwe_kernels = _resnet_kernels(shapes, "bwe_generator.", bwe_ups)
        if bwe_kernels is None or bwe_ups != len(config["bwe_upsample_factors"]):
            return None
        config.update(bwe_hidden_channels=bwe_in[0], bwe_in_channels=bwe_in[1], bwe_resnet_kernel_sizes=bwe_kernels,
                      bwe_resnet_dilations=[[1, 3, 5]] * len(bwe_kernels),
                      bwe_upsample_kernel_sizes=[shapes[f"bwe_generator.upsamplers.{i}.weight"][2]
                                                 for i in range(bwe_ups)])
    return config


# -- Gemma-3 -----------------------------------------------------------------------------------------------------

# the hub files' (transformers 4) names -> transformers 5's
_GEMMA_HUB = (("language_model.model.", "model.language_model."), ("vision_tower.vision_model.", "model.vision_tower."),
              ("vision_tower.", "model.vision_tower."),  # transformers 5's save_pretrained drops vision_model.
              ("multi_modal_projector.", "model.multi_modal_projector."), ("language_model.lm_head.", "lm_head."))


def gemma3_key(key: str) -> str:
    for old, new in _GEMMA_HUB:
        if key.startswith(old):
            return new + key[len(old):]
    return key


# -- specs -------------------------------------------------------------------------------------------------------

_LIBRARY = "difftune.families.ltx2.models"

DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="LTX2VideoTransformer3DModel",
    known_configs={"LTX-2 19B DiT": DIT_CONFIG, "LTX-2.3 22B DiT": DIT_CONFIG_23},
    convert_state_dict=_official("dit"), infer_config=dit_config,
    description="LTX-2 / LTX-2.3 DiT (official, Repackage or diffusers names)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="Gemma3ForConditionalGeneration",
    config_class_name="Gemma3Config", normalize_key=gemma3_key,
    marker_keys=("model.language_model.embed_tokens.weight",),
    description="Gemma-3 (google/gemma-3-12b-it-qat-q4_0-unquantized: the hub folder with its config.json)")

CONNECTORS = ComponentSpec(
    name="text_encoder_post_modules", library="diffusers.pipelines.ltx2.connectors",
    class_name="LTX2TextConnectors",
    known_configs={"LTX-2 text connectors": CONNECTORS_CONFIG, "LTX-2.3 text connectors": CONNECTORS_CONFIG_23},
    convert_state_dict=_official("connectors"), infer_config=connectors_config, companion=True,
    description="LTX-2 text connectors (Gemma feature projection + video and audio connectors)")


def _vae_half(slot: str, cls: str, part: str, half: str, known: dict, infer, what: str) -> ComponentSpec:
    # a diffusers folder holds the whole VAE (vae/, audio_vae/): its config.json builds either half
    whole = {"video_vae": "AutoencoderKLLTX2Video", "audio_vae": "AutoencoderKLLTX2Audio"}[part]
    return ComponentSpec(name=slot, library=_LIBRARY, class_name=cls, known_configs=known,
                         convert_state_dict=_official(part, half), infer_config=infer, companion=True,
                         config_classes=(whole,), description=what)


_VIDEO_KNOWN = {"LTX-2 video VAE": VIDEO_VAE_CONFIG, "LTX-2.3 video VAE": VIDEO_VAE_CONFIG_23}
_AUDIO_KNOWN = {"LTX-2 audio VAE": AUDIO_VAE_CONFIG}
VIDEO_VAE_ENCODER = _vae_half("video_vae_encoder", "LTX2VideoVAEEncoder", "video_vae", "encoder", _VIDEO_KNOWN,
                              video_vae_config, "LTX-2 video VAE encoder")
VIDEO_VAE_DECODER = _vae_half("video_vae_decoder", "LTX2VideoVAEDecoder", "video_vae", "decoder", _VIDEO_KNOWN,
                              video_vae_config, "LTX-2 video VAE decoder")
AUDIO_VAE_ENCODER = _vae_half("audio_vae_encoder", "LTX2AudioVAEEncoder", "audio_vae", "encoder", _AUDIO_KNOWN,
                              audio_vae_config, "LTX-2 audio VAE encoder (mel spectrogram -> latents)")
AUDIO_VAE_DECODER = _vae_half("audio_vae_decoder", "LTX2AudioVAEDecoder", "audio_vae", "decoder", _AUDIO_KNOWN,
                              audio_vae_config, "LTX-2 audio VAE decoder (latents -> mel spectrogram)")

VOCODER = ComponentSpec(
    name="audio_vocoder", library="diffusers.pipelines.ltx2.vocoder", class_name="LTX2Vocoder",
    known_configs={"LTX-2 vocoder (24 kHz)": VOCODER_CONFIG}, convert_state_dict=_official("vocoder"),
    infer_config=lambda s: None if any(k.startswith("bwe_generator.") for k in s) else vocoder_config(s),
    companion=True, description="LTX-2 vocoder (mel -> 24 kHz audio)")
VOCODER_23 = ComponentSpec(
    name="audio_vocoder", library="diffusers.pipelines.ltx2.vocoder", class_name="LTX2VocoderWithBWE",
    known_configs={"LTX-2.3 vocoder (48 kHz, bandwidth extension)": VOCODER_CONFIG_23},
    convert_state_dict=_official("vocoder"), infer_config=vocoder_config, companion=True,
    description="LTX-2.3 vocoder with bandwidth extension (mel -> 48 kHz audio)")

COMPONENTS = (DIT, TEXT_ENCODER, CONNECTORS, VIDEO_VAE_ENCODER, VIDEO_VAE_DECODER, AUDIO_VAE_ENCODER,
              AUDIO_VAE_DECODER, VOCODER, VOCODER_23)

__all__ = ["AUDIO_VAE_CONFIG", "COMPONENTS", "CONNECTORS_CONFIG", "CONNECTORS_CONFIG_23", "DIT_CONFIG",
           "DIT_CONFIG_23", "LORA_TARGET_MODULES", "VIDEO_VAE_CONFIG", "VIDEO_VAE_CONFIG_23", "VOCODER_CONFIG",
           "VOCODER_CONFIG_23", "audio_vae_config", "connectors_config", "dit_config", "gemma3_key", "part_of",
           "video_vae_config", "vocoder_config"]
