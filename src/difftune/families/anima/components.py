"""Anima components: the official configs, the DiT class, how the ComfyUI split files are recognised and converted.

The reference loads circlestone-labs/Anima's ComfyUI split files: `split_files/diffusion_models/anima-preview.safetensors`
(Cosmos-Predict2's MiniTrainDIT, 2B, with Anima's LLM adapter inside it, every key behind `net.`),
`split_files/text_encoders/qwen_3_06b_base.safetensors` (Qwen3-0.6B's backbone, `model.*`) and
`split_files/vae/qwen_image_vae.safetensors` (the Qwen-Image VAE in the original Wan-2.1 layout).

The DiT is diffusers' own two classes in one module (`AnimaTransformer`): `transformer`, a
`CosmosTransformer3DModel`, and `text_conditioner`, an `AnimaTextConditioner` (the LLM adapter), filled by diffusers'
single-file converter for Cosmos-Predict2 (`convert_cosmos_transformer_checkpoint_to_diffusers`) and the adapter's
own names (which diffusers' conditioner keeps).
"""

from __future__ import annotations

import re

import torch
from diffusers import AnimaTextConditioner, CosmosTransformer3DModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from ...models.detect import ComponentSpec
from ...parts.qwen3 import QWEN3_06B_CONFIG, QWEN3_MARKER_KEYS, drop_lm_head, qwen3_config_from_weights, qwen3_key
from ...parts.qwen_image_vae import qwen_image_vae_original_spec

# The reference's "Z-Image" template: sigmas linspace(1, 0, N + 1)[:-1] with a static shift of 3 (the training table
# too): diffusers' FlowMatchEulerDiscreteScheduler at shift 3.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

# The reference's scripts leave the targets to its automatic choice (--lora_target_modules ""); this list is the
# same choice on the official DiT by module name, for a command that names none.
LORA_TARGET_MODULES = "to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,q_proj,k_proj,v_proj,o_proj,mlp.0,mlp.2"

MAX_SEQUENCE_LENGTH = 512  # Qwen3 tokens (padded to it) and T5 tokens (cut at it); the DiT reads 512 text tokens

# MiniTrainDIT's Anima settings as diffusers' CosmosTransformer3DModel: 2048 wide (16 x 128), 28 blocks, 16 latent
# channels plus the padding-mask channel, AdaLN-LoRA 256, 2x2 patches, RoPE extrapolation 4 in h and w, no extra
# learnable position embedding, 1024-wide text from the adapter.
COSMOS_ANIMA_CONFIG = {
    "in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 28,
    "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256, "max_size": [128, 240, 240],
    "patch_size": [1, 2, 2], "rope_scale": [1.0, 4.0, 4.0], "concat_padding_mask": True, "extra_pos_embed_type": None,
}
# The LLM adapter: 6 blocks 1024 wide over Qwen3-0.6B's 1024-wide states, queried by T5 token embeddings (32128).
ANIMA_CONDITIONER_CONFIG = {
    "source_dim": 1024, "target_dim": 1024, "model_dim": 1024, "num_layers": 6, "num_attention_heads": 16,
    "mlp_ratio": 4.0, "target_vocab_size": 32128, "use_self_attention": True, "use_layer_norm": False,
    "min_sequence_length": MAX_SEQUENCE_LENGTH,
}
ANIMA_DIT_CONFIG = {"_class_name": "AnimaTransformer", "transformer_config": COSMOS_ANIMA_CONFIG,
                    "conditioner_config": ANIMA_CONDITIONER_CONFIG}


class AnimaTransformer(ModelMixin, ConfigMixin):
    """Anima's DiT: the LLM adapter (`text_conditioner`) turns Qwen3's hidden states and the prompt's T5 token ids
    into the 512 text tokens the Cosmos-Predict2 DiT (`transformer`) cross-attends to."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["CosmosTransformerBlock", "AnimaTextConditionerBlock"]
    _keep_in_fp32_modules = ["learnable_pos_embed"]

    @register_to_config
    def __init__(self, transformer_config: dict | None = None, conditioner_config: dict | None = None):
        super().__init__()
        config = _tuples(transformer_config or COSMOS_ANIMA_CONFIG)
        # the padding-mask channel (zeros for a whole image) is concatenated here, not by diffusers' forward, which
        # resizes the mask with torchvision: the same patch embedding's weights see the same input
        self.padding_channel = bool(config.get("concat_padding_mask", True))
        config = {**config, "in_channels": config.get("in_channels", 16) + self.padding_channel,
                  "concat_padding_mask": False}
        self.transformer = CosmosTransformer3DModel(**config)
        self.text_conditioner = AnimaTextConditioner(**(conditioner_config or ANIMA_CONDITIONER_CONFIG))

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                t5_ids: torch.Tensor, t5_mask: torch.Tensor | None = None) -> torch.Tensor:
        """latents (B, 16, T, h, w), timestep (B,) in [0, 1], prompt_embeds (B, L, source_dim), t5_ids (B, S)
        -> the velocity (B, 16, T, h, w)."""
        context = self.text_conditioner(prompt_embeds, t5_ids, target_attention_mask=t5_mask)
        if self.padding_channel:
            latents = torch.cat([latents, latents.new_zeros(latents.shape[0], 1, *latents.shape[2:])], dim=1)
        return self.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=context,
                                return_dict=False)[0]


def _tuples(config: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


# -- the ComfyUI file ------------------------------------------------------------------------------

ADAPTER = "llm_adapter."


def dit_key(key: str) -> str:
    """The file's `net.` (and ComfyUI's `model.diffusion_model.` / `diffusion_model.`) in front of the names."""
    for prefix in ("model.diffusion_model.", "diffusion_model.", "net."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key


def convert_original_dit(state: dict) -> dict:
    """MiniTrainDIT's names (+ `llm_adapter.*`) -> `transformer.*` by diffusers' Cosmos-Predict2 single-file
    converter (which also drops the position embedder's stored buffers) and `text_conditioner.*` as they are."""
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    if "x_embedder.proj.1.weight" not in state or f"{ADAPTER}embed.weight" not in state:
        raise KeyError("not an Anima DiT (MiniTrainDIT with its LLM adapter)")
    adapter = {f"text_conditioner.{k[len(ADAPTER):]}": v for k, v in state.items() if k.startswith(ADAPTER)}
    rest = {k: v for k, v in state.items() if not k.startswith(ADAPTER)}
    dit = convert_cosmos_transformer_checkpoint_to_diffusers(rest)
    return {**{f"transformer.{k}": v for k, v in dit.items()}, **adapter}


# diffusers' Cosmos names -> MiniTrainDIT's, applied in order (the inverse of diffusers' Cosmos-Predict2 converter)
_ORIGINAL = (
    ("transformer_blocks.", "blocks."), ("norm1.linear_1", "adaln_modulation_self_attn.1"),
    ("norm1.linear_2", "adaln_modulation_self_attn.2"), ("norm2.linear_1", "adaln_modulation_cross_attn.1"),
    ("norm2.linear_2", "adaln_modulation_cross_attn.2"), ("norm3.linear_1", "adaln_modulation_mlp.1"),
    ("norm3.linear_2", "adaln_modulation_mlp.2"), ("attn1.", "self_attn."), ("attn2.", "cross_attn."),
    ("to_q.", "q_proj."), ("to_k.", "k_proj."), ("to_v.", "v_proj."), ("to_out.0.", "output_proj."),
    ("norm_q.", "q_norm."), ("norm_k.", "k_norm."), ("ff.net.0.proj.", "mlp.layer1."), ("ff.net.2.", "mlp.layer2."),
    ("patch_embed.proj.", "x_embedder.proj.1."), ("norm_out.linear_1.", "final_layer.adaln_modulation.1."),
    ("norm_out.linear_2.", "final_layer.adaln_modulation.2."), ("proj_out.", "final_layer.linear."),
    ("time_embed.t_embedder.", "t_embedder.1."), ("time_embed.norm.", "t_embedding_norm."),
)


def original_name(path: str) -> str:
    """A module or tensor path of `AnimaTransformer` -> its name in MiniTrainDIT (the released file, the
    reference's model, ComfyUI): `transformer.transformer_blocks.0.attn1.to_q` -> `blocks.0.self_attn.q_proj`,
    `text_conditioner.blocks.0.self_attn.q_proj` -> `llm_adapter.blocks.0.self_attn.q_proj`."""
    if path.startswith("text_conditioner."):
        return ADAPTER + path[len("text_conditioner."):]
    if not path.startswith("transformer."):
        raise KeyError(f"not a module of the Anima DiT: {path}")
    name = path[len("transformer."):] + "."
    for new, old in _ORIGINAL:
        name = name.replace(new, old)
    return name[:-1]


def original_dit_keys(state: dict) -> dict:
    """The DiT's state dict in the released file's names (`net.` in front), for `--full_format original` and the
    tiny split files."""
    return {"net." + original_name(k): v for k, v in state.items()}


def _count(shapes: dict, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})


def dit_config_from_weights(shapes: dict) -> dict | None:
    """An Anima DiT of any depth and width (diffusers' names, `transformer.` / `text_conditioner.`)."""
    if "transformer.patch_embed.proj.weight" not in shapes or "text_conditioner.embed.weight" not in shapes:
        return None
    hidden, patch_in = shapes["transformer.patch_embed.proj.weight"]
    head = shapes["transformer.transformer_blocks.0.attn1.norm_q.weight"][0]
    in_channels = patch_in // 4 - 1  # 2x2 patches of the latents and the padding-mask channel
    vocab, target = shapes["text_conditioner.embed.weight"]
    model_dim = shapes["text_conditioner.out_proj.weight"][1]
    head_c = shapes["text_conditioner.blocks.0.cross_attn.q_norm.weight"][0]
    cosmos = {**COSMOS_ANIMA_CONFIG, "in_channels": in_channels,
              "out_channels": shapes["transformer.proj_out.weight"][0] // 4, "num_attention_heads": hidden // head,
              "attention_head_dim": head, "num_layers": _count(shapes, "transformer.transformer_blocks."),
              "mlp_ratio": shapes["transformer.transformer_blocks.0.ff.net.0.proj.weight"][0] / hidden,
              "text_embed_dim": shapes["transformer.transformer_blocks.0.attn2.to_k.weight"][1],
              "adaln_lora_dim": shapes["transformer.transformer_blocks.0.norm1.linear_1.weight"][0]}
    conditioner = {**ANIMA_CONDITIONER_CONFIG, "source_dim": shapes["text_conditioner.blocks.0.cross_attn.k_proj.weight"][1],
                   "target_dim": target, "model_dim": model_dim, "target_vocab_size": vocab,
                   "num_layers": _count(shapes, "text_conditioner.blocks."), "num_attention_heads": model_dim // head_c,
                   "mlp_ratio": shapes["text_conditioner.blocks.0.mlp.0.weight"][0] / model_dim,
                   "use_self_attention": "text_conditioner.blocks.0.self_attn.q_proj.weight" in shapes}
    return {"_class_name": "AnimaTransformer", "transformer_config": cosmos, "conditioner_config": conditioner}


DIT = ComponentSpec(
    name="dit", library=__name__, class_name="AnimaTransformer",
    known_configs={"circlestone-labs/Anima anima-preview": ANIMA_DIT_CONFIG},
    marker_keys=("x_embedder.proj.1.weight", "blocks.0.self_attn.q_proj.weight", "llm_adapter.embed.weight"),
    normalize_key=dit_key, convert_state_dict=convert_original_dit, infer_config=dit_config_from_weights,
    description="Anima DiT (Cosmos-Predict2 MiniTrainDIT 2B + LLM adapter; diffusers CosmosTransformer3DModel + "
                "AnimaTextConditioner)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="Qwen3Model", config_class_name="Qwen3Config",
    known_configs={"Qwen3-0.6B (Anima text encoder)": QWEN3_06B_CONFIG},
    marker_keys=QWEN3_MARKER_KEYS, normalize_key=qwen3_key, convert_state_dict=drop_lm_head,
    foreign_config_classes=("Qwen3ForCausalLM",),
    infer_config=lambda shapes: qwen3_config_from_weights(shapes, base=QWEN3_06B_CONFIG),
    description="Qwen3-0.6B text encoder (last hidden states, 512 tokens)")

VAE = qwen_image_vae_original_spec()

COMPONENTS = (DIT, TEXT_ENCODER, VAE)


