"""`WanVideoPipeline`: Wan2.1 / Wan2.2 text- and image-to-video (inference and the training hooks).

Architectures come from diffusers (`WanTransformer3DModel`, `AutoencoderKLWan`) and transformers
(`UMT5EncoderModel`, `CLIPVisionModel`), so diffusers-layout checkpoints load with their own key names. Which
variant it is follows from the weights: the DiT's channels (I2V takes a condition, TI2V-5B has 48), whether it
embeds a CLIP image, the VAE's channels, and whether a second DiT (the A14B low-noise expert) is loaded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ...core.batch import SAME
from ...core.pipeline import BasePipeline
from ...errors import UserError
from ...media.image import tensor_to_images
from .components import DEFAULT_BOUNDARY_RATIO, load_repo_scheduler
from .model_fn import model_fn_wan
from .scheduler import WanScheduler
from .units import (WanImageEmbedderCLIP, WanImageEmbedderFused, WanImageEmbedderVAE, WanInputVideoEmbedder,
                    WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker, frames_of, vae_decode, vae_scales)


class WanVideoPipeline(BasePipeline):
    family = "wan"
    model_names = ("dit", "dit2", "text_encoder", "vae", "image_encoder")
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds", "image_embeds", "condition", "first_frame_latents", "end_image_embeds")
    data_inputs = ("video", "image", "prompt", "seed", "rand_device", "input_image", "end_image",
                   "num_inference_steps")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME, "num_frames": SAME,
                      "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "num_frames", "rand_device")
    loss_models = ("dit",)
    decode_models = ("vae",)
    division_factor = 16  # x8 VAE and 2x2 patches (TI2V-5B's x16 VAE: its shape check rounds to 32)

    patch_size = 2
    vae_scale = 8
    latent_channels = 16
    # The video data path's settings: clips of 4k+1 frames, 81 by default (the reference's); --extra_inputs
    # input_image / end_image are the clip's first / last frame where the metadata has no such column.
    default_num_frames = 81
    time_division_factor = 4
    time_division_remainder = 1
    frame_inputs = {"input_image": ("video", 0), "end_image": ("video", -1)}

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler if scheduler is not None else WanScheduler()
        self.tokenizer = None
        self.image_processor = None
        self.boundary_ratio = None  # the A14B expert switch from the repository (model_index.json)
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      WanImageEmbedderCLIP(), WanImageEmbedderVAE(), WanImageEmbedderFused()]

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

    @classmethod
    def from_pretrained(cls, torch_dtype=torch.bfloat16, device="cpu", model_configs=(), scheduler=None, **configs):
        """As `BasePipeline.from_pretrained`; the repository's scheduler/ and model_index.json beside the
        weights (diffusers layout) are read too, so sampling equals diffusers' WanPipeline."""
        pipe = super().from_pretrained(torch_dtype=torch_dtype, device=device, model_configs=model_configs,
                                       scheduler=scheduler, **configs)
        if scheduler is None and pipe.repo_scheduler is None:
            for config in model_configs:
                files = config.resolve() if hasattr(config, "resolve") else config
                first = Path(files[0] if isinstance(files, (list, tuple)) else files)
                folder = (first if first.is_dir() else first.parent).parent / "scheduler"
                if (folder / "scheduler_config.json").is_file():
                    pipe.repo_scheduler = load_repo_scheduler(folder)
                    break
        return pipe

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None, first_frame_latents=None,
                 end_image_embeds=None, expert_boundary=None, **settings):
        dit = self.dit
        if expert_boundary is not None and self.dit2 is not None and bool(timestep.reshape(-1)[0] < expert_boundary):
            dit = self.dit2  # the low-noise expert below the boundary, as diffusers' boundary_ratio
        if dit is None:
            raise UserError("no Wan DiT loaded")
        return model_fn_wan(dit, latents, timestep, prompt_embeds, image_embeds, condition, first_frame_latents,
                            end_image_embeds, **settings)

    def load_lora(self, module, path: str, alpha: float = 1.0) -> None:
        """As `BasePipeline.load_lora`; a DiT LoRA (`transformer.`) also fuses into the low-noise expert `dit2`,
        whose runs train it as `dit` (diffusers: `load_lora_weights(..., load_into_transformer_2=True)`)."""
        from ...core.family import get_family
        from ...lora import fuse_lora, load_lora_file

        if module is None or module is not self.dit2:
            return super().load_lora(module, path, alpha)
        lora = load_lora_file(path, converters=get_family(self.family).lora_converters)
        component = "transformer_2" if "transformer_2" in lora.components else "transformer"
        fuse_lora(module, lora, scale=alpha, component=component)

    # -- latent layout --------------------------------------------------------------------------------
    def loss_mask(self, values):
        """TI2V-5B with an input image: its first latent frame is given clean, so it is left out of the loss."""
        if values.get("first_frame_latents") is None:
            return None
        frames = values["input_latents"].shape[2]
        mask = torch.ones(1, 1, frames, 1, 1)
        mask[:, :, 0] = 0
        return mask

    def noise_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """The latents of a clip of `num_frames` frames (validation: one frame unless told)."""
        channels, spatial, temporal = (self.latent_channels, self.vae_scale, 4) if self.vae is None \
            else vae_scales(self.vae)
        return (channels, (int(num_frames) - 1) // temporal + 1, height // spatial, width // spatial)

    def validation_unavailable(self) -> str | None:
        config = self.dit.config if self.dit is not None else None
        if config is not None and (config.in_channels != config.out_channels or config.image_dim is not None):
            return "this Wan DiT is image-to-video and validation renders from the prompt alone"
        return None

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> clips (B, 3, F, H, W) in [-1, 1]; a one-frame clip as images (B, 3, H, W)."""
        video = vae_decode(self, latents)
        return video[:, :, 0] if video.shape[2] == 1 else video

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """A clip (`video`: its frames; or `image`: a one-frame clip) and its prompt; `input_image` and
        `end_image` when the data gives them (--extra_inputs)."""
        row = data.get("_row", "?")
        video = data.get("video")
        if video is None:
            video = data.get("image")
        frames = frames_of(video)
        if not frames or not all(isinstance(f, Image.Image) for f in frames):
            raise UserError(f"row {row}: no clip: 'video' (frames) or 'image' must be a file listed in "
                            f"--data_file_keys")
        if (len(frames) - 1) % 4:
            raise UserError(f"row {row}: the clip has {len(frames)} frames; Wan needs 4k+1 (e.g. --num_frames 81)")
        images = {}
        for name, pick in (("input_image", 0), ("end_image", -1)):
            value = data.get(name)
            if isinstance(value, (list, tuple)) and value and all(isinstance(f, Image.Image) for f in value):
                value = value[pick]  # a file column read as a clip (an image file is a one-frame clip)
            if value is not None and not isinstance(value, Image.Image):
                raise UserError(f"row {row}: '{name}' must be an image (an image file, or a frame of the clip)")
            images[name] = value
        prompt = data.get("prompt", "")
        if prompt is None or (isinstance(prompt, float) and math.isnan(prompt)):
            prompt = ""
        width, height = frames[0].size
        return {"prompt": prompt, "negative_prompt": "", "input_video": frames, "height": height, "width": width,
                "num_frames": len(frames), "input_image": images["input_image"], "end_image": images["end_image"],
                "seed": data.get("seed"), "rand_device": data.get("rand_device", "cpu"), "batch_size": 1,
                "num_inference_steps": data.get("num_inference_steps")}

    @staticmethod
    def batch_signature(sample: dict[str, Any]) -> tuple:
        frames = frames_of(sample.get("video") if sample.get("video") is not None else sample.get("image"))
        return (frames[0].size if frames else None, len(frames), sample.get("input_image") is not None,
                sample.get("end_image") is not None, sample.get("rand_device", "cpu"))

    # -- inference ------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "", input_image=None,
                 end_image=None, height: int | None = 480, width: int | None = 832, num_frames: int = 81,
                 num_inference_steps: int = 50, cfg_scale: float = 5.0, seed: int | None = None,
                 boundary_ratio: float | None = None, progress: bool = True, output_type: str = "pil"):
        """Frames as PIL images (a list per prompt when `prompt` is a list); `output_type` "latent" or "pt"
        (B, 3, F, H, W) in [0, 1]. With both A14B experts, `dit` runs above `boundary_ratio` x 1000 and `dit2`
        below (the repository's boundary_ratio, else 0.875)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negatives = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = input_image.size
        values: dict[str, Any] = {
            "prompt": prompts, "negative_prompt": negatives, "height": height, "width": width,
            "num_frames": num_frames, "seed": seed, "batch_size": len(prompts), "input_image": input_image,
            "end_image": end_image,
        }
        self.run_units(values, cfg=cfg_scale != 1.0)
        self.scheduler.set_timesteps(num_inference_steps)
        settings = {}
        if self.dit2 is not None:
            ratio = boundary_ratio if boundary_ratio is not None else self.boundary_ratio
            ratio = DEFAULT_BOUNDARY_RATIO if ratio is None else float(ratio)
            settings["expert_boundary"] = ratio * self.scheduler.num_train_timesteps
        latents = self.denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)
        first = values.get("first_frame_latents")
        if first is not None:
            latents = torch.cat([first.to(latents.dtype), latents[:, :, 1:]], dim=2)
        if output_type == "latent":
            return latents
        video = vae_decode(self, latents)
        if output_type == "pt":
            return (video.float() / 2 + 0.5).clamp(0, 1)
        clips = [tensor_to_images(v.transpose(0, 1)) for v in video]
        return clips[0] if isinstance(prompt, str) else clips
