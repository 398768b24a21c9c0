"""ACE-Step 1.5 components: the official configs, how the released files are recognised, and the original names.

Classes are diffusers' (`AceStepTransformer1DModel`, `AceStepConditionEncoder`, `AutoencoderOobleck`) and
transformers' (`Qwen3Model`, the Qwen3-Embedding-0.6B text encoder). The release keeps the DiT, its condition
encoder and the FSQ audio tokenizer in one original file (`acestep-v15-*/model.safetensors`, the XL models sharded
as `model-*.safetensors`): `decoder.*` is the DiT, `encoder.*` plus `null_condition_emb` the condition encoder,
`tokenizer.*` / `detokenizer.*` the FSQ tokenizer (the cover task's, which the reference's training never runs: it is
left in the file). The original modules are named as Qwen3's (`q_proj`, `o_proj`, `q_norm`, `proj_in.1`);
diffusers' as its attention processors (`to_q`, `to_out.0`, `norm_q`, `proj_in_conv`): `to_diffusers` and
`to_original` rename one module path either way (the model files, full checkpoints and LoRA files share them).
"""

from __future__ import annotations

import re

import torch

from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.qwen3 import QWEN3_MARKER_KEYS, qwen3_config_from_weights, qwen3_key

# The reference's LoRA targets (its scripts' --lora_target_modules), in the original module names.
LORA_TARGET_MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# ... and the modules that hold them in diffusers' DiT
REFERENCE_LORA_TARGETS = {"q_proj": "to_q", "k_proj": "to_k", "v_proj": "to_v", "o_proj": "to_out.0"}

SAMPLE_RATE = 48000
HOP = 1920  # waveform samples per latent frame (the VAE's 2 * 4 * 4 * 6 * 10): 25 latent frames a second
LATENT_CHANNELS = 64

# acestep-v15-{turbo,base,sft,turbo-*} config.json (the DiT and condition encoder sizes) and the XL models'
ACE_STEP_DIT_CONFIG = {
    "_class_name": "AceStepTransformer1DModel", "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "in_channels": 192, "audio_acoustic_hidden_dim": 64, "patch_size": 2, "rope_theta": 1000000.0,
    "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": 1e-6, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "encoder_hidden_size": 2048}
ACE_STEP_XL_DIT_CONFIG = {
    **ACE_STEP_DIT_CONFIG, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 32,
    "num_attention_heads": 32, "layer_types": ["sliding_attention", "full_attention"] * 16}
ACE_STEP_CONDITIONER_CONFIG = {
    "_class_name": "AceStepConditionEncoder", "hidden_size": 2048, "intermediate_size": 6144, "text_hidden_dim": 1024,
    "timbre_hidden_dim": 64, "num_lyric_encoder_hidden_layers": 8, "num_timbre_encoder_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
    "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": 1e-6, "sliding_window": 128}
# ACE-Step/Ace-Step1.5 vae/config.json: the Oobleck VAE at 48 kHz stereo, 1920 samples per latent frame
ACE_STEP_VAE_CONFIG = {
    "_class_name": "AutoencoderOobleck", "encoder_hidden_size": 128, "downsampling_ratios": [2, 4, 4, 6, 10],
    "channel_multiples": [1, 2, 4, 8, 16], "decoder_channels": 128, "decoder_input_channels": 64,
    "audio_channels": 2, "sampling_rate": SAMPLE_RATE}
# ACE-Step/Ace-Step1.5 Qwen3-Embedding-0.6B/config.json (the backbone; the file has no LM head)
QWEN3_EMBEDDING_06B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151669}

# -- names ---------------------------------------------------------------------------------------------

_TO_DIFFUSERS = ((".q_proj", ".to_q"), (".k_proj", ".to_k"), (".v_proj", ".to_v"), (".o_proj", ".to_out.0"),
                 (".q_norm", ".norm_q"), (".k_norm", ".norm_k"))
_ATTN = re.compile(r"(self_attn|cross_attn)(\.\w+)")
_CONVS = (("proj_in.1", "proj_in_conv"), ("proj_out.1", "proj_out_conv"))


def to_diffusers(path: str) -> str:
    """An original module (or tensor) path inside the DiT or the condition encoder -> diffusers'."""
    def attention(m):
        tail = m[2]
        for old, new in _TO_DIFFUSERS:
            if tail == old:
                return m[1] + new
        return m[0]

    path = _ATTN.sub(attention, path)
    for old, new in _CONVS:
        if path == old or path.startswith(old + "."):
            return new + path[len(old):]
    return path


def to_original(path: str) -> str:
    """diffusers' module (or tensor) path -> the original one (the inverse of `to_diffusers`)."""
    for new, old in ((n, o) for o, n in _TO_DIFFUSERS):
        path = re.sub(rf"(self_attn|cross_attn){re.escape(new)}(?=\.|$)", rf"\1{old}", path)
    for old, new in _CONVS:
        if path == new or path.startswith(new + "."):
            return old + path[len(new):]
    return path


def _part(state: dict, prefix: str) -> dict:
    return {to_diffusers(k[len(prefix):]): v for k, v in state.items()
            if k.startswith(prefix) and ".rotary_emb." not in k}


def dit_from_original(state: dict) -> dict:
    """The original file's `decoder.*` -> the DiT's tensors in diffusers' names (the rest is another model's)."""
    if not any(k.startswith("decoder.layers.") for k in state):
        raise KeyError("not an original ACE-Step file")
    return _part(state, "decoder.")


def conditioner_from_original(state: dict) -> dict:
    """The original file's `encoder.*` and `null_condition_emb` -> the condition encoder's tensors. diffusers' class
    also keeps the silence latent as a buffer, which the release ships apart (`silence_latent.pt`): it starts as
    zeros here, and the pipeline reads the file (`AceStepPipeline.silence_latent`)."""
    if not any(k.startswith("encoder.lyric_encoder.") for k in state) or "null_condition_emb" not in state:
        raise KeyError("not an original ACE-Step file")
    out = _part(state, "encoder.")
    out["null_condition_emb"] = state["null_condition_emb"]
    timbre = out["timbre_encoder.embed_tokens.weight"]
    out["silence_latent"] = torch.zeros((1, 15000, timbre.shape[1]), dtype=timbre.dtype, device=timbre.device)
    return out


def original_dit_keys(state: dict) -> dict:
    """The DiT's state dict in the original file's names (`decoder.*`), for `--full_format original`."""
    return {f"decoder.{to_original(k)}": v for k, v in state.items()}


def original_conditioner_keys(state: dict) -> dict:
    """The condition encoder's tensors in the original file's names (the tiny test files and their checks)."""
    return {("null_condition_emb" if k == "null_condition_emb" else f"encoder.{to_original(k)}"): v
            for k, v in state.items() if k != "silence_latent"}


# -- configs from the weights ------------------------------------------------------------------------

def _count(shapes, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def dit_config_from_weights(shapes: dict) -> dict | None:
    """A DiT of any size (diffusers' names); the sliding window and the RoPE base are the release's."""
    conv = shapes.get("proj_in_conv.weight")
    norm = shapes.get("layers.0.self_attn.norm_q.weight")
    if conv is None or norm is None or "layers.0.self_attn.to_q.weight" not in shapes:
        return None
    head, layers = norm[0], _count(shapes, "layers.")
    return {**ACE_STEP_DIT_CONFIG, "hidden_size": conv[0], "in_channels": conv[1], "patch_size": conv[2],
            "num_hidden_layers": layers, "layer_types": _alternating(layers), "head_dim": head,
            "num_attention_heads": shapes["layers.0.self_attn.to_q.weight"][0] // head,
            "num_key_value_heads": shapes["layers.0.self_attn.to_k.weight"][0] // head,
            "intermediate_size": shapes["layers.0.mlp.gate_proj.weight"][0],
            "audio_acoustic_hidden_dim": shapes["proj_out_conv.weight"][1],
            "encoder_hidden_size": shapes["condition_embedder.weight"][1]}


def conditioner_config_from_weights(shapes: dict) -> dict | None:
    proj = shapes.get("text_projector.weight")
    norm = shapes.get("lyric_encoder.layers.0.self_attn.norm_q.weight")
    if proj is None or norm is None:
        return None
    head = norm[0]
    return {**ACE_STEP_CONDITIONER_CONFIG, "hidden_size": proj[0], "text_hidden_dim": proj[1],
            "timbre_hidden_dim": shapes["timbre_encoder.embed_tokens.weight"][1], "head_dim": head,
            "num_lyric_encoder_hidden_layers": _count(shapes, "lyric_encoder.layers."),
            "num_timbre_encoder_hidden_layers": _count(shapes, "timbre_encoder.layers."),
            "num_attention_heads": shapes["lyric_encoder.layers.0.self_attn.to_q.weight"][0] // head,
            "num_key_value_heads": shapes["lyric_encoder.layers.0.self_attn.to_k.weight"][0] // head,
            "intermediate_size": shapes["lyric_encoder.layers.0.mlp.gate_proj.weight"][0]}


def vae_config_from_weights(shapes: dict) -> dict | None:
    """The Oobleck VAE at the release's strides, of any width (a folder's config.json is used where there is one)."""
    first = shapes.get("encoder.conv1.weight_v")
    last = shapes.get("decoder.conv1.weight_v")
    if first is None or last is None:
        return None
    return {**ACE_STEP_VAE_CONFIG, "encoder_hidden_size": first[0], "audio_channels": first[1],
            "decoder_channels": last[0] // ACE_STEP_VAE_CONFIG["channel_multiples"][-1],
            "decoder_input_channels": last[1]}


def text_encoder_config(shapes: dict) -> dict | None:
    config = qwen3_config_from_weights(shapes)
    return None if config is None else {**QWEN3_EMBEDDING_06B_CONFIG, **{k: v for k, v in config.items()
                                                                          if k in _QWEN3_SIZES}}


_QWEN3_SIZES = ("vocab_size", "hidden_size", "head_dim", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "num_key_value_heads")

# -- specs --------------------------------------------------------------------------------------------

_FOREIGN = ("AceStepConditionGenerationModel",)  # the original config.json beside model.safetensors

DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="AceStepTransformer1DModel",
    known_configs={"ACE-Step v1.5 DiT (turbo, base, sft)": ACE_STEP_DIT_CONFIG,
                   "ACE-Step v1.5 XL DiT": ACE_STEP_XL_DIT_CONFIG},
    marker_keys=("proj_in_conv.weight", "time_embed_r.linear_1.weight", "layers.0.cross_attn.to_q.weight"),
    normalize_key=strip_comfyui_prefix, infer_config=dit_config_from_weights,
    description="ACE-Step 1.5 DiT (diffusers layout)")

# The release's single file: the DiT from `decoder.*`; its condition encoder is the companion below.
DIT_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="AceStepTransformer1DModel", known_configs=DIT.known_configs,
    marker_keys=("decoder.proj_in.1.weight", "decoder.time_embed_r.linear_1.weight"),
    normalize_key=strip_comfyui_prefix, convert_state_dict=dit_from_original, infer_config=dit_config_from_weights,
    foreign_config_classes=_FOREIGN, description="ACE-Step 1.5 DiT, the release's single file (acestep-v15-*)")

CONDITIONER = ComponentSpec(
    name="conditioner", library="diffusers", class_name="AceStepConditionEncoder",
    known_configs={"ACE-Step v1.5 condition encoder": ACE_STEP_CONDITIONER_CONFIG},
    marker_keys=("text_projector.weight", "null_condition_emb", "lyric_encoder.embed_tokens.weight"),
    infer_config=conditioner_config_from_weights, description="ACE-Step 1.5 condition encoder (diffusers layout)")

CONDITIONER_ORIGINAL = ComponentSpec(
    name="conditioner", library="diffusers", class_name="AceStepConditionEncoder",
    known_configs=CONDITIONER.known_configs,
    marker_keys=("encoder.text_projector.weight", "null_condition_emb"), companion=True,
    convert_state_dict=conditioner_from_original, infer_config=conditioner_config_from_weights,
    foreign_config_classes=_FOREIGN, description="ACE-Step 1.5 condition encoder, in the release's single file")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="Qwen3Model", config_class_name="Qwen3Config",
    known_configs={"Qwen3-Embedding-0.6B (ACE-Step text encoder)": QWEN3_EMBEDDING_06B_CONFIG},
    marker_keys=QWEN3_MARKER_KEYS, normalize_key=qwen3_key, foreign_config_classes=("Qwen3ForCausalLM",),
    infer_config=text_encoder_config, description="Qwen3-Embedding-0.6B text encoder")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderOobleck",
    known_configs={"ACE-Step 1.5 VAE (Oobleck, 48 kHz stereo)": ACE_STEP_VAE_CONFIG},
    marker_keys=("encoder.conv1.weight_v", "decoder.conv1.weight_v"), infer_config=vae_config_from_weights,
    description="ACE-Step 1.5 audio VAE (Oobleck)")

COMPONENTS = (DIT, CONDITIONER, TEXT_ENCODER, VAE, DIT_ORIGINAL, CONDITIONER_ORIGINAL)

__all__ = ["ACE_STEP_CONDITIONER_CONFIG", "ACE_STEP_DIT_CONFIG", "ACE_STEP_VAE_CONFIG", "ACE_STEP_XL_DIT_CONFIG",
           "COMPONENTS", "HOP", "LATENT_CHANNELS", "LORA_TARGET_MODULES", "QWEN3_EMBEDDING_06B_CONFIG",
           "REFERENCE_LORA_TARGETS", "SAMPLE_RATE", "conditioner_from_original", "dit_from_original",
           "original_conditioner_keys", "original_dit_keys", "to_diffusers", "to_original"]
