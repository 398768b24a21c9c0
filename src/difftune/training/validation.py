"""Sample images during training (`--validation_prompts`, `--validation_steps`), for any family.

The family's prompt units (those that read `prompt`) encode the prompts; its `noise_shape`, `model_fn` and
`decode` do the rest, with the models `decode_models` names. Split training keeps the prompt encoders out of
stage 2, so stage 1 runs the prompt units on the validation prompts once and stores their outputs beside the
cache (`<cache>/validation/`), together with where the decoder's weights are; stage 2 loads the decoder only
when it renders and frees it afterwards. Images go to `<output_path>/validation/` and to TensorBoard. A video
family renders clips (`decode` gives (B, 3, F, H, W); `noise_shape` takes `num_frames`): an animated preview
(`step-<n>.gif`, the prompts side by side) and a frame grid (`step-<n>.png`, one row per prompt) that also goes
to TensorBoard.
Rendering uses its own seeded generator and no_grad, so it does not change training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..core.batch import collate_values, split_batch
from ..core.units import run_unit
from ..io import atomic_save_image, atomic_save_safetensors, atomic_write_text
from ..media.image import tensor_to_images
from ..media.video import DEFAULT_FPS, frame_grid, tensor_to_clips, write_animation

VALIDATION_DIR = "validation"
NEGATIVE = "negative"


def parse_prompts(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split("|") if p.strip()]


def prompt_units(pipe) -> list:
    return [u for u in pipe.units if "prompt" in u.cfg_inputs]


def can_encode(pipe) -> bool:
    units = prompt_units(pipe)
    return bool(units) and all(pipe.models.get(m) is not None for u in units for m in u.models)


def encode_prompts(pipe, prompts: list[str]) -> dict[str, torch.Tensor]:
    """`<p{i}|negative>.<name>` -> the prompt units' outputs (no batch dimension, padding trimmed) for each
    prompt and for the empty negative prompt."""
    units = prompt_units(pipe)
    outputs = [pair[0] for u in units for pair in u.cfg_outputs.values()]
    out = {}
    for i, prompt in enumerate(prompts + [""]):
        values = {"prompt": [prompt]}
        with torch.no_grad():
            for unit in units:
                run_unit(pipe, unit, values)
        key = NEGATIVE if i == len(prompts) else f"p{i}"
        for name, value in split_batch(values, 1, pipe.batching, outputs)[0].items():
            if isinstance(value, torch.Tensor):
                out[f"{key}.{name}"] = value.float().cpu().contiguous() if value.is_floating_point() else value.cpu()
    return out


def write_cached_prompts(cache_dir: str, pipe, prompts_text: str, models) -> None:
    """Stage 1: store the validation prompts' encodings and where the decoder's weights are, beside the cache."""
    if not can_encode(pipe):
        return
    prompts = parse_prompts(prompts_text)
    decoders = {}
    for slot, config in models:
        if slot in pipe.decode_models:
            files = config.resolve()
            decoders[slot] = files if isinstance(files, list) else [files]
    folder = Path(cache_dir) / VALIDATION_DIR
    atomic_save_safetensors(encode_prompts(pipe, prompts), folder / "embeds.safetensors")
    atomic_write_text(folder / "prompts.json", json.dumps({"prompts": prompts, "decoders": decoders}, indent=1))


class Validator:
    def __init__(self, args, models, family, cache_dir: str | None = None):
        self.prompts = parse_prompts(args.validation_prompts)
        size = args.validation_size or args.height or 1024
        self.height = self.width = size
        if args.validation_size is None and args.height and args.width:
            self.height, self.width = args.height, args.width
        self.steps = args.validation_inference_steps
        self.out_dir = Path(args.output_path) / VALIDATION_DIR
        self.models = models
        self.family = family
        # the family's sampling guidance (FLUX.1-dev is guidance-distilled: 1, no negative pass)
        self.cfg_scale = float(dict(getattr(family, "sample_defaults", None) or {}).get("cfg_scale", 4.0))
        self.cache_dir = cache_dir
        self.embeds = None
        self.seed = args.seed
        self.warned = False
        self.num_frames = None  # video families: frames per validation clip
        if getattr(family, "data", "image") == "video":
            from .builders import frame_settings

            settings = frame_settings(args, family)  # checks --validation_num_frames too
            self.num_frames = getattr(args, "validation_num_frames", None) or settings["num_frames"]
            noise_shape = getattr(getattr(family, "pipeline", None), "noise_shape", None)
            if noise_shape is not None and not _takes_frames(noise_shape):
                if getattr(args, "validation_num_frames", None) is not None:
                    from ..errors import UserError

                    raise UserError(f"--validation_num_frames: not used: the {family.name} family's validation "
                                    f"renders stills (its noise_shape takes no num_frames)")
                self.num_frames = None

    def _cached(self, name: str):
        path = Path(self.cache_dir) / VALIDATION_DIR / name if self.cache_dir else None
        return path if path is not None and path.exists() else None

    def _embeddings(self, pipe):
        if can_encode(pipe):
            return encode_prompts(pipe, self.prompts)
        meta, path = self._cached("prompts.json"), self._cached("embeds.safetensors")
        if self.embeds is None and meta and path and json.loads(meta.read_text())["prompts"] == self.prompts:
            self.embeds = load_file(str(path))
        return self.embeds

    def _decoders(self, pipe) -> dict | None:
        """The decode models that are not loaded, loaded for this render (None if one cannot be found)."""
        from ..models import ModelConfig, load_component

        missing = [s for s in pipe.decode_models if pipe.models.get(s) is None]
        meta = self._cached("prompts.json")
        recorded = json.loads(meta.read_text()).get("decoders", {}) if meta else {}
        loaded = {}
        for slot in missing:
            config = next((c for s, c in self.models if s == slot), None)
            if config is None and recorded.get(slot):
                files = recorded[slot]
                config = ModelConfig(files if len(files) > 1 else files[0])
            if config is None:
                return None
            loaded[slot] = load_component(config, self.family.components, torch_dtype=pipe.torch_dtype,
                                          device=pipe.device).module
        return loaded

    @torch.no_grad()
    def __call__(self, accelerator, module, step: int) -> None:
        if accelerator.is_main_process:
            self.render(module.pipe, step, accelerator)
        accelerator.wait_for_everyone()

    def _values(self, pipe, embeds, key: str) -> dict:
        """The prompt values of one prompt (and the negative prompt) with their batch dimension back."""
        values = {}
        for unit in prompt_units(pipe):
            for posi, nega in unit.cfg_outputs.values():
                for side, name, prefix in ((0, posi, key), (1, nega, NEGATIVE)):
                    stored = embeds.get(f"{prefix}.{posi}")
                    if stored is not None:
                        values[name] = stored
        values = collate_values([values], pipe.batching)
        return {k: v.to(pipe.device, pipe.torch_dtype if v.is_floating_point() else v.dtype) for k, v in values.items()}

    def _noise_shape(self, pipe) -> tuple[int, ...]:
        if self.num_frames is not None and _takes_frames(pipe.noise_shape):
            return pipe.noise_shape(self.height, self.width, num_frames=self.num_frames)
        return pipe.noise_shape(self.height, self.width)

    def render(self, pipe, step: int, accelerator=None):
        embeds = self._embeddings(pipe)
        temporary = self._decoders(pipe) if embeds is not None else None
        if embeds is None or temporary is None:
            if not self.warned:
                print("note: validation images need the prompt encodings (from the prompt encoder or the stage-1 "
                      f"cache) and the decoder ({', '.join(pipe.decode_models)}); skipping them")
                self.warned = True
            return None
        denoiser = pipe.models[pipe.loss_models[0]]
        was_training = denoiser.training
        denoiser.eval()
        images = []
        saved_sched = (pipe.scheduler.sigmas, pipe.scheduler.timesteps)
        pipe.models.update(temporary)
        try:
            for i, _ in enumerate(self.prompts):
                g = torch.Generator("cpu").manual_seed(self.seed + i)
                latents = torch.randn(1, *self._noise_shape(pipe), generator=g)
                latents = latents.to(pipe.device, pipe.torch_dtype)
                pipe.scheduler.set_timesteps(self.steps, image_seq_len=pipe.seq_len(latents))
                values = {"latents": latents, **self._values(pipe, embeds, f"p{i}")}
                latents = pipe.denoise(values, cfg_scale=self.cfg_scale, progress=False)
                decoded = pipe.decode(latents)
                images.extend(tensor_to_clips(decoded) if decoded.dim() == 5 else tensor_to_images(decoded))
        finally:
            pipe.scheduler.sigmas, pipe.scheduler.timesteps = saved_sched
            denoiser.train(was_training)
            for slot in temporary:
                pipe.models[slot] = None
        if all(isinstance(i, list) for i in images):  # clips
            frames = min(len(c) for c in images)
            write_animation([make_grid([c[t] for c in images]) for t in range(frames)],
                            self.out_dir / f"step-{step:06d}.gif", fps=DEFAULT_FPS)
            grid = make_grid([frame_grid(c, columns=min(len(c), 8), max_frames=8) for c in images], columns=1)
        else:
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


def _takes_frames(noise_shape) -> bool:
    import inspect

    return "num_frames" in inspect.signature(noise_shape).parameters


def make_grid(images, columns: int | None = None):
    from PIL import Image

    columns = columns or len(images)
    rows = -(-len(images) // columns)
    w, h = images[0].size
    grid = Image.new("RGB", (columns * w, rows * h), "white")
    for i, img in enumerate(images):
        grid.paste(img, ((i % columns) * w, (i // columns) * h))
    return grid
