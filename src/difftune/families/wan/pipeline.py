"""`WanVideoPipeline`: Wan2.1 / Wan2.2 text- and image-to-video (inference and the training hooks).

Architectures come from diffusers (`WanTransformer3DModel`, `AutoencoderKLWan`) and transformers
(`UMT5EncoderModel`, `CLIPVisionModel`), so diffusers-layout checkpoints load with their own key names. Which
variant it is follows from the weights: the DiT's channels (I2V takes a condition, TI2V-5B has 48), whether it
embeds a CLIP image, the VAE's channels, and whether a second DiT (the A14B low-noise expert) is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ...core.batch import SAME
from ...core.options import sample_input
from ...core.pipeline import BasePipeline
from ...core.target import FrameRule, Target, VideoStream
from ...errors import UserError
from .animate import ANIMATE, ANIMATE_REPLACE
from .camera import CAMERA, CAMERA_IMAGE
from .components import DEFAULT_BOUNDARY_RATIO
from .fun_control import FUN_CONTROL, FUN_REFERENCE
from .image_features import CLIP, I2V, TI2V, dit_extra_channels, latent_channels
from .model_fn import model_fn_wan
from .scheduler import WanScheduler
from .speed_control import SPEED_CONTROL
from .units import (WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker,
                    vae_decode, vae_scales)
from .vace import VACE


# The family's sampling defaults (diffusers' WanPipeline: 480x832, 81 frames, 50 steps, guidance 5): one place,
# read by __call__, `difftune sample` and validation.
CALL_DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "cfg_scale": 5.0}


@dataclass(frozen=True, eq=False)
class WanClips(VideoStream):
    """Wan's clips: 4k+1 frames, 81 by default (the reference's); latent scales from the loaded VAE (TI2V-5B's
    x16, 48 channels); --extra_inputs input_image / end_image are the clip's first / last frame where the metadata
    has no such column."""

    channels: int = 16
    scale: int = 8
    patch: int = 2
    division: int = 16  # x8 VAE and 2x2 patches (TI2V-5B's x16 VAE: its shape check rounds to 32)
    frames: FrameRule = FrameRule(81, 4, 1)
    frame_inputs: Mapping = field(default_factory=lambda: {"input_image": ("video", 0), "end_image": ("video", -1)})
    clip_columns: tuple[str, ...] = ("video", "image")  # a still image is a one-frame clip
    owner: str = "Wan"

    def scales(self, pipe):
        return super().scales(pipe) if pipe.vae is None else vae_scales(pipe.vae)

    def decode(self, pipe, latents):
        """Latents -> clips (B, 3, F, H, W) in [-1, 1]; a one-frame clip as images (B, 3, H, W)."""
        video = vae_decode(pipe, latents)
        return video[:, :, 0] if video.shape[2] == 1 else video

    def loss_mask(self, pipe, values):
        """TI2V-5B with an input image: its first latent frame is given clean, so it is left out of the loss."""
        if values.get("first_frame_latents") is None:
            return None
        mask = torch.ones(1, 1, values["input_latents"].shape[2], 1, 1)
        mask[:, :, 0] = 0
        return mask


class WanBasePipeline(BasePipeline):
    """What every Wan pipeline shares: the DiT (and the A14B low-noise expert), UMT5, the VAE, the CLIP image
    encoder, the clip's units (shape, noise, latents, prompt), the denoiser call with its features' parts, the
    latent layout, decoding and the training row. It lists no feature: `WanVideoPipeline` and the variants with
    models of their own (variant.py) list theirs."""

    model_names = ("dit", "dit2", "text_encoder", "vae", "image_encoder")
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds",)
    data_inputs = ("video", "image", "prompt", "seed", "rand_device", "num_inference_steps")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME, "num_frames": SAME,
                      "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "num_frames", "rand_device")
    loss_models = ("dit",)
    encode_alone = "features"  # the features' units encode one sample at a time
    call_defaults = CALL_DEFAULTS
    # a call takes `input_image` (and `end_image`) as the clip's first (and last) frame, and the features' inputs by
    # the reference's names (`call_inputs()`, `call_settings()`; docs/wan.md has each feature's)
    call_parameters = {"end_image": None, "num_frames": CALL_DEFAULTS["num_frames"], "boundary_ratio": None}
    sample_flags = {"end_image": sample_input("Wan I2V / FLF2V: the last frame.", load="RGB")}
    target = Target((WanClips(),))

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler if scheduler is not None else WanScheduler()
        self.tokenizer = None
        self.image_processor = None
        self.boundary_ratio = None  # the A14B expert switch from the repository (model_index.json)
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder()]

    @classmethod
    def check_run(cls, context, features):
        """An image-to-video DiT without an input image, refused before any work (the features check their own)."""
        extra = dit_extra_channels(context)
        if extra and latent_channels(context) != 48 and "i2v" not in features and "fun_control" not in features:
            raise UserError("this Wan DiT is image-to-video: give an input image (--extra_inputs input_image)")

    @property
    def repo_scheduler(self):
        return getattr(self.scheduler, "sampler", None)

    @repo_scheduler.setter
    def repo_scheduler(self, found) -> None:
        """The repository's scheduler/ (FamilySpec tokenizers load it beside the DiT): sampling steps it."""
        if found is None:
            return
        self.scheduler.sampler = found.scheduler
        self.boundary_ratio = found.boundary_ratio

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None, first_frame_latents=None,
                 end_image_embeds=None, expert_boundary=None, use_gradient_checkpointing=False,
                 use_gradient_checkpointing_offload=False, **inputs):
        dit, low_noise = self.dit, False
        if expert_boundary is not None and self.dit2 is not None and bool(timestep.reshape(-1)[0] < expert_boundary):
            dit, low_noise = self.dit2, True  # the low-noise expert below the boundary, as diffusers' boundary_ratio
        if dit is None:
            raise UserError("no Wan DiT loaded")
        settings = {name: inputs.pop(name, default) for name, default in self.call_settings().items()}
        settings.update(use_gradient_checkpointing=use_gradient_checkpointing,
                        use_gradient_checkpointing_offload=use_gradient_checkpointing_offload)
        return model_fn_wan(self, dit, latents, timestep, prompt_embeds, image_embeds, condition, first_frame_latents,
                            end_image_embeds, low_noise=low_noise, features=self.features, settings=settings,
                            **inputs)

    def module_path(self, slot: str, path: str) -> str:
        """`--trainable_models dit.blocks.0.self_attn.q` (Wan's original module names) -> blocks.0.attn1.to_q."""
        from .lora_names import module_in_diffusers

        return module_in_diffusers(path) if slot in ("dit", "dit2") else path

    def load_lora(self, module, path: str, alpha: float = 1.0) -> None:
        """As `BasePipeline.load_lora`; a DiT LoRA (`transformer.`) also fuses into the low-noise expert `dit2`,
        whose runs train it as `dit` (diffusers: `load_lora_weights(..., load_into_transformer_2=True)`)."""
        from ...lora import fuse_lora, load_lora_file

        if module is None or module is not self.dit2:
            return super().load_lora(module, path, alpha)
        lora = load_lora_file(path, converters=self.spec.lora_converters)
        component = "transformer_2" if "transformer_2" in lora.components else "transformer"
        fuse_lora(module, lora, scale=alpha, component=component)

    # -- sampling hooks -------------------------------------------------------------------------------
    def set_timesteps(self, values, num_inference_steps, denoising_strength=1.0):
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength)

    def finish_latents(self, latents, values):
        first = values.get("first_frame_latents")  # TI2V-5B: the clean first frame back in place
        if first is not None:
            latents = torch.cat([first.to(latents.dtype), latents[:, :, 1:]], dim=2)
        return latents

    def sampling_settings(self, values):
        """With both A14B experts, `dit` runs above the boundary and `dit2` below: the call's `boundary_ratio` x
        1000, else the repository's boundary_ratio, else 0.875 (diffusers' `boundary_ratio`)."""
        if self.dit2 is None:
            return {}
        ratio = values.get("boundary_ratio")
        ratio = self.boundary_ratio if ratio is None else ratio
        ratio = DEFAULT_BOUNDARY_RATIO if ratio is None else float(ratio)
        return {"expert_boundary": ratio * self.scheduler.num_train_timesteps}


class WanVideoPipeline(WanBasePipeline):
    """Wan2.1 / Wan2.2 text-, image- and first-last-frame-to-video, with the features that add to the same
    algorithm (each its own module, chosen per run from its data columns and models; docs/wan.md)."""

    features = (CLIP, I2V, CAMERA_IMAGE, TI2V, FUN_CONTROL, FUN_REFERENCE, CAMERA, SPEED_CONTROL, VACE, ANIMATE,
                ANIMATE_REPLACE)


__all__ = ["CALL_DEFAULTS", "CLIP", "I2V", "TI2V", "WanBasePipeline", "WanVideoPipeline"]
