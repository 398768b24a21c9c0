"""`StableDiffusionXLPipeline`: SDXL text-to-image (and image-to-image), an epsilon-predicting UNet on the DDPM
schedule with text-time micro-conditioning, sampled with DDIM steps: inference and the training hooks.

The prompt is both CLIP encoders' second-to-last hidden states side by side (768 + 1280 = 2048 wide) and bigG's
projected embedding at the end-of-text token, as diffusers' `StableDiffusionXLPipeline` and kohya encode it (the
reference pools the start token and takes CLIP-L's third-to-last layer: docs/reference_differences.md). The time ids
are (original height, width, crop top, left, target height, width): a training picture's size before its resize and
its crop, as diffusers' SDXL training script and kohya give them; a size alone (sampling) is its own original."""

from __future__ import annotations

import torch

from ...core.common_units import NoiseInitializer, PromptEmbedder, ShapeChecker
from ...core.pipeline import PromptImagePipeline
from ...core.target import EPSILON, V_PREDICTION, ImageStream, Target
from ...core.units import PipelineUnit
from ...data.operators import CROP_TOP_LEFT, ORIGINAL_SIZE
from ...errors import UserError
from ...media.image import images_to_tensor
from ...parts import ldm
from ...parts.clip import token_ids

# diffusers' StableDiffusionXLPipeline and the reference's: 1024 x 1024, 50 steps, guidance 5 (the reference: 7)
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 50, "cfg_scale": 5.0}
TIME_IDS = 6


class SDXLShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 8 (the autoencoder's)."""


class SDXLNoiseInitializer(NoiseInitializer):
    """Initial noise (B, 4, H/8, W/8) from `seed`, drawn on `rand_device` (the CPU by default)."""


class SDXLInputImageEmbedder(PipelineUnit):
    """The input image's latents: clean in training; noised to the first sampling timestep for image-to-image."""

    inputs = ("input_image", "noise", "height", "width")
    outputs = ("latents", "input_latents")
    models = ("vae",)

    def process(self, pipe, input_image, noise, height, width):
        if input_image is None:
            return {"latents": noise}
        clean = ldm.vae_encode(pipe, images_to_tensor(input_image, height, width))
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": clean}
        return {"latents": pipe.scheduler.start_latents(clean, noise), "input_latents": clean}


def _images(input_image) -> list:
    if input_image is None:
        return []
    return list(input_image) if isinstance(input_image, (list, tuple)) else [input_image]


class SDXLTimeIds(PipelineUnit):
    """(original h, w, crop top, left, target h, w) per sample: a cropped training picture's own, else the size."""

    inputs = ("input_image", "height", "width", "batch_size")
    outputs = ("add_time_ids",)

    def process(self, pipe, input_image, height, width, batch_size):
        images = _images(input_image)
        rows = []
        for i in range(max(len(images), int(batch_size or 1))):
            info = getattr(images[i], "info", {}) if i < len(images) else {}
            original = tuple(info.get(ORIGINAL_SIZE, (height, width)))
            crop = tuple(info.get(CROP_TOP_LEFT, (0, 0)))
            rows.append([*original, *crop, int(height), int(width)])
        return {"add_time_ids": torch.tensor(rows, dtype=torch.float32, device=pipe.device)}


class SDXLPromptEmbedder(PromptEmbedder):
    """The prompt (and the negative prompt) through CLIP-L and bigG: their second-to-last hidden states side by side,
    and bigG's projected end-of-text embedding."""

    models = ("text_encoder", "text_encoder_2")
    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds"),
                   "pooled_prompt_embeds": ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")}

    def embed(self, pipe, prompts):
        ids_1 = token_ids(pipe.tokenizer, prompts, pipe.device, NO_TOKENIZER)
        ids_2 = token_ids(pipe.tokenizer_2, prompts, pipe.device, NO_TOKENIZER_2)
        hidden_1 = pipe.text_encoder(ids_1, output_hidden_states=True).hidden_states[-2]
        out_2 = pipe.text_encoder_2(ids_2, output_hidden_states=True)
        return {"prompt_embeds": torch.cat([hidden_1, out_2.hidden_states[-2]], dim=-1).to(pipe.torch_dtype),
                "pooled_prompt_embeds": out_2.text_embeds.to(pipe.torch_dtype)}


NO_TOKENIZER = "no CLIP-L tokenizer: pass --tokenizer_path (the model's tokenizer/ folder) to encode prompts"
NO_TOKENIZER_2 = "no bigG tokenizer: pass --tokenizer_2_path (the model's tokenizer_2/ folder) to encode prompts"


def _decode(pipe, latents):
    return ldm.vae_decode(pipe, latents)


class StableDiffusionXLPipeline(PromptImagePipeline):
    model_names = ("unet", "text_encoder", "text_encoder_2", "vae")
    loss_models = ("unet",)
    model_fn_inputs = ("prompt_embeds", "pooled_prompt_embeds", "add_time_ids")
    padding_masks = ()
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=ldm.LATENT_CHANNELS, scale=ldm.VAE_SCALE, division=ldm.VAE_SCALE,
                                 decoder=_decode),), prediction=EPSILON)
    scheduler_config = ldm.DDPM_SCHEDULER_CONFIG
    base_units = (SDXLShapeChecker, SDXLNoiseInitializer, SDXLInputImageEmbedder, SDXLTimeIds, SDXLPromptEmbedder)

    @classmethod
    def check_models(cls, models) -> None:
        """The UNet cross-attends to both encoders' hidden states side by side and adds bigG's projection to its
        time embedding beside six time ids."""
        unet, one, two, vae = (models.get(k) for k in ("unet", "text_encoder", "text_encoder_2", "vae"))
        if unet is not None and one is not None and two is not None:
            width = one.config["hidden_size"] + two.config["hidden_size"]
            if width != unet.config["cross_attention_dim"]:
                raise UserError(f"the text encoders {one.describe()} and {two.describe()} are {width} wide together "
                                f"and the unet {unet.describe()} cross-attends to {unet.config['cross_attention_dim']}"
                                f"-wide hidden states: give the SDXL UNet its own CLIP-L and bigG")
            added = unet.config["addition_time_embed_dim"] * TIME_IDS + two.config["projection_dim"]
            if added != unet.config["projection_class_embeddings_input_dim"]:
                raise UserError(f"the text_encoder_2 {two.describe()} projects to {two.config['projection_dim']} and "
                                f"the unet {unet.describe()} adds a {unet.config['projection_class_embeddings_input_dim']}"
                                f"-wide vector (6 time ids x {unet.config['addition_time_embed_dim']} + the "
                                f"projection): give the SDXL UNet its own bigG encoder")
        if unet is not None and vae is not None:
            have, wanted = vae.config["latent_channels"], unet.config["in_channels"]
            if have != wanted:
                raise UserError(f"the vae {vae.describe()} makes {have}-channel latents and the unet "
                                f"{unet.describe()} denoises {wanted} channels: give the UNet its own autoencoder")

    def model_fn(self, latents, timestep, prompt_embeds, pooled_prompt_embeds=None, add_time_ids=None, **inputs):
        if self.unet is None:
            raise UserError("no SDXL UNet loaded")
        if pooled_prompt_embeds is None or add_time_ids is None:
            raise UserError("SDXL's UNet needs the pooled prompt embedding and the time ids")
        b = latents.shape[0]
        added = {"text_embeds": pooled_prompt_embeds.expand(b, -1) if pooled_prompt_embeds.shape[0] == 1 else
                 pooled_prompt_embeds,
                 "time_ids": add_time_ids.expand(b, -1) if add_time_ids.shape[0] == 1 else add_time_ids}
        return ldm.unet_call(self.unet, latents, timestep, prompt_embeds, added_cond_kwargs=added, **inputs)


class StableDiffusionXLVPredictionPipeline(StableDiffusionXLPipeline):
    """--v_parameterization: a base that predicts the velocity (SD 2.x 768-v, NoobAI-XL v-pred and their
    fine-tunes); trained against diffusers' `get_velocity` and sampled with v steps."""

    target = Target(StableDiffusionXLPipeline.target.streams, prediction=V_PREDICTION)

    @classmethod
    def claims(cls, context) -> bool:
        return bool(context.option("v_parameterization")) and not context.option("zero_terminal_snr")


class StableDiffusionXLZeroTerminalSNRPipeline(StableDiffusionXLVPredictionPipeline):
    """--v_parameterization --zero_terminal_snr: the schedule rescaled so its last step is pure noise, sampled from
    there (diffusers' rescale_betas_zero_snr and "trailing" spacing)."""

    scheduler_config = {**ldm.DDPM_SCHEDULER_CONFIG, **ldm.ZERO_TERMINAL_SNR}

    @classmethod
    def claims(cls, context) -> bool:
        return bool(context.option("v_parameterization")) and bool(context.option("zero_terminal_snr"))


VARIANTS = (StableDiffusionXLVPredictionPipeline, StableDiffusionXLZeroTerminalSNRPipeline)

__all__ = ["CALL_DEFAULTS", "VARIANTS", "StableDiffusionXLPipeline", "StableDiffusionXLVPredictionPipeline", "StableDiffusionXLZeroTerminalSNRPipeline"]
