"""Sample images during training (`--validation_prompts`, `--validation_steps`).

Split training keeps the text encoder out of stage 2, so stage 1 encodes the validation prompts once and
stores them beside the cache (`<cache>/validation/`), together with where the VAE's weights are; stage 2
loads the VAE only when it renders and frees it afterwards. Images go to `<output_path>/validation/` and to
TensorBoard. Rendering uses its own seeded generator and no_grad, so it does not change training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..io import atomic_save_image, atomic_save_safetensors, atomic_write_text

from ..pipelines.base import run_unit
from ..pipelines.images import tensor_to_images

VALIDATION_DIR = "validation"


def parse_prompts(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split("|") if p.strip()]


def encode_prompts(pipe, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Prompt embeddings (trimmed to true length) for each prompt and for the empty negative prompt."""
    unit = next(u for u in pipe.units if "text_encoder" in u.models and "prompt" in u.cfg_inputs)
    out = {}
    for i, prompt in enumerate(prompts + [""]):
        values = {"prompt": [prompt], "edit_image": None}
        with torch.no_grad():
            run_unit(pipe, unit, values)
        n = int(values["prompt_embeds_mask"][0].sum())
        key = "negative" if i == len(prompts) else f"p{i}"
        out[f"{key}.prompt_embeds"] = values["prompt_embeds"][0, :n].float().cpu().contiguous()
    return out


def write_cached_prompts(cache_dir: str, pipe, prompts: list[str], vae_files: list[str]) -> None:
    """Stage 1: store the validation prompts' embeddings and the VAE's location next to the cache."""
    folder = Path(cache_dir) / VALIDATION_DIR
    atomic_save_safetensors(encode_prompts(pipe, prompts), folder / "embeds.safetensors")
    atomic_write_text(folder / "prompts.json", json.dumps({"prompts": prompts, "vae_files": vae_files}, indent=1))


class Validator:
    def __init__(self, args, pipe, components, cache_dir: str | None = None):
        self.prompts = parse_prompts(args.validation_prompts)
        size = args.validation_size or args.height or 1024
        self.height = self.width = size
        if args.validation_size is None and args.height and args.width:
            self.height, self.width = args.height, args.width
        self.steps = args.validation_inference_steps
        self.out_dir = Path(args.output_path) / VALIDATION_DIR
        self.components = components
        self.cache_dir = cache_dir
        self.embeds = None
        self.seed = args.seed
        self.warned = False

    def _embeddings(self, pipe):
        if pipe.models.get("text_encoder") is not None and pipe.tokenizer is not None:
            return encode_prompts(pipe, self.prompts)
        if self.embeds is None and self.cache_dir:
            path = Path(self.cache_dir) / VALIDATION_DIR / "embeds.safetensors"
            meta_path = Path(self.cache_dir) / VALIDATION_DIR / "prompts.json"
            if path.exists() and json.loads(meta_path.read_text())["prompts"] == self.prompts:
                self.embeds = load_file(str(path))
        return self.embeds

    def _vae(self, pipe):
        if pipe.models.get("vae") is not None:
            return pipe.vae, False
        from ..models import ModelConfig, load_component

        files = [c for name, c in self.components if name == "vae"]
        config = files[0] if files else None
        if config is None and self.cache_dir:
            meta_path = Path(self.cache_dir) / VALIDATION_DIR / "prompts.json"
            if meta_path.exists():
                vae_files = json.loads(meta_path.read_text()).get("vae_files") or []
                config = ModelConfig(vae_files if len(vae_files) > 1 else vae_files[0]) if vae_files else None
        if config is None:
            return None, False
        return load_component(config, torch_dtype=pipe.torch_dtype, device=pipe.device).module, True

    @torch.no_grad()
    def __call__(self, accelerator, module, step: int) -> None:
        if accelerator.is_main_process:
            self.render(module.pipe, step, accelerator)
        accelerator.wait_for_everyone()

    def render(self, pipe, step: int, accelerator=None):
        from ..pipelines.qwen_image import vae_decode

        embeds = self._embeddings(pipe)
        vae, temporary = self._vae(pipe)
        if embeds is None or vae is None:
            if not self.warned:
                print("note: validation images need the prompt embeddings (from the text encoder or the stage-1 "
                      "cache) and the VAE; skipping them")
                self.warned = True
            return None
        dit = pipe.dit
        was_training = dit.training
        dit.eval()
        images = []
        h, w = self.height // 8, self.width // 8
        saved_sched = (pipe.scheduler.sigmas, pipe.scheduler.timesteps)
        try:
            pipe.scheduler.set_timesteps(self.steps, image_seq_len=(h // 2) * (w // 2))
            for i, _ in enumerate(self.prompts):
                g = torch.Generator("cpu").manual_seed(self.seed + i)
                latents = torch.randn(1, 16, h, w, generator=g).to(pipe.device, pipe.torch_dtype)
                emb = embeds[f"p{i}.prompt_embeds"][None].to(pipe.device, pipe.torch_dtype)
                neg = embeds["negative.prompt_embeds"][None].to(pipe.device, pipe.torch_dtype)
                values = {"latents": latents, "prompt_embeds": emb,
                          "prompt_embeds_mask": torch.ones(emb.shape[:2], dtype=torch.long, device=pipe.device),
                          "negative_prompt_embeds": neg,
                          "negative_prompt_embeds_mask": torch.ones(neg.shape[:2], dtype=torch.long, device=pipe.device)}
                latents = pipe.denoise(values, cfg_scale=4.0, progress=False)
                decoded = vae_decode(_VaeHolder(pipe, vae), latents)
                images.extend(tensor_to_images(decoded))
        finally:
            pipe.scheduler.sigmas, pipe.scheduler.timesteps = saved_sched
            dit.train(was_training)
            if temporary:
                del vae
        grid = make_grid(images)
        path = atomic_save_image(grid, self.out_dir / f"step-{step:06d}.png")
        if accelerator is not None:
            try:
                import numpy as np

                tracker = accelerator.get_tracker("tensorboard", unwrap=True)
                tracker.add_image("validation", np.asarray(grid), step, dataformats="HWC")
            except Exception:  # no TensorBoard tracker configured
                pass
        return path


class _VaeHolder:
    """Lets vae_decode use a VAE that is not (or not permanently) part of the pipeline."""

    def __init__(self, pipe, vae):
        self.vae, self.device, self.torch_dtype = vae, pipe.device, pipe.torch_dtype


def make_grid(images, columns: int | None = None):
    from PIL import Image

    columns = columns or len(images)
    rows = -(-len(images) // columns)
    w, h = images[0].size
    grid = Image.new("RGB", (columns * w, rows * h), "white")
    for i, img in enumerate(images):
        grid.paste(img, ((i % columns) * w, (i // columns) * h))
    return grid
