"""Sample images (clips, layer stacks) during training (`--validation_prompts`, `--validation_steps`), for any
family and variant, through the pipeline's own sampling template (`BasePipeline.generate`).

The prompts are encoded by the run's prompt units; split training keeps the prompt encoders out of stage 2, so
stage 1 encodes the validation prompts once and stores them beside the cache (`<cache>/validation/`), with where
the decoder's weights are; stage 2 loads the decoder only when it renders and frees it afterwards.

A run whose features condition the denoiser on more than the prompt (an edit image, a control image, the first
frame of an image-to-video run, the image a layer stack is taken from, ...) renders prompt i with the conditioning
of training sample i (of the data set, or of the cache in stage 2), at that sample's size: the values its units
computed are handed to the sampling template as given. Other runs render at --validation_size.

Images go to `<output_path>/validation/step-<n>.png` and TensorBoard; clips also to `step-<n>.gif` (the prompts
side by side). Rendering uses its own seeded generator and no_grad, so it does not change training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..core.batch import collate_values, split_batch
from ..core.units import run_unit
from ..core.target import takes_frames
from ..io import atomic_save_safetensors, atomic_write_text

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


def conditioning_names(pipe) -> list[str]:
    """What the denoiser reads besides the prompt and what sampling computes itself: the values validation takes
    from a training sample (none for a plain text-to-image run)."""
    prompt = set(pipe.prompt_outputs())
    prompt |= {pipe.negative_name(n) for n in prompt}
    return [n for n in pipe.active_model_fn_inputs if n not in prompt and n not in pipe.sampling_values]


class Validator:
    def __init__(self, run, cache_dir: str | None = None, dataset=None):
        from .setup import stage_settings

        config, family = run.config, run.family
        self.prompts = parse_prompts(config.validation_prompts)
        size = config.validation_size or config.height or 1024
        self.height = self.width = size
        if config.validation_size is None and config.height and config.width:
            self.height, self.width = config.height, config.width
        self.steps = config.validation_inference_steps
        self.out_dir = Path(config.output_path) / VALIDATION_DIR
        self.models = run.models
        self.family = family
        self.cfg_scale = float(run.pipeline.call_defaults.get("cfg_scale", 1.0))  # the family's sampling guidance
        self.settings = {k: v for k, v in stage_settings(config, family).items()
                         if k in run.pipeline.model_fn_settings and not k.startswith("use_gradient_checkpointing")}
        self.cache_dir = cache_dir
        self.dataset = dataset  # the training samples whose conditioning a conditioned render takes
        self.embeds = None
        self.seed = config.seed
        self.warned = set()
        self.verbose = True  # the notes (only the main process prints them when every process renders)
        self.num_frames = None  # video families: frames per validation clip
        if config.frames is not None:
            self.num_frames = config.validation_num_frames or config.frames.num_frames
            if not takes_frames(run.pipeline.target.primary):
                if config.validation_num_frames is not None:
                    from ..errors import UserError

                    raise UserError(f"--validation_num_frames: not used: the {family.name} family's validation "
                                    f"renders stills (its noise_shape takes no num_frames)")
                self.num_frames = None

    def _note(self, key: str, text: str) -> None:
        if key not in self.warned:
            if self.verbose:
                print(f"note: {text}")
            self.warned.add(key)

    def _cached(self, name: str):
        path = Path(self.cache_dir) / VALIDATION_DIR / name if self.cache_dir else None
        return path if path is not None and path.exists() else None

    def _embeddings(self, pipe):
        if not prompt_units(pipe):  # a variant whose prompt values come from its conditioning (a training sample's)
            return {}
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
        from .engines import shards_weights, whole_weights

        if shards_weights(accelerator):  # the denoiser's forward is collective: every process renders, one writes
            self.verbose = accelerator.is_main_process
            with whole_weights(module):
                self.render(module.pipe, step, accelerator, module, write=accelerator.is_main_process)
        elif accelerator.is_main_process:
            self.render(module.pipe, step, accelerator, module)
        accelerator.wait_for_everyone()

    def _prompt_values(self, pipe, embeds, key: str) -> dict:
        """The prompt values of one prompt (and the negative prompt) with their batch dimension back."""
        values = {}
        for unit in prompt_units(pipe):
            for posi, nega in unit.cfg_outputs.values():
                for name, prefix in ((posi, key), (nega, NEGATIVE)):
                    stored = embeds.get(f"{prefix}.{posi}")
                    if stored is not None:
                        values[name] = stored
        values = collate_values([values], pipe.batching)
        return {k: v.to(pipe.device, pipe.torch_dtype if v.is_floating_point() else v.dtype) for k, v in values.items()}

    def _conditioning(self, pipe, module, i: int) -> dict | None:
        """Training sample i's conditioning values (batch of one) and its clean latents, or None when the run needs
        none; the negative side of a guided value is left empty, as sampling without its negative input does."""
        names = conditioning_names(pipe)
        if not names:
            return None
        if self.dataset is None or module is None or not len(self.dataset):
            return {}
        sample, n = None, len(self.dataset)
        for j in range(n):  # a bad sample the data set skips is None: the next one
            sample = self.dataset[(i + j) % n]
            if sample is not None:
                break
        prepared = module.prepare_sample(sample, names=(*names, *(s.input_latents for s in pipe.target.streams)))
        values = collate_values([prepared], pipe.batching)
        out = {k: (v.to(pipe.device) if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
        for name in names:
            negative = pipe.negative_name(name)
            if negative != name:
                out[negative] = None
        return out

    def render(self, pipe, step: int, accelerator=None, module=None, write: bool = True):
        embeds = self._embeddings(pipe)
        temporary = self._decoders(pipe) if embeds is not None else None
        if embeds is None or temporary is None:
            self._note("embeds", "validation images need the prompt encodings (from the prompt encoder or the "
                       f"stage-1 cache) and the decoder ({', '.join(pipe.decode_models)}); skipping them")
            return None
        denoiser = pipe.models[pipe.loss_models[0]]
        was_training = denoiser.training
        denoiser.eval()
        outputs = []
        saved_sched = (pipe.scheduler.sigmas, pipe.scheduler.timesteps)
        pipe.models.update(temporary)
        try:
            for i, _ in enumerate(self.prompts):
                condition = self._conditioning(pipe, module, i)
                if condition == {}:
                    self._note("condition", "validation images need a training sample's conditioning (this run's "
                               "features condition the denoiser on more than the prompt); skipping them")
                    return None
                values = {**self._prompt_values(pipe, embeds, f"p{i}"), **(condition or {})}
                g = torch.Generator("cpu").manual_seed(self.seed + i)
                size = {} if condition else {"height": self.height, "width": self.width, **(
                    {"num_frames": self.num_frames} if self.num_frames is not None else {})}
                for stream in pipe.target.streams:  # each stream's noise, in stream order from one generator
                    clean = values.pop(stream.input_latents, None) if condition else None
                    if clean is not None:  # at the sample's own size: its conditioning is laid out for it
                        noise = torch.randn(clean.shape, generator=g)
                        if stream is pipe.stream:
                            values.update(stream.size_of(pipe, clean))
                    elif condition:  # a stream the sample has no data of (a clip without sound): at its size
                        noise = torch.randn(1, *stream.noise_shape(pipe, **_size_arguments(stream, values)),
                                            generator=g)
                    else:
                        noise = torch.randn(1, *stream.noise_shape(pipe, **size), generator=g)
                    values[stream.latents] = noise.to(pipe.device, pipe.torch_dtype)
                if condition:
                    self._note("size", "validation renders each prompt with the conditioning of the training "
                               "sample of its index, at that sample's size")
                values.update(size, noise=values["latents"], seed=self.seed + i, batch_size=1)
                given = [k for k in values if k not in ("height", "width", "num_frames", "seed", "batch_size")]
                out = pipe.generate(values, cfg_scale=self.cfg_scale, num_inference_steps=self.steps,
                                    settings=self.settings, given=given, progress=False, output_type="pil")
                outputs.append(out[0])
        finally:
            pipe.scheduler.sigmas, pipe.scheduler.timesteps = saved_sched
            denoiser.train(was_training)
            for slot in temporary:
                pipe.models[slot] = None
        return self._write(pipe, outputs, step, accelerator) if write else None

    def _write(self, pipe, outputs, step: int, accelerator):
        """The target's preview of the outputs (a grid of images, a row of frames per clip and an animation, ...)."""
        grid, animation = pipe.target.preview(outputs, self.out_dir / f"step-{step:06d}.png")
        if accelerator is not None:
            from .trackers import log_media

            log_media(accelerator, grid, step, animation)
        return self.out_dir / f"step-{step:06d}.png"


def _size_arguments(stream, values) -> dict:
    """The values a stream's `noise_shape` takes by name (the size the primary stream's latents gave)."""
    import inspect

    params = inspect.signature(stream.noise_shape).parameters
    names = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"pipe", "self"}
    return {k: values[k] for k in names if values.get(k) is not None}
