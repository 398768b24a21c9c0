"""Wan2.2-Animate-2-14B (and -Distilled): its own transformer, diffusers' `WanAnimate2Transformer3DModel`.

The denoiser reads the generated clip (the reference image's latents as a leading frame, then the clip's) with its
condition (the reference image: mask 1 + latents; then zeros, mask 0) and, in context, a reference video: a first
pass over the reference video's latents (mask 1 + latents), its own prompt (`animate2_prompt_ref`) and the CLIP
embedding of its first frame, at a fixed timestep, keeps every block's self-attention keys and values; the second
pass over the clip lets each clip frame attend to all clip tokens and to the reference video frame before it. The
second pass of the unguided prediction skips block 9.

diffusers runs the second pass's attention through a flex-attention block mask, which has no backward pass on the
CPU and is compiled on first use; `DenseInContextAttnProcessor` computes the same attention with a dense boolean
mask and SDPA, so the model trains anywhere (the test compares the two).

The released file (`wan_animate_2/wan_animate_2_bf16[_distillation].safetensors`) names the blocks
`blocks.N.block.self_attn.q`: diffusers' converter maps it (`blocks.N.self_attn.to_q`); `animate2_module_name`
maps the reference's module names (its `--trainable_models dit.blocks.0.block.self_attn.q,...` and LoRA targets).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan_animate_2 import (WanAnimate2AttnProcessor, WanAnimate2KVCache,
                                                                     _get_qkv_projections, rope_apply)

from ...core.checkpointing import set_gradient_checkpointing
from ...core.features import FRAMES, IMAGE, VALUE, Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec
from .components import _strip_comfy_prefix
from .pipeline import WanBasePipeline
from .units import (WanImageEmbedderCLIP, WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder,
                    WanShapeChecker, _per_sample, frames_of, vae_encode, vae_scales, video_tensor)

DEFAULT_PROMPT_REF = " "  # the reference's animate2_prompt_ref default

ANIMATE2_CONFIG = {"_class_name": "WanAnimate2Transformer3DModel", "patch_size": [1, 2, 2], "text_len": 512,
                   "in_dim": 36, "dim": 5120, "ffn_dim": 13824, "freq_dim": 256, "text_dim": 4096, "out_dim": 16,
                   "num_heads": 40, "num_layers": 40, "cross_attn_norm": True, "eps": 1e-6, "use_img_emb": True,
                   "refer_offset_t": 1, "refer_offset_h": 0, "refer_offset_w": -1, "refer_stride": 1}

# the reference's attention names -> diffusers' (inside self_attn / cross_attn)
_ATTENTION = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "k_img": "add_k_proj", "v_img": "add_v_proj",
              "norm_k_img": "norm_added_k"}


def animate2_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not any(".block.self_attn." in k for k in state):
        raise KeyError("not a Wan-Animate-2 file")
    from diffusers.loaders.single_file_utils import convert_wan_animate_2_transformer_to_diffusers

    return convert_wan_animate_2_transformer_to_diffusers(dict(state))


def animate2_module_name(name: str) -> str:
    """A module name in the reference's model (`blocks.0.block.self_attn.q`, `dit.` prefix kept) -> ours."""
    name = re.sub(r"(^|\.)blocks\.(\d+)\.block\.", r"\1blocks.\2.", name)
    return re.sub(r"\.(self_attn|cross_attn)\.(q|k|v|o|k_img|v_img|norm_k_img)(?=\.|$)",
                  lambda m: f".{m[1]}.{_ATTENTION[m[2]]}", name)


def animate2_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A WanAnimate2Transformer3DModel state dict in the released names (for tiny files and
    `--full_format original`)."""
    inverse = {v: k for k, v in _ATTENTION.items()}
    out = {}
    for key, value in state.items():
        new = re.sub(r"^blocks\.(\d+)\.", r"blocks.\1.block.", key)
        new = re.sub(r"\.(self_attn|cross_attn)\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj|norm_added_k)\.",
                     lambda m: f".{m[1]}.{inverse[m[2]]}.", new)
        out[new] = value
    return out


ANIMATE2_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="WanAnimate2Transformer3DModel",
    known_configs={"Wan2.2-Animate-2-14B (and -Distilled)": ANIMATE2_CONFIG},
    marker_keys=("patch_embedding.weight", "head.modulation", "blocks.0.block.self_attn.q.weight"),
    normalize_key=_strip_comfy_prefix, convert_state_dict=animate2_from_original,
    foreign_config_classes=("WanAnimate2Transformer", "WanModel"),
    description="Wan2.2-Animate-2-14B transformer (wan_animate_2/wan_animate_2_bf16*.safetensors)")

# The reference's LoRA target names on this model (`--lora_target_modules self_attn.q,self_attn.k,self_attn.v`).
ANIMATE2_LORA_TARGETS = {**{f"{a}.{k}": f"{a}.{v}" for a in ("self_attn", "cross_attn") for k, v in _ATTENTION.items()},
                         "q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "ffn.0": "ffn.0", "ffn.2": "ffn.2"}


# -- attention without flex --------------------------------------------------------------------------------------
class DenseInContextAttnProcessor(WanAnimate2AttnProcessor):
    """The generation pass's self-attention with a dense mask: every clip token attends to every clip token and to
    the reference video's tokens of the frame before its own (diffusers' block mask, for a clip that is the whole
    video). The reference pass is diffusers' own."""

    def __call__(self, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=1,
                 reference_rotary_emb=None, reference_grid_sizes=None, reference_rope_stride=1, attention_mask=None,
                 origin_latent_frames=None, origin_latent_hw=None):
        if kv_cache_mode != "cached":
            return super().__call__(attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode,
                                    rope_stride, reference_rotary_emb, reference_grid_sizes, reference_rope_stride,
                                    attention_mask, origin_latent_frames, origin_latent_hw)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        query = rope_apply(query, grid_sizes, rotary_emb, rope_stride).type_as(value)
        key = rope_apply(key, grid_sizes, rotary_emb, rope_stride).type_as(value)
        key_ref, value_ref = kv_cache.get()
        key_ref = rope_apply(key_ref, reference_grid_sizes, reference_rotary_emb, reference_rope_stride).type_as(value)
        f, h, w = grid_sizes[0].tolist()
        rf, rh, rw = reference_grid_sizes[0].tolist()
        n, n_ref = f * h * w, rf * rh * rw
        frame = torch.arange(n, device=query.device) // (h * w)
        ref_frame = torch.arange(n_ref, device=query.device) // (rh * rw) + 1
        mask = torch.cat([torch.ones(n, n, dtype=torch.bool, device=query.device),
                          frame[:, None] == ref_frame[None]], dim=1)
        keys = torch.cat([key[:, :n], key_ref[:, :n_ref]], dim=1)
        values = torch.cat([value[:, :n], value_ref[:, :n_ref]], dim=1)
        out = F.scaled_dot_product_attention(query[:, :n].transpose(1, 2), keys.transpose(1, 2),
                                             values.transpose(1, 2), attn_mask=mask).transpose(1, 2)
        out = torch.cat([out, query[:, n:]], dim=1).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def use_dense_attention(dit) -> None:
    """Switch the blocks' self-attention to `DenseInContextAttnProcessor` (once)."""
    for block in dit.blocks:
        if not isinstance(block.self_attn.processor, DenseInContextAttnProcessor):
            block.self_attn.set_processor(DenseInContextAttnProcessor())


def use_flex_attention(dit) -> None:
    """Back to diffusers' flex-attention processor (CUDA; compiled on first use)."""
    for block in dit.blocks:
        if isinstance(block.self_attn.processor, DenseInContextAttnProcessor):
            block.self_attn.set_processor(WanAnimate2AttnProcessor())


def animate2_forward(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                     image_embeds: torch.Tensor | None, condition: torch.Tensor,
                     animate2_condition_latents: torch.Tensor, animate2_condition_y: torch.Tensor,
                     animate2_prompt_embeds: torch.Tensor, animate2_reference_image_embeds: torch.Tensor | None,
                     unconditional: bool = False, dense: bool = True,
                     reference_timestep: torch.Tensor | None = None) -> torch.Tensor:
    """model_fn's part: the reference pass, then the clip's (B, 16, F, h, w) -> (B, 16, F, h, w). `dense`: the
    dense in-context attention (any device, with gradients); else diffusers' flex path. `reference_timestep`: the
    reference pass's timestep (sampling: the first step's, as the reference computes its KV cache once; training:
    the sample's own)."""
    if condition is None or animate2_condition_latents is None:
        raise UserError("Wan-Animate-2 needs animate2_reference_image and animate2_reference_video")
    use_dense_attention(dit) if dense else use_flex_attention(dit)
    b, _, f, h, w = latents.shape
    rf = animate2_condition_latents.shape[2]
    p_t, p_h, p_w = dit.config.patch_size
    grid = torch.tensor([[f // p_t, h // p_h, w // p_w]] * b)
    ref_grid = torch.tensor([[rf // p_t, h // p_h, w // p_w]] * b)
    dtype = dit.patch_embedding.weight.dtype
    as_list = lambda x: [u.to(dtype) for u in x.unbind(0)]  # noqa: E731
    t = timestep.to(latents.device).reshape(-1).expand(b)
    t_ref = t if reference_timestep is None else reference_timestep.to(latents.device).reshape(-1).expand(b)
    cache = WanAnimate2KVCache(len(dit.blocks))
    dit(hidden_states=as_list(animate2_condition_latents), timestep=t_ref,
        encoder_hidden_states=as_list(animate2_prompt_embeds), condition_latents=as_list(animate2_condition_y),
        kv_cache=cache, kv_cache_mode="extract", seq_len=int(math.prod(ref_grid[0].tolist())),
        encoder_hidden_states_image=None if animate2_reference_image_embeds is None else
        animate2_reference_image_embeds.to(dtype), offset_grid_sizes=grid)
    # diffusers' block mask is sized from the clip's pixel frames and area: 4 per latent frame after the first (the
    # leading latent frame is the reference image's), 256 pixels per token
    origin_len = (f - 2) * 4 + 1
    origin_area = [w * 8, h * 8]
    mask_key = (origin_len // 4 + 1, origin_area[0] * origin_area[1] // 256)
    if dense:
        dit.block_masks.setdefault(mask_key, None)  # unused by the dense attention: never built
    elif dit.block_masks.get(mask_key, 0) is None:
        del dit.block_masks[mask_key]
    out = dit(hidden_states=as_list(latents), timestep=t, encoder_hidden_states=as_list(prompt_embeds),
              condition_latents=as_list(condition), kv_cache=cache, kv_cache_mode="cached",
              seq_len=int(math.prod(grid[0].tolist())),
              encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(dtype),
              reference_grid_sizes=ref_grid, origin_len=origin_len, origin_area=origin_area,
              is_uncondtion=unconditional, return_dict=False)[0]
    return torch.stack(out)


# -- units ----------------------------------------------------------------------------------------------------
def _clips(value, batch_size: int) -> list:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return [list(v) for v in value]
    return [frames_of(value)] * batch_size


def i2v_mask(latent_frames: int, h: int, w: int, known: int, temporal: int = 4) -> torch.Tensor:
    """(4, latent frames, h, w): pixel frames [0, known) known, the first standing for `temporal` frames."""
    m = torch.zeros(1, (latent_frames - 1) * temporal + 1, h, w)
    m[:, :known] = 1
    m = torch.cat([m[:, :1].repeat_interleave(temporal, dim=1), m[:, 1:]], dim=1)
    return m.view(1, m.shape[1] // temporal, temporal, h, w).transpose(1, 2)[0]


class WanAnimate2PromptEmbedder(PipelineUnit):
    """The reference video's prompt (`animate2_prompt_ref`, " " when not given) through UMT5."""

    feature = "animate2"
    inputs = ("animate2_prompt_ref", "animate2_reference_video", "batch_size")
    outputs = ("animate2_prompt_embeds",)
    models = ("text_encoder",)

    def process(self, pipe, animate2_prompt_ref, animate2_reference_video, batch_size):
        if animate2_reference_video is None:
            return {}
        prompts = [DEFAULT_PROMPT_REF if p is None or (isinstance(p, float) and math.isnan(p)) else str(p)
                   for p in _per_sample(animate2_prompt_ref, int(batch_size or 1))]
        return {"animate2_prompt_embeds": WanPromptEmbedder().process(pipe, prompts)["prompt_embeds"]}


class WanAnimate2CLIPEmbedder(PipelineUnit):
    """CLIP of the reference image (the clip's image embedding) and of the reference video's first frame."""

    feature = "animate2"
    replaces = ("WanImageEmbedderCLIP",)
    inputs = ("animate2_reference_image", "animate2_reference_video", "height", "width", "batch_size")
    outputs = ("image_embeds", "animate2_reference_image_embeds")
    models = ("image_encoder",)

    def process(self, pipe, animate2_reference_image, animate2_reference_video, height, width, batch_size):
        if animate2_reference_image is None or animate2_reference_video is None:
            return {}
        n = int(batch_size or 1)
        clip = WanImageEmbedderCLIP()
        images = _per_sample(animate2_reference_image, n)
        firsts = [c[0] for c in _clips(animate2_reference_video, n)]

        def embed(ims):
            return clip.process(pipe, ims if n > 1 else ims[0], None, height, width, n)["image_embeds"]

        return {"image_embeds": embed(images), "animate2_reference_image_embeds": embed(firsts)}


class WanAnimate2VAEEmbedder(PipelineUnit):
    """The clip's condition (B, 20, latent frames + 1, h, w): the reference image (mask 1, its latents) as the first
    latent frame, then the continuation frames (`animate2_refert_images`, the previous clip's tail; none in
    training: zeros, mask 0); the reference video's latents (B, 16, F', h, w) and their condition (mask 1)."""

    feature = "animate2"
    replaces = ("WanImageEmbedderVAE",)
    inputs = ("animate2_reference_image", "animate2_reference_video", "animate2_refert_images", "num_frames",
              "height", "width", "batch_size")
    outputs = ("condition", "animate2_condition_latents", "animate2_condition_y")
    models = ("vae",)

    def process(self, pipe, animate2_reference_image, animate2_reference_video, animate2_refert_images, num_frames,
                height, width, batch_size):
        if animate2_reference_image is None or animate2_reference_video is None:
            return {}
        n = int(batch_size or 1)
        _, spatial, temporal = vae_scales(pipe.vae)
        h, w = height // spatial, width // spatial
        conds, latents, ys = [], [], []
        for image, video, tail in zip(_per_sample(animate2_reference_image, n), _clips(animate2_reference_video, n),
                                      _per_sample(animate2_refert_images, n)):
            ref = vae_encode(pipe, video_tensor([image], height, width))[0]
            tail = frames_of(tail)
            if len(tail) >= num_frames:
                raise UserError(f"animate2_refert_images: {len(tail)} frames, fewer than the clip's {num_frames} "
                                f"expected")
            pixels = torch.zeros(1, 3, num_frames, height, width)
            if tail:
                pixels[:, :, :len(tail)] = video_tensor(tail, height, width)
            rest = vae_encode(pipe, pixels)[0]
            conds.append(torch.cat([torch.cat([i2v_mask(1, h, w, 1, temporal).to(ref), ref]),
                                    torch.cat([i2v_mask(rest.shape[1], h, w, len(tail), temporal).to(rest), rest])],
                                   dim=1))
            frames = video[:num_frames]
            z = vae_encode(pipe, video_tensor(frames, height, width))[0]
            latents.append(z)
            ys.append(torch.cat([i2v_mask(z.shape[1], h, w, len(frames), temporal).to(z), z]))
        dtype = pipe.torch_dtype
        return {"condition": torch.stack(conds).to(dtype), "animate2_condition_latents": torch.stack(latents).to(dtype),
                "animate2_condition_y": torch.stack(ys).to(dtype)}


class WanAnimate2NoiseInitializer(WanNoiseInitializer):
    """The noise with one more leading latent frame (the reference image's; dropped after sampling)."""

    feature = "animate2"
    replaces = ("WanNoiseInitializer",)
    inputs = WanNoiseInitializer.inputs + ("animate2_reference_video",)

    def process(self, pipe, height, width, num_frames, seed, rand_device, batch_size, animate2_reference_video=None):
        _, _, temporal = vae_scales(pipe.vae)
        extra = temporal if animate2_reference_video is not None else 0
        return super().process(pipe, height, width, int(num_frames) + extra, seed, rand_device, batch_size)


class WanAnimate2InputVideoEmbedder(WanInputVideoEmbedder):
    """Training: the reference image's clean latents lead the clip's (the loss covers them, as in the reference)."""

    feature = "animate2"
    replaces = ("WanInputVideoEmbedder",)
    inputs = WanInputVideoEmbedder.inputs + ("animate2_reference_image", "animate2_reference_video")

    def process(self, pipe, input_video, noise, height, width, animate2_reference_image=None,
                animate2_reference_video=None):
        out = super().process(pipe, input_video, noise, height, width)
        if "input_latents" not in out or animate2_reference_image is None or animate2_reference_video is None:
            return out
        latents = out["input_latents"]
        refs = [vae_encode(pipe, video_tensor([im], height, width))
                for im in _per_sample(animate2_reference_image, latents.shape[0])]
        out["input_latents"] = torch.cat([torch.cat(refs).to(latents), latents], dim=2)
        return out


class WanAnimate2Guidance(PipelineUnit):
    """Which pass model_fn runs: the guided one (True) or, on classifier-free guidance's unguided side, the one
    that skips block 9 (False), as the reference's `positive` input. No model."""

    feature = "animate2"
    outputs = ("animate2_conditional", "negative_animate2_conditional")

    def process(self, pipe):
        return {"animate2_conditional": True, "negative_animate2_conditional": False}


ANIMATE2 = Feature("animate2", when=lambda c: True,
                   data_inputs=("animate2_prompt_ref", "animate2_reference_image", "animate2_reference_video",
                                "animate2_refert_images"),
                   model_fn_inputs=("image_embeds", "condition", "animate2_condition_latents", "animate2_condition_y",
                                    "animate2_prompt_embeds", "animate2_reference_image_embeds",
                                    "animate2_conditional"),
                   inputs={"animate2_reference_image": IMAGE, "animate2_reference_video": FRAMES,
                           "animate2_refert_images": FRAMES, "animate2_prompt_ref": VALUE},
                   description="Wan2.2-Animate-2: a reference image and a reference video (with its prompt) read "
                               "in context")
ANIMATE2_COLUMNS = ("animate2_prompt_ref", "animate2_reference_image", "animate2_reference_video")


class WanAnimate2Pipeline(WanBasePipeline):
    """Wan2.2-Animate-2-14B (and -Distilled): its own transformer and model_fn (a reference pass, then the clip's),
    one leading latent frame (the reference image's) that sampling drops. A run is its own when its DiT is a
    WanAnimate2Transformer3DModel or its data has the animate2_* columns (the reference's stage 1 names no DiT)."""

    model_names = ("dit", "text_encoder", "vae", "image_encoder")
    features = (ANIMATE2,)
    loss_models = ("dit",)
    lora_target_aliases = {"dit": ANIMATE2_LORA_TARGETS}
    # its DiT's modules have no Wan-AI names (blocks.N.block.*): the default LoRA file keeps diffusers' layout
    lora_default_format = "diffusers"

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.units = [WanShapeChecker(), WanAnimate2NoiseInitializer(), WanAnimate2InputVideoEmbedder(),
                      WanPromptEmbedder(), WanAnimate2PromptEmbedder(), WanAnimate2CLIPEmbedder(),
                      WanAnimate2VAEEmbedder(), WanAnimate2Guidance()]

    @classmethod
    def claims(cls, context) -> bool:
        dit = context.config("dit") or {}
        return dit.get("_class_name") == "WanAnimate2Transformer3DModel" or context.has(*ANIMATE2_COLUMNS)

    @classmethod
    def check_run(cls, context, features):
        if not context.has("animate2_reference_image") or not context.has("animate2_reference_video"):
            raise UserError("Wan2.2-Animate-2 trains on animate2_reference_image and animate2_reference_video: "
                            "name both in --extra_inputs")
        dit = context.config("dit")
        if dit is not None and dit.get("_class_name") != "WanAnimate2Transformer3DModel":
            raise UserError("animate2_* inputs were given but the DiT is not Wan2.2-Animate-2's")

    def module_path(self, slot: str, path: str) -> str:
        """The reference's names of this DiT's modules (`blocks.0.block.self_attn.q`) -> diffusers'."""
        return animate2_module_name(path) if slot == "dit" else path

    def negative_name(self, name: str) -> str:
        return "negative_animate2_conditional" if name == "animate2_conditional" else super().negative_name(name)

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None,
                 animate2_condition_latents=None, animate2_condition_y=None, animate2_prompt_embeds=None,
                 animate2_reference_image_embeds=None, animate2_conditional=None, reference_timestep=None,
                 use_gradient_checkpointing=False, use_gradient_checkpointing_offload=False, **_):
        if self.dit is None:
            raise UserError("no Wan2.2-Animate-2 DiT loaded")
        set_gradient_checkpointing(self.dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
        return animate2_forward(self.dit, latents, timestep, prompt_embeds, image_embeds, condition,
                                animate2_condition_latents, animate2_condition_y, animate2_prompt_embeds,
                                animate2_reference_image_embeds, unconditional=not animate2_conditional,
                                reference_timestep=reference_timestep)

    def sampling_settings(self, values):
        # the reference computes the reference pass's KV cache once, at the first sampling step
        return {"reference_timestep": self.scheduler.timesteps[0]}

    def finish_latents(self, latents, values):
        return latents[:, :, 1:]  # the reference image's leading frame

    def __call__(self, prompt, negative_prompt="", *, animate2_reference_image, animate2_reference_video,
                 animate2_prompt_ref: str = DEFAULT_PROMPT_REF, animate2_refert_images=None,
                 height: int | None = None, width: int | None = None, num_frames: int | None = None,
                 num_inference_steps: int = 50, cfg_scale: float = 5.0, seed: int | None = None,
                 progress: bool = True, output_type: str = "pil"):
        """A clip of `animate2_reference_image`'s character moving as in `animate2_reference_video` (frames); its
        size and length default to the reference video's. `animate2_refert_images`: the previous clip's last
        frames, to continue a long video."""
        frames = frames_of(animate2_reference_video)
        width, height = (width or frames[0].size[0]), (height or frames[0].size[1])
        values = self.prompt_values(prompt, negative_prompt)
        values.update({"height": height, "width": width, "num_frames": num_frames or len(frames), "seed": seed,
                       "animate2_reference_image": animate2_reference_image, "animate2_reference_video": frames,
                       "animate2_prompt_ref": animate2_prompt_ref, "animate2_refert_images": animate2_refert_images})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps, progress=progress,
                            output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["ANIMATE2_CONFIG", "ANIMATE2_LORA_TARGETS", "ANIMATE2_ORIGINAL", "DenseInContextAttnProcessor",
           "WanAnimate2Guidance", "WanAnimate2Pipeline",
           "WanAnimate2CLIPEmbedder", "WanAnimate2InputVideoEmbedder", "WanAnimate2NoiseInitializer",
           "WanAnimate2PromptEmbedder", "WanAnimate2VAEEmbedder", "animate2_forward", "animate2_from_original",
           "animate2_module_name", "animate2_to_original", "use_dense_attention", "use_flex_attention"]
