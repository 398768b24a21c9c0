"""Qwen-Image (and Qwen-Image-Edit): its units, its model_fn and its pipeline.

Architectures come from diffusers (`QwenImageTransformer2DModel`, `AutoencoderKLQwenImage`) and
transformers (`Qwen2_5_VLForConditionalGeneration`), so official checkpoints load with their own key names.
Values keep a leading batch dimension; prompt embeddings of a batch are padded and masked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from PIL import Image

from ..errors import UserError
from .base import BasePipeline, PipelineUnit
from .images import as_image_list, images_to_tensor, tensor_to_images

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
EDIT_PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
                        "texture, objects, background), then explain how the user's text instruction should alter or "
                        "modify the image. Generate a new image that meets the user's requirements while maintaining "
                        "consistency with the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
                        "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512
DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches
# The reference's LoRA targets for the DiT (its example commands): every attention projection, the output
# projections of both MLPs and the modulation layers.
LORA_TARGET_MODULES = ("to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,"
                       "txt_mlp.net.2,txt_mod.1")
VAE_SCALE = 8
EDIT_IMAGE_AREA = 1024 * 1024


def template_drop_count(tokenizer, template: str) -> int:
    """How many leading template tokens to drop from the text encoder's output.

    The official pipelines hard-code 34 (text-to-image) and 64 (edit), which is right only for the
    official tokenizer. This counts the tokens of the template's system part (everything before the
    first placeholder: the prompt `{}` or the image `<|vision_start|>`) with the tokenizer at hand.
    """
    cut = min(i for i in (template.find("{}"), template.find("<|vision_start|>")) if i >= 0)
    return len(tokenizer(template[:cut], add_special_tokens=False)["input_ids"])


def edit_image_size(width: int, height: int, area: int = EDIT_IMAGE_AREA) -> tuple[int, int]:
    """Qwen-Image-Edit's automatic resize: keep the aspect ratio, about `area` pixels, sides multiples of 32."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return max(32, round(w / 32) * 32), max(32, round(h / 32) * 32)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/2*W/2, C*4) tokens of 2x2 patches."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents` for latent size (height, width)."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)


def _latent_stats(vae, dtype, device):
    mean = torch.tensor(vae.config.latents_mean, dtype=dtype, device=device).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=dtype, device=device).view(1, -1, 1, 1)
    return mean, std


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> normalised latents (B, 16, H/8, W/8), the posterior mode (deterministic)."""
    vae = pipe.vae
    x = images.to(device=pipe.device, dtype=vae.dtype).unsqueeze(2)  # the VAE is a video VAE: one frame
    z = vae.encode(x).latent_dist.mode()[:, :, 0]
    mean, std = _latent_stats(vae, z.dtype, z.device)
    return ((z - mean) / std).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    latents = latents.to(vae.dtype)
    mean, std = _latent_stats(vae, latents.dtype, latents.device)
    return vae.decode((latents * std + mean).unsqueeze(2)).sample[:, :, 0]


# -- units --------------------------------------------------------------------------------------------


class QwenImageShapeChecker(PipelineUnit):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""

    inputs = ("height", "width")
    outputs = ("height", "width")

    def process(self, pipe, height, width):
        if height is None or width is None:
            raise UserError("height and width are required (or an input image to take them from)")
        f = DIVISION_FACTOR
        return {"height": -(-int(height) // f) * f, "width": -(-int(width) // f) * f}


class QwenImageNoiseInitializer(PipelineUnit):
    """Initial noise from `seed`, drawn on `rand_device` so a seed gives the same noise on any accelerator."""

    inputs = ("height", "width", "seed", "rand_device", "batch_size")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, rand_device, batch_size):
        rand_device = rand_device or "cpu"
        if isinstance(rand_device, (list, tuple)):
            rand_device = rand_device[0]
        shape = (16, height // VAE_SCALE, width // VAE_SCALE)

        def draw(n, s):
            generator = torch.Generator(rand_device)
            generator.manual_seed(int(s)) if s is not None else generator.seed()
            return torch.randn((n, *shape), generator=generator, device=rand_device, dtype=torch.float32)

        if isinstance(seed, (list, tuple)):  # a batch of training samples: each sample's noise from its own seed
            noise = torch.cat([draw(1, s) for s in seed])
        else:  # one seed for the whole batch, as diffusers draws it
            noise = draw(batch_size or 1, seed)
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


class QwenImageInputImageEmbedder(PipelineUnit):
    """Encode the input image: clean latents in training; noised to the first timestep for image-to-image."""

    inputs = ("input_image", "noise", "height", "width")
    outputs = ("latents", "input_latents")
    models = ("vae",)

    def process(self, pipe, input_image, noise, height, width):
        if input_image is None:
            return {"latents": noise}
        input_latents = vae_encode(pipe, images_to_tensor(input_image, height, width))
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": input_latents}
        latents = pipe.scheduler.add_noise(input_latents, noise, pipe.scheduler.sigmas[0])
        return {"latents": latents, "input_latents": input_latents}


class QwenImageEditImageEmbedder(PipelineUnit):
    """Qwen-Image-Edit: resize the edit image to about 1 MP (unless told not to) and encode it."""

    inputs = ("edit_image", "edit_image_auto_resize")
    outputs = ("edit_image", "edit_latents")
    models = ("vae",)

    def process(self, pipe, edit_image, edit_image_auto_resize):
        if edit_image is None:
            return {}
        images = as_image_list(edit_image)
        if edit_image_auto_resize is not False:
            w, h = edit_image_size(*images[0].size)
            images = [img.convert("RGB").resize((w, h), Image.LANCZOS) for img in images]
        latents = vae_encode(pipe, images_to_tensor(images))
        return {"edit_image": images, "edit_latents": latents}


class QwenImagePromptEmbedder(PipelineUnit):
    """Encode the prompt with the Qwen-Image chat template (with the edit image for Qwen-Image-Edit)."""

    inputs = ("edit_image",)
    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds"),
                   "prompt_embeds_mask": ("prompt_embeds_mask", "negative_prompt_embeds_mask")}
    models = ("text_encoder",)

    def process(self, pipe, prompt, edit_image):
        if prompt is None:
            return {}
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        encoder = pipe.text_encoder
        if edit_image is None:
            template = PROMPT_TEMPLATE
            tokens = pipe.tokenizer([template.format(p) for p in prompts], max_length=TOKENIZER_MAX_LENGTH +
                                    pipe.template_drop(template), padding=True, truncation=True, return_tensors="pt")
            extra = {}
        else:
            template = EDIT_PROMPT_TEMPLATE
            tokens, extra = pipe.vl_inputs([template.format(p) for p in prompts], as_image_list(edit_image))
        tokens = {k: v.to(pipe.device) for k, v in tokens.items()}
        extra = {k: v.to(pipe.device) for k, v in extra.items()}
        if "pixel_values" in extra:
            extra["pixel_values"] = extra["pixel_values"].to(encoder.dtype)
        # The base model's last hidden state (after the final norm) is what the DiT reads; going round the
        # LM head saves a (tokens x 152k-vocabulary) logits tensor per batch at the real size.
        backbone = getattr(encoder, "model", encoder)
        hidden = backbone(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                          **extra).last_hidden_state
        drop = pipe.template_drop(template)
        pieces = [h[m.bool()][drop:][:MAX_SEQUENCE_LENGTH] for h, m in zip(hidden, tokens["attention_mask"])]
        length = max(p.shape[0] for p in pieces)
        embeds = torch.stack([torch.nn.functional.pad(p, (0, 0, 0, length - p.shape[0])) for p in pieces])
        mask = torch.stack([torch.arange(length, device=embeds.device) < p.shape[0] for p in pieces]).long()
        return {"prompt_embeds": embeds.to(pipe.torch_dtype), "prompt_embeds_mask": mask}


# -- model_fn -----------------------------------------------------------------------------------------


def _checkpoint_function(offload: bool):
    """A gradient-checkpointing function for diffusers' blocks; `offload` keeps the saved inputs on CPU."""

    def checkpointed(module, *args):
        if not offload:
            return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))

        def run(*cpu_args):
            return module(*[a.to(device, non_blocking=True) if isinstance(a, torch.Tensor) else a for a in cpu_args])

        # The checkpoint holds only what it is given: CPU copies. Their `.to(device)` is recomputed in backward.
        cpu_args = [a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args]
        return torch.utils.checkpoint.checkpoint(run, *cpu_args, use_reentrant=False)

    return checkpointed


def set_gradient_checkpointing(model, enabled: bool, offload: bool = False) -> None:
    state = (bool(enabled), bool(offload))
    if getattr(model, "_difftune_ckpt", None) == state:
        return
    if enabled:
        model.enable_gradient_checkpointing(gradient_checkpointing_func=_checkpoint_function(offload))
    elif getattr(model, "is_gradient_checkpointing", False):
        model.disable_gradient_checkpointing()
    model._difftune_ckpt = state


def model_fn_qwen_image(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                        prompt_embeds_mask: torch.Tensor | None = None, edit_latents: torch.Tensor | None = None,
                        use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                        **_: Any) -> torch.Tensor:
    """One denoiser call: latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    The prompt mask is passed to the transformer so padded prompt tokens are never attended to: a batch
    of prompts of different lengths gives the same result as one prompt at a time.
    """
    b, _, h, w = latents.shape
    tokens = pack_latents(latents)
    image_len = tokens.shape[1]
    shapes = [(1, h // 2, w // 2)]
    if edit_latents is not None:
        edits = edit_latents if isinstance(edit_latents, (list, tuple)) else [edit_latents]
        for e in edits:
            tokens = torch.cat([tokens, pack_latents(e.to(tokens.dtype))], dim=1)
            shapes.append((1, e.shape[-2] // 2, e.shape[-1] // 2))
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    timestep = timestep.to(device=latents.device, dtype=latents.dtype).expand(b)
    out = dit(hidden_states=tokens, timestep=timestep / 1000, encoder_hidden_states=prompt_embeds,
              encoder_hidden_states_mask=prompt_embeds_mask, img_shapes=[shapes] * b, return_dict=False)[0]
    return unpack_latents(out[:, :image_len], h, w)


# -- the pipeline -------------------------------------------------------------------------------------


class QwenImagePipeline(BasePipeline):
    family = "qwen_image"
    model_names = ("dit", "text_encoder", "vae")
    settings = frozenset({"rand_device", "batch_size", "edit_image_auto_resize", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask", "edit_latents")
    padded_values = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}
    loss_models = ("dit",)
    division_factor = DIVISION_FACTOR

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        from ..schedulers.flow_match import FlowMatchScheduler

        self.scheduler = scheduler or FlowMatchScheduler()
        self.tokenizer = None
        self.processor = None
        self._drops: dict[str, int] = {}
        self.units = [QwenImageShapeChecker(), QwenImageNoiseInitializer(), QwenImageInputImageEmbedder(),
                      QwenImageEditImageEmbedder(), QwenImagePromptEmbedder()]

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, torch_dtype=torch.bfloat16, device="cpu", model_configs: Sequence = (),
                        tokenizer_config=None, processor_config=None, scheduler=None) -> QwenImagePipeline:
        """Load the models named by `model_configs` (any subset of dit, text_encoder, vae)."""
        from ..models import load_component, load_processor, load_tokenizer

        pipe = cls(device=device, torch_dtype=torch_dtype, scheduler=scheduler)
        for config in model_configs:
            loaded = load_component(config, torch_dtype=torch_dtype, device=device)
            if loaded.name not in cls.model_names:
                raise UserError(f"{loaded.files[0]}: a '{loaded.name}' model is not part of Qwen-Image "
                                f"(expected one of {list(cls.model_names)})")
            setattr(pipe, loaded.name, loaded.module)
        if tokenizer_config is not None:
            pipe.tokenizer = load_tokenizer(tokenizer_config)
        if processor_config is not None:
            pipe.processor = load_processor(processor_config)
        return pipe

    def template_drop(self, template: str) -> int:
        if template not in self._drops:
            if self.tokenizer is None:
                raise UserError("no tokenizer: pass --tokenizer_path (or tokenizer_config) to encode prompts")
            self._drops[template] = template_drop_count(self.tokenizer, template)
        return self._drops[template]

    def vl_inputs(self, texts: list[str], images: list[Image.Image]):
        """Tokens and pixel inputs for Qwen2.5-VL with one image per text (what Qwen2VLProcessor does)."""
        if self.processor is None:
            raise UserError("editing needs the image processor: pass --processor_path (the model's processor/ folder)")
        image_processor = self.processor
        vis = image_processor(images=images, return_tensors="pt")
        merge = getattr(image_processor, "merge_size", 2) ** 2
        counts = (vis["image_grid_thw"].prod(-1) // merge).tolist()
        if len(images) == 1 and len(texts) > 1:
            counts = counts * len(texts)
            vis = {"pixel_values": vis["pixel_values"].repeat(len(texts), 1),
                   "image_grid_thw": vis["image_grid_thw"].repeat(len(texts), 1)}
        expanded = [t.replace("<|image_pad|>", "<|image_pad|>" * int(n), 1) for t, n in zip(texts, counts)]
        tokens = self.tokenizer(expanded, padding=True, return_tensors="pt")
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}, dict(vis)

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, edit_latents=None, **settings):
        return model_fn_qwen_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, edit_latents,
                                   **settings)

    def combine_cfg(self, posi, nega, cfg_scale):
        # Qwen-Image's true CFG keeps the norm of the conditional prediction per 2x2 patch token.
        comb = nega + cfg_scale * (posi - nega)
        h, w = posi.shape[-2:]
        p, c = pack_latents(posi), pack_latents(comb)
        scale = p.norm(dim=-1, keepdim=True) / c.norm(dim=-1, keepdim=True)
        return unpack_latents(c * scale, h, w)

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """Pipeline inputs for one data sample, as inference would be called (batch of one)."""
        image = data.get("image")
        if image is not None and not isinstance(image, Image.Image):
            raise UserError(f"row {data.get('_row', '?')}: 'image' must be an image file listed in --data_file_keys")
        values = {
            "prompt": data.get("prompt", ""), "negative_prompt": "", "input_image": image,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "rand_device": data.get("rand_device", "cpu"), "batch_size": 1,
            "edit_image": data.get("edit_image"), "num_inference_steps": data.get("num_inference_steps"),
        }
        if values["prompt"] is None or (isinstance(values["prompt"], float) and math.isnan(values["prompt"])):
            values["prompt"] = ""
        return values

    def training_inputs_batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Pipeline inputs for several samples of the same size, encoded as one batch (stage 1)."""
        per = [self.training_inputs(s) for s in samples]
        if len(per) == 1:
            return per[0]
        values = {}
        for key in per[0]:
            vals = [p[key] for p in per]
            if key in ("height", "width", "rand_device"):
                values[key] = vals[0]
            elif all(v is None for v in vals):
                values[key] = None
            else:
                values[key] = vals
        values["batch_size"] = len(per)
        return values

    @staticmethod
    def batch_signature(sample: dict[str, Any]) -> tuple:
        """Samples with equal signatures can be encoded in one batch."""
        def size(v):
            return v.size if isinstance(v, Image.Image) else tuple(i.size for i in v) if isinstance(v, list) else v

        return (size(sample.get("image")), size(sample.get("edit_image")), sample.get("rand_device", "cpu"))

    def from_cache_values(self, sample: dict[str, Any]) -> dict[str, Any]:
        """Values read back from a stage-1 cache (images come back as PIL)."""
        from .images import images_from_cache

        return {k: images_from_cache(v) for k, v in sample.items() if not k.startswith("_")}

    # -- LoRA -----------------------------------------------------------------------------------------
    def load_lora(self, module, path: str, alpha: float = 1.0) -> None:
        """Fuse a LoRA file (any supported layout) into `module` (e.g. `pipe.dit`) with strength `alpha`."""
        from ..training.lora import fuse_lora, load_lora_file

        imported = load_lora_file(path)
        component = next((n for n, m in self.models.items() if m is module), None)
        fuse_lora(module, imported, scale=alpha, component=component)

    # -- inference ------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "", cfg_scale: float = 4.0,
                 height: int | None = 1328, width: int | None = 1328, num_inference_steps: int = 30,
                 seed: int | None = None, input_image=None, denoising_strength: float = 1.0, edit_image=None,
                 edit_image_auto_resize: bool = True, rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil"):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negatives = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values: dict[str, Any] = {
            "prompt": prompts, "negative_prompt": negatives, "height": height, "width": width, "seed": seed,
            "rand_device": rand_device, "batch_size": len(prompts), "input_image": input_image,
            "edit_image": edit_image, "edit_image_auto_resize": edit_image_auto_resize,
        }
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     image_seq_len=(-(-height // DIVISION_FACTOR)) * (-(-width // DIVISION_FACTOR)))
        self.run_units(values, cfg=cfg_scale != 1.0)
        latents = self.denoise(values, cfg_scale=cfg_scale, progress=progress)
        images = vae_decode(self, latents)
        if output_type == "pt":
            return (images.float() / 2 + 0.5).clamp(0, 1)
        if output_type == "latent":
            return latents
        pil = tensor_to_images(images)
        return pil[0] if isinstance(prompt, str) else pil
