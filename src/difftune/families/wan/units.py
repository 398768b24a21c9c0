"""Wan's units: size and frame count, noise, the clip's VAE latents, the UMT5 prompt, and the image conditions
(CLIP embedding, the I2V first-frame condition, TI2V's clean first-frame latents).

Every unit names the models it uses. Which image condition applies is a property of the declared VAE (the
Wan2.2 48-channel VAE is TI2V-5B's, whose first frame is fused into the latents; the 16-channel one conditions
the I2V DiTs on channels), so no unit reads the DiT: the DiT, the only trainable model, is used by `model_fn`
alone, and stage 1 runs every unit.
"""

from __future__ import annotations

import torch
from PIL import Image

from ...core.common_units import PromptEmbedder
from ...core.latents import seeded_noise
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list, images_to_tensor

PATCH = 2  # the DiT's spatial patch (1, 2, 2)
MAX_PROMPT_TOKENS = 512  # diffusers' WanPipeline max_sequence_length and the reference's tokenizer length


def vae_scales(vae) -> tuple[int, int, int]:
    """(latent channels, spatial factor, temporal factor) of a Wan VAE."""
    c = vae.config
    return int(c.z_dim), int(c.scale_factor_spatial or 8), int(c.scale_factor_temporal or 4)


def latent_frames(num_frames: int, temporal: int = 4) -> int:
    return (int(num_frames) - 1) // temporal + 1


def _normalise(vae, z: torch.Tensor) -> torch.Tensor:
    # diffusers' Wan pipelines: (z - mean) * (1 / std), per channel
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    return (z - mean) * inv_std


def vae_encode(pipe, video: torch.Tensor) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> normalised latents, the posterior mode (deterministic), in float32."""
    vae = pipe.vae
    z = vae.encode(video.to(device=pipe.device, dtype=vae.dtype)).latent_dist.mode()
    return _normalise(vae, z.float())


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents -> video (B, 3, F, H, W) in [-1, 1]."""
    vae = pipe.vae
    c = vae.config
    z = latents.to(vae.dtype)
    mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    return vae.decode(z / inv_std + mean).sample


def video_tensor(frames, height: int, width: int) -> torch.Tensor:
    """A list of PIL frames (or one image) -> (1, 3, F, H, W) in [-1, 1], resized to (height, width)."""
    return images_to_tensor(as_image_list(frames), height, width).permute(1, 0, 2, 3).unsqueeze(0)


def _per_sample(value, batch_size: int) -> list:
    """One image per sample: a stage-1 batch gives a list of them, inference one for all."""
    if isinstance(value, (list, tuple)) and len(value) == batch_size:
        return list(value)
    return [value] * batch_size


class WanShapeChecker(PipelineUnit):
    """Height and width rounded up to multiples of the VAE factor times the 2x2 patch (16; 32 for TI2V-5B);
    the frame count to the form 4k + 1 (down, as diffusers' pipelines)."""

    inputs = ("height", "width", "num_frames")
    outputs = ("height", "width", "num_frames")
    models = ("vae",)

    def process(self, pipe, height, width, num_frames):
        if height is None or width is None:
            raise UserError("height and width are required (or a video / input image to take them from)")
        _, spatial, temporal = vae_scales(pipe.vae)
        f = spatial * PATCH
        frames = 1 if num_frames is None else max(int(num_frames), 1)
        frames = (frames - 1) // temporal * temporal + 1
        return {"height": -(-int(height) // f) * f, "width": -(-int(width) // f) * f, "num_frames": frames}


class WanNoiseInitializer(PipelineUnit):
    """Initial noise (B, C, (F-1)/4+1, H/s, W/s) from `seed`, drawn in float32 on `rand_device` (the CPU unless
    a data row names another, as the reference's distillation rows do), as diffusers draws it."""

    inputs = ("height", "width", "num_frames", "seed", "rand_device", "batch_size")
    outputs = ("noise",)
    models = ("vae",)

    def process(self, pipe, height, width, num_frames, seed, rand_device, batch_size):
        rand_device = rand_device or "cpu"
        if isinstance(rand_device, (list, tuple)):  # one per sample; batches share it (batch_signature)
            rand_device = rand_device[0]
        channels, spatial, temporal = vae_scales(pipe.vae)
        shape = (channels, latent_frames(num_frames, temporal), height // spatial, width // spatial)
        return {"noise": seeded_noise(shape, seed, batch_size, str(rand_device)).to(pipe.device)}


class WanInputVideoEmbedder(PipelineUnit):
    """The clip's latents: clean `input_latents` in training; sampling starts from the noise."""

    inputs = ("input_video", "noise", "height", "width")
    outputs = ("latents", "input_latents")
    models = ("vae",)

    def process(self, pipe, input_video, noise, height, width):
        if input_video is None:
            return {"latents": noise}
        clips = input_video if isinstance(input_video, (list, tuple)) and input_video and \
            not isinstance(input_video[0], Image.Image) else [input_video]
        latents = torch.cat([vae_encode(pipe, video_tensor(c, height, width)) for c in clips])
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": latents}
        raise UserError("video-to-video sampling (input_video) is not supported yet")


class WanPromptEmbedder(PromptEmbedder):
    """UMT5's last hidden states over 512 tokens, zero past each prompt's end (diffusers' WanPipeline and the
    reference alike), after diffusers' prompt cleaning."""

    def embed(self, pipe, prompts):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if getattr(pipe, "tokenizer", None) is None:
            raise UserError("no UMT5 tokenizer: pass --tokenizer_path (or tokenizer_config) to encode prompts")
        tokens = pipe.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=MAX_PROMPT_TOKENS, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(pipe.device), tokens.attention_mask.to(pipe.device)
        hidden = pipe.text_encoder(ids, mask).last_hidden_state
        keep = (torch.arange(hidden.shape[1], device=hidden.device)[None] < mask.sum(1, keepdim=True))
        return {"prompt_embeds": (hidden * keep[..., None]).to(pipe.torch_dtype)}


class WanImageEmbedderCLIP(PipelineUnit):
    """Wan2.1 I2V 14B's image embedding: CLIP's penultimate hidden states of the input image, and of the end image
    apart (`model_fn` appends it where the DiT has position embeddings for two images, FLF2V). Nothing when no CLIP
    image encoder is loaded (the other variants)."""

    inputs = ("input_image", "end_image", "height", "width", "batch_size")
    outputs = ("image_embeds", "end_image_embeds")
    models = ("image_encoder",)
    feature = "clip"

    def process(self, pipe, input_image, end_image, height, width, batch_size):
        if input_image is None or pipe.models.get("image_encoder") is None:
            return {}
        processor = getattr(pipe, "image_processor", None) or official_clip_processor(pipe.image_encoder)
        n = int(batch_size or 1)

        def embed(images):
            images = [im.convert("RGB") if im.size == (width, height) else im.convert("RGB").resize((width, height))
                      for im in images]
            pixels = processor(images=images, return_tensors="pt").pixel_values
            hidden = pipe.image_encoder(pixel_values=pixels.to(pipe.device, pipe.image_encoder.dtype),
                                        output_hidden_states=True).hidden_states[-2]
            return hidden.to(pipe.torch_dtype)

        out = {"image_embeds": embed(_per_sample(input_image, n))}
        if end_image is not None:
            out["end_image_embeds"] = embed(_per_sample(end_image, n))
        return out


def official_clip_processor(image_encoder):
    """Wan's own CLIP preprocessing, for weights with no image_processor/ folder (Wan-AI's original .pth): the
    whole image resized (not cropped) to the encoder's input size, bicubic, normalised with CLIP's mean / std."""
    from transformers import CLIPImageProcessor

    side = int(image_encoder.config.image_size)
    return CLIPImageProcessor(size={"height": side, "width": side}, do_center_crop=False, resample=3,
                              image_mean=[0.48145466, 0.4578275, 0.40821073],
                              image_std=[0.26862954, 0.26130258, 0.27577711])


class WanImageEmbedderVAE(PipelineUnit):
    """The I2V condition (Wan2.1 I2V, Wan2.2 I2V-A14B): the input image (and end image) as the first (and last)
    frame of an otherwise black clip, VAE-encoded, behind a 4-channel mask of the known frames; `model_fn`
    concatenates it to the latents on channels. Nothing for the 48-channel VAE (TI2V-5B fuses instead)."""

    inputs = ("input_image", "end_image", "num_frames", "height", "width", "batch_size")
    outputs = ("condition",)
    models = ("vae",)
    feature = "i2v"

    def process(self, pipe, input_image, end_image, num_frames, height, width, batch_size):
        channels, spatial, temporal = vae_scales(pipe.vae)
        if input_image is None or spatial != 8:
            return {}
        n = int(batch_size or 1)
        out = []
        for first, last in zip(_per_sample(input_image, n), _per_sample(end_image, n)):
            frames = images_to_tensor([first], height, width).permute(1, 0, 2, 3)  # (3, 1, H, W)
            blank = frames.new_zeros(3, num_frames - (1 if last is None else 2), height, width)
            parts = [frames, blank] + ([images_to_tensor([last], height, width).permute(1, 0, 2, 3)]
                                       if last is not None else [])
            z = vae_encode(pipe, torch.cat(parts, dim=1).unsqueeze(0))
            known = torch.zeros(num_frames)
            known[0] = 1
            if last is not None:
                known[-1] = 1
            # the first frame stands for `temporal` frames in the mask, as the VAE's first latent frame does
            known = torch.cat([known[:1].repeat(temporal), known[1:]])
            h, w = height // spatial, width // spatial
            mask = known.view(-1, temporal, 1, 1).expand(-1, temporal, h, w).transpose(0, 1)
            out.append(torch.cat([mask[None].to(z.device, z.dtype), z], dim=1))
        return {"condition": torch.cat(out).to(pipe.torch_dtype)}


class WanImageEmbedderFused(PipelineUnit):
    """TI2V-5B: the input image's latents, which stand as the clean first latent frame (`model_fn` puts them
    there with timestep 0, the loss leaves that frame out). Nothing for the 16-channel VAE."""

    inputs = ("input_image", "height", "width", "batch_size")
    outputs = ("first_frame_latents",)
    models = ("vae",)
    feature = "ti2v"

    def process(self, pipe, input_image, height, width, batch_size):
        _, spatial, _ = vae_scales(pipe.vae)
        if input_image is None or spatial == 8:
            return {}
        n = int(batch_size or 1)
        z = [vae_encode(pipe, video_tensor([im], height, width)) for im in _per_sample(input_image, n)]
        return {"first_frame_latents": torch.cat(z).to(pipe.torch_dtype)}
