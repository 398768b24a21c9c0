"""`StableDiffusionPipeline`: Stable Diffusion 1.x text-to-image (and image-to-image from an input image), an
epsilon-predicting UNet on the DDPM schedule, sampled with DDIM steps: inference and the training hooks.

The prompt is CLIP-L's last hidden states over 77 tokens padded to that length (diffusers' `encode_prompt` and the
reference's prompt embedder); latents are the KL-f8 autoencoder's posterior mean times its scaling factor."""

from __future__ import annotations


from ...core.common_units import NoiseInitializer, PromptEmbedder, ShapeChecker, prompt_list
from ...core.pipeline import PromptImagePipeline
from ...core.target import EPSILON, V_PREDICTION, ImageStream, Target
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor
from ...parts import ldm
from ...parts.clip import token_ids

# diffusers' StableDiffusionPipeline and the reference's: 512 x 512, 50 steps, guidance 7.5
NO_TOKENIZER = "no CLIP tokenizer: pass --tokenizer_path (the model's tokenizer/ folder) to encode prompts"
CALL_DEFAULTS = {"height": 512, "width": 512, "num_inference_steps": 50, "cfg_scale": 7.5}


class SDShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 8 (the autoencoder's)."""


class SDNoiseInitializer(NoiseInitializer):
    """Initial noise (B, 4, H/8, W/8) from `seed`, drawn on `rand_device` (the CPU by default)."""


class SDInputImageEmbedder(PipelineUnit):
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


class SDPromptEmbedder(PromptEmbedder):
    """The prompt (and the negative prompt) through CLIP-L: its last hidden states, 77 tokens; with `clip_skip` N > 1
    the N-th from the end through the final layer norm (kohya's and A1111's clip skip)."""

    inputs = ("clip_skip", "run_clip_skip")  # a sampling call's, else the run's --clip_skip

    def process(self, pipe, prompt, clip_skip=None, run_clip_skip=None):
        if prompt is None:
            return {}
        return self.embed(pipe, prompt_list(prompt), int(clip_skip or run_clip_skip or 1))

    def embed(self, pipe, prompts, clip_skip: int = 1):
        ids = token_ids(pipe.tokenizer, prompts, pipe.device, NO_TOKENIZER)
        if clip_skip == 1:
            return {"prompt_embeds": pipe.text_encoder(ids)[0].to(pipe.torch_dtype)}
        layers = pipe.text_encoder.config.num_hidden_layers
        if clip_skip > layers:
            raise UserError(f"--clip_skip {clip_skip}: the text encoder has {layers} layers")
        hidden = pipe.text_encoder(ids, output_hidden_states=True).hidden_states[-clip_skip]
        return {"prompt_embeds": pipe.text_encoder.final_layer_norm(hidden).to(pipe.torch_dtype)}


def _decode(pipe, latents):
    return ldm.vae_decode(pipe, latents)


class StableDiffusionPipeline(PromptImagePipeline):
    settings = PromptImagePipeline.settings | {"run_clip_skip"}
    call_parameters = {"clip_skip": None}
    model_names = ("unet", "text_encoder", "vae")
    loss_models = ("unet",)
    model_fn_inputs = ("prompt_embeds",)
    padding_masks = ()
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=ldm.LATENT_CHANNELS, scale=ldm.VAE_SCALE, division=ldm.VAE_SCALE,
                                 decoder=_decode),), prediction=EPSILON)
    scheduler_config = ldm.DDPM_SCHEDULER_CONFIG
    base_units = (SDShapeChecker, SDNoiseInitializer, SDInputImageEmbedder, SDPromptEmbedder)

    @classmethod
    def check_models(cls, models) -> None:
        """The UNet cross-attends to the text encoder's hidden states and denoises the autoencoder's latents."""
        unet, encoder, vae = models.get("unet"), models.get("text_encoder"), models.get("vae")
        if unet is not None and encoder is not None:
            width, wanted = encoder.config["hidden_size"], unet.config["cross_attention_dim"]
            if width != wanted:
                raise UserError(f"the text_encoder {encoder.describe()} is {width} wide and the unet "
                                f"{unet.describe()} cross-attends to {wanted}-wide hidden states: give the UNet its "
                                f"own text encoder (SD 1.x: CLIP-L, 768)")
        if unet is not None and vae is not None:
            have, wanted = vae.config["latent_channels"], unet.config["in_channels"]
            if have != wanted:
                raise UserError(f"the vae {vae.describe()} makes {have}-channel latents and the unet "
                                f"{unet.describe()} denoises {wanted} channels: give the UNet its own autoencoder")

    def model_fn(self, latents, timestep, prompt_embeds, **inputs):
        if self.unet is None:
            raise UserError("no Stable Diffusion UNet loaded")
        return ldm.unet_call(self.unet, latents, timestep, prompt_embeds, **inputs)


class StableDiffusionVPredictionPipeline(StableDiffusionPipeline):
    """--v_parameterization: a base that predicts the velocity (SD 2.x 768-v, NoobAI-XL v-pred and their
    fine-tunes); trained against diffusers' `get_velocity` and sampled with v steps."""

    target = Target(StableDiffusionPipeline.target.streams, prediction=V_PREDICTION)

    @classmethod
    def claims(cls, context) -> bool:
        return bool(context.option("v_parameterization")) and not context.option("zero_terminal_snr")


class StableDiffusionZeroTerminalSNRPipeline(StableDiffusionVPredictionPipeline):
    """--v_parameterization --zero_terminal_snr: the schedule rescaled so its last step is pure noise, sampled from
    there (diffusers' rescale_betas_zero_snr and "trailing" spacing)."""

    scheduler_config = {**ldm.DDPM_SCHEDULER_CONFIG, **ldm.ZERO_TERMINAL_SNR}

    @classmethod
    def claims(cls, context) -> bool:
        return bool(context.option("v_parameterization")) and bool(context.option("zero_terminal_snr"))


VARIANTS = (StableDiffusionVPredictionPipeline, StableDiffusionZeroTerminalSNRPipeline)

__all__ = ["CALL_DEFAULTS", "VARIANTS", "StableDiffusionPipeline", "StableDiffusionVPredictionPipeline", "StableDiffusionZeroTerminalSNRPipeline"]
