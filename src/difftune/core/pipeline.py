"""The base pipeline every family subclasses: model slots by name, device and dtype, freezing, the units and the
features they serve, and the one sampling template.

Sampling is written once (`generate`): set the timesteps, run the units, denoise (`model_fn` over the scheduler's
steps with classifier-free guidance), finish and decode. A family fills in hooks (`set_timesteps`, `model_fn`,
`combine_cfg`, `finish_latents`, `postprocess`) and maps its `__call__` arguments to values; validation during
training and `direct_distill` call the same pieces (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import UserError, row_label
from ..media.image import as_image_list
from .batch import SAME
from .features import ALIGNED_AUDIO, ALIGNED_FRAMES, BASE, FRAMES, IMAGE, IMAGES, VALUE, Feature, RunContext, \
    compose_units, given_inputs, model_config, resolve_features
from .target import IMAGE_TARGET, Target
from .units import PipelineUnit, run_unit


class BasePipeline:
    """Models by name, device and dtype, the units and features, `freeze_except`, and the sampling template.

    Families subclass it and set `model_names`, the units (`self.units = [...]` in `__init__`), `features`,
    `model_fn` and `model_fn_inputs`; a variant that changes the algorithm subclasses the family's pipeline and
    says which runs are its own (`claims`).
    """

    model_names: tuple[str, ...] = ()
    # Names that are run-time settings, not data: supplied by each stage's own arguments, never cached.
    settings: frozenset[str] = frozenset()
    # Names `model_fn` reads from the values besides `latents` and `timestep` in every run; features add theirs.
    model_fn_inputs: tuple[str, ...] = ()
    # The parts only some runs use (core/features.py).
    features: tuple[Feature, ...] = ()
    # The data columns `training_inputs` reads in every run; features add theirs. A column a flag names
    # (--extra_inputs, --data_file_keys) that no part reads is refused rather than dropped.
    data_inputs: tuple[str, ...] = ()
    # How values that come with the data batch (units declare theirs in `PipelineUnit.batching`).
    input_batching: Mapping[str, Any] = {}
    # Run-time settings the loss hands on to `model_fn` (a family adds its own, e.g. Qwen's zero_cond_t).
    model_fn_settings: tuple[str, ...] = ("use_gradient_checkpointing", "use_gradient_checkpointing_offload")
    # Models `model_fn` uses (the denoiser first): stage 2 always loads them.
    loss_models: tuple[str, ...] = ()
    # slot -> {the reference's module name: ours} for a variant class whose model names its modules unlike the
    # family's (None: the family's `lora_target_aliases`).
    lora_target_aliases: Mapping[str, Mapping[str, str]] | None = None
    # ... and which of those are one layer in the reference's model (None: the family's `lora_fused_aliases`)
    lora_fused_aliases: Mapping[str, tuple[str, ...]] | None = None
    # The layout `--lora_format default` writes for the denoiser's LoRA where a variant's model differs from the family's
    # (None: the family's `lora_default_format`).
    lora_default_format: str | None = None
    # The scheduler's config (a scheduler_config.json's values; diffusers' defaults for what it leaves out) and, for a
    # config with dynamic shifting, the fixed time shift training uses (the reference's).
    scheduler_config: Mapping[str, Any] = {}
    training_mu: float | None = None
    # The smallest sigma of the training table where the reference keeps one (FLUX.1: 0.003/1.002); None: down to 0.
    training_sigma_min: float | None = None
    # The unit classes of every run, in order (a pipeline may instead set `self.units` in `__init__`).
    base_units: tuple[type, ...] = ()
    # Values every training row gets that sampling takes as parameters (e.g. the embedded guidance it trains at).
    training_values: Mapping[str, Any] = {}
    # A sampling call's own parameters besides the shared ones and the features' inputs -> their defaults (e.g. a
    # fixed time shift `mu`): `__call__` hands them on as values, those named in `model_fn_settings` (e.g. Qwen's
    # zero_cond_t) as settings of the denoiser call.
    call_parameters: Mapping[str, Any] = {}
    # What the family generates (core/target.py): its streams, their latent layout, decoding and outputs, and the
    # prediction type. Shared code reads the layout there, never here.
    target: Target = IMAGE_TARGET
    # Every sampling default of the family, in one place: height, width, num_inference_steps, cfg_scale and the
    # family's own (FLUX's embedded_guidance, a video family's num_frames, ...). `__call__`, `difftune sample` and
    # validation read them here.
    call_defaults: Mapping[str, Any] = {}
    # Values sampling computes from its own settings, never taken from a training sample (FLUX's embedded guidance).
    sampling_values: tuple[str, ...] = ()
    # The family's spec (set when its FamilySpec is made): how shared code finds the family of a pipeline.
    spec = None
    # model_fn inputs that are padding masks (True = a real token): training passes None for one that masks nothing,
    # so attention runs without a mask (the flash kernels take none).
    padding_masks: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        """A pipeline class gets the model slots and denoiser-call models of the features it lists."""
        super().__init_subclass__(**kwargs)
        cls.model_names = tuple(dict.fromkeys([*cls.model_names, *(s for f in cls.features for s in f.slots)]))
        cls.loss_models = tuple(dict.fromkeys([*cls.loss_models, *(s for f in cls.features for s in f.loss_models)]))
        cls.settings = frozenset({*cls.settings, *(s for f in cls.features for s in f.unit_settings)})

    def __init__(self, device: str | torch.device = "cpu", torch_dtype: torch.dtype = torch.float32, scheduler=None):
        self.device = torch.device(device)
        self.torch_dtype = torch_dtype
        self.models: dict[str, torch.nn.Module | None] = {name: None for name in self.model_names}
        self.all_units: list[PipelineUnit] = []
        self.active_features: frozenset[str] | None = None  # None: not resolved (each call resolves its own)
        self.scheduler = scheduler if scheduler is not None else self.default_scheduler()
        for tokenizer in (self.spec.tokenizers if self.spec is not None else ()):
            setattr(self, tokenizer.attr, None)  # found beside the weights or named by a flag (core/build.py)
        for feature in self.features:
            for name, default in feature.attributes.items():
                setattr(self, name, default)
        if self.base_units:
            self.units = [unit() for unit in self.base_units]

    @classmethod
    def default_scheduler(cls):
        """The sampling and training scheduler of the family's prediction type, from `scheduler_config`."""
        from ..schedulers import scheduler_for

        return scheduler_for(cls.target.prediction, cls.scheduler_config, cls.training_mu, cls.training_sigma_min)

    @property
    def family(self) -> str:
        return self.spec.name if self.spec is not None else ""

    # -- variants and features ------------------------------------------------------------------------
    @classmethod
    def claims(cls, context: RunContext) -> bool:
        """Whether a run with this context is this variant's (a variant pipeline class overrides it)."""
        return False

    @classmethod
    def check_run(cls, context: RunContext, features: frozenset[str]) -> None:
        """Refuse, before any work, a run whose models and data do not go together (a family overrides it for its
        base models; each feature checks its own part in `check_features`)."""

    @classmethod
    def check_models(cls, models: Mapping[str, Any]) -> None:
        """Refuse, before any model is loaded, recognised models that do not fit each other (slot -> its
        DetectedComponent: the spec, the config and the files): a text encoder of another width, depth or release
        than the denoiser reads (a family overrides it; each refusal is one line naming the part that does not
        fit). Training, `difftune sample` and from_pretrained all ask."""

    @classmethod
    def check_features(cls, context: RunContext, features: frozenset[str]) -> None:
        """The active features' checks: a model a feature needs and was not given (once the denoiser is known), then
        each feature's own `check`. Each refusal is one line."""
        active = [f for f in cls.features if f.name in features]
        denoiser = cls.loss_models[0] if cls.loss_models else None
        if denoiser is not None and context.config(denoiser) is not None:
            for feature in active:
                for slot, what in feature.needs.items():
                    if context.config(slot) is None:
                        given = " / ".join(c for c in feature.columns if c in context.columns) or \
                            " / ".join(feature.columns) or feature.name
                        raise UserError(f"{given}: given, but no {slot} model is loaded: name {what} in "
                                        f"--model_paths / --model_id_with_origin_paths")
        for feature in active:
            feature.check(context, features)

    @classmethod
    def data_operators(cls, config) -> dict:
        """Data operators of particular columns (column -> DataOperator), e.g. Qwen-Image-Layered's RGBA layers;
        every other file column is loaded by the default operator. Features add theirs."""
        operators = {}
        for feature in cls.features:
            operators.update(feature.operators(config))
        return operators

    @classmethod
    def required_columns(cls, features, columns) -> tuple[str, ...]:
        """The value columns that switch an active feature on (e.g. speed control's motion_bucket_id) among the
        run's `columns`: every row must give one, or the feature would be off for that row without a word."""
        kinds = cls.input_kinds()
        return tuple(c for f in cls.features if f.name in features for c in f.columns
                     if c in columns and kinds.get(c) == VALUE)

    @classmethod
    def file_columns(cls) -> tuple[str, ...]:
        """The features' columns whose values are files (images, clips, audio timed with the clip)."""
        return tuple(name for name, kind in cls.input_kinds().items()
                     if kind in (FRAMES, ALIGNED_FRAMES, ALIGNED_AUDIO, IMAGE, IMAGES))

    @classmethod
    def input_kinds(cls) -> dict[str, str]:
        """Every feature's data column -> its kind (core/features.py: clip, aligned clip, image, images, value, raw)."""
        return {k: v for feature in cls.features for k, v in feature.inputs.items()}

    @classmethod
    def aligned_columns(cls) -> dict[str, float | None]:
        """The features' time-aligned columns -> None (a clip: as many frames as the training clip, at least) or
        the frame rate its audio is timed at: the data set's row check holds each to the row's clip
        (`clip_columns`), before any model loads."""
        return {name: (feature.fps if kind == ALIGNED_AUDIO else None) for feature in cls.features
                for name, kind in feature.inputs.items() if kind in (ALIGNED_FRAMES, ALIGNED_AUDIO)}

    def feature_data(self, data: Mapping[str, Any], num_frames: int | None = None) -> dict[str, Any]:
        """The features' columns a row has, as pipeline inputs by kind (one-line errors naming the row and column):
        clips as lists of frames (an aligned clip must have `num_frames`), images as one image, values as they come
        (an empty CSV cell left out), raw columns untouched; a column of several images as a list of them."""
        from PIL import Image

        row = row_label(data)
        out = {}
        for name, kind in self.input_kinds().items():
            value = data.get(name)
            if value is None:
                continue
            if kind in (FRAMES, ALIGNED_FRAMES):
                frames = as_image_list(value)
                if not frames or not all(isinstance(f, Image.Image) for f in frames):
                    raise UserError(f"{row}: '{name}' must be a clip or an image file (listed in --data_file_keys)")
                if kind == ALIGNED_FRAMES and num_frames is not None:
                    if len(frames) < num_frames:  # the data set's row check refuses it first, naming the file
                        raise UserError(f"{row}: '{name}' has {len(frames)} frames, the clip {num_frames}: give a "
                                        f"clip as long as the video (cut to --num_frames)")
                    frames = frames[:num_frames]  # a longer one is cut to the clip, as the clip was
                out[name] = frames
            elif kind == IMAGE:
                frames = as_image_list(value)
                if not frames or not isinstance(frames[0], Image.Image):
                    raise UserError(f"{row}: '{name}' must be an image file (listed in --data_file_keys)")
                out[name] = frames[0]
            elif kind == IMAGES:
                images = as_image_list(value)
                if not images or not all(isinstance(i, Image.Image) for i in images):
                    raise UserError(f"{row}: '{name}' must be image file(s) listed in --data_file_keys (e.g. "
                                    f"--data_file_keys image,{name}), got {value!r:.60}")
                out[name] = images
            elif kind == VALUE:
                if not (isinstance(value, float) and value != value):
                    out[name] = value
            else:
                out[name] = value
        return out

    # -- sampling inputs of the features --------------------------------------------------------------
    @classmethod
    def call_inputs(cls) -> dict[str, Any]:
        """Every feature's sampling input -> its default (the reference's names)."""
        return {k: v for feature in cls.features for k, v in feature.call_inputs.items()}

    @classmethod
    def call_settings(cls) -> dict[str, Any]:
        """Every feature's run-time setting of the denoiser call -> its default."""
        return {k: v for feature in cls.features for k, v in feature.call_settings.items()}

    # `difftune sample` flags of the pipeline's own call parameters: name -> `core.options.sample_input(...)`
    sample_flags: Mapping[str, Mapping[str, Any]] = {}

    @classmethod
    def all_sample_flags(cls) -> dict[str, Mapping[str, Any]]:
        """Its own and its features' `difftune sample` flags."""
        flags = dict(cls.sample_flags)
        for feature in cls.features:
            for name, spec in feature.flags.items():
                flags.setdefault(name, spec)
        return flags

    @classmethod
    def sample_values(cls, flags: Mapping[str, Any]) -> dict[str, Any]:
        """`difftune sample`'s flags (image flags loaded) -> the call's inputs: its own flags given, under their
        names, and each feature's (`Feature.sample_values`)."""
        values = given_inputs(cls.sample_flags, flags)
        for feature in cls.features:
            values.update(feature.sample_values(flags))
        return values

    def take_call_inputs(self, inputs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """A call's feature inputs -> (values given, settings): an unknown name is a TypeError naming the known
        ones; the active features' negatives are added to the values."""
        known, settings = self.call_inputs(), self.call_settings()
        unknown = sorted(set(inputs) - set(known) - set(settings))
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected input(s) {unknown}; its features take "
                            f"{', '.join(sorted({*known, *settings})) or 'none'}")
        values = {k: v for k, v in inputs.items() if k in known and v is not None}
        settings = {k: (inputs[k] if inputs.get(k) is not None else v) for k, v in settings.items()}
        for feature in self.features:
            if any(values.get(c) is not None for c in feature.call_inputs):
                values.update(feature.negatives(values))
        return values, settings

    @classmethod
    def paired_columns(cls) -> tuple[tuple[str, str], ...]:
        """Data columns whose lists must be as long as each other's (every feature's `same_length`)."""
        return tuple(pair for f in cls.features for pair in f.same_length)

    @classmethod
    def feature_names(cls) -> tuple[str, ...]:
        return (BASE, *(f.name for f in cls.features))

    @classmethod
    def all_data_inputs(cls) -> tuple[str, ...]:
        """Every data column some part of this pipeline reads."""
        return tuple(dict.fromkeys([*cls.data_inputs, *(c for f in cls.features for c in f.reads())]))

    @classmethod
    def resolve_features(cls, context: RunContext) -> frozenset[str]:
        return resolve_features(cls.features, context)

    @property
    def units(self) -> list[PipelineUnit]:
        """The units of the run's features (every unit while none are resolved)."""
        if self.active_features is None:
            return list(self.all_units)
        return self.units_for(self.active_features)

    @units.setter
    def units(self, units: Sequence[PipelineUnit]) -> None:
        """The base units; the features' own units are placed among them (`compose_units`)."""
        self.all_units = compose_units(units, self.features)

    def units_for(self, features: Iterable[str]) -> list[PipelineUnit]:
        """The units of `features`, in order; a unit an active feature's unit replaces is left out."""
        features = set(features) | {BASE}
        chosen = [u for u in self.all_units if u.feature in features]
        replaced = {name for u in chosen for name in u.replaces}
        return [u for u in chosen if u.name not in replaced]

    def activate(self, features: Iterable[str]) -> None:
        """Fix the run's features: `units`, the split and the cache cover these (and base) only."""
        features = frozenset(features) | {BASE}
        unknown = features - set(self.feature_names())
        if unknown:
            raise UserError(f"{type(self).__name__} has no feature(s) {sorted(unknown)} "
                            f"(it has {', '.join(self.feature_names())})")
        self.active_features = features

    def model_fn_inputs_for(self, features: Iterable[str]) -> tuple[str, ...]:
        features = set(features)
        return tuple(dict.fromkeys([*self.model_fn_inputs,
                                    *(n for f in self.features if f.name in features for n in f.model_fn_inputs)]))

    @property
    def active_model_fn_inputs(self) -> tuple[str, ...]:
        features = self.active_features if self.active_features is not None else self.feature_names()
        return self.model_fn_inputs_for(features)

    def context(self, values: Mapping[str, Any] | None = None) -> RunContext:
        """What a call knows: the inputs it was given (not None) and the loaded models."""
        given = frozenset(k for k, v in (values or {}).items() if v is not None)
        return RunContext(columns=given, models={s: model_config(m) for s, m in self.loaded_models().items()})

    def features_for(self, values: Mapping[str, Any] | None = None) -> frozenset[str]:
        """The run's features, or (none resolved) those the values and the loaded models switch on."""
        if self.active_features is not None:
            return self.active_features
        return self.resolve_features(self.context(values))

    @property
    def batching(self) -> dict[str, Any]:
        """Every value's batching rule: the pipeline's inputs and each unit's outputs (cfg pairs on both sides)."""
        from .batch import Pad, normalize

        rules = dict(normalize(self.input_batching))
        for unit in self.all_units:
            for name, rule in normalize(unit.batching).items():
                sides = unit.cfg_outputs.get(name, (name,))
                for side, out in enumerate(sides):
                    if isinstance(rule, Pad) and rule.mask in unit.cfg_outputs:
                        rules[out] = Pad(unit.cfg_outputs[rule.mask][side])
                    else:
                        rules[out] = rule
        return rules

    @property
    def padded_values(self) -> dict[str, str]:
        """{variable-length value: its mask}, from the batching rules."""
        from .batch import masks_of

        return masks_of(self.batching)

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, torch_dtype=torch.bfloat16, device="cpu", model_configs: Sequence = (),
                        scheduler=None, **configs):
        """Load the models named by `model_configs` (any subset of the family's slots, recognised from the
        weights) and the tokenizers / processors passed as `<name>_config` (e.g. `tokenizer_config`); tokenizers
        beside the weights (the official layout) are found without one. Called on the family's pipeline, weights
        of a variant with its own pipeline class (e.g. Qwen-Image-Layered) give that class."""
        from .build import build_pipeline

        spec = cls.spec
        if spec is None:
            raise TypeError(f"{cls.__name__} belongs to no registered family")
        known = {f"{t.attr}_config": t for t in spec.tokenizers}
        unknown = set(configs) - set(known)
        if unknown:
            raise TypeError(f"{cls.__name__}.from_pretrained: unknown argument(s) {sorted(unknown)}; "
                            f"known: {sorted(known)}")
        sources = {known[k].attr: v for k, v in configs.items() if v is not None}
        return build_pipeline(spec, list(model_configs), device=device, torch_dtype=torch_dtype,
                              tokenizers=sources, scheduler=scheduler,
                              pipeline=None if cls is spec.pipeline else cls, log=lambda *a, **k: None)

    # -- models by name -------------------------------------------------------------------------------
    def __getattr__(self, name: str):
        models = self.__dict__.get("models")
        if models is not None and name in models:
            return models[name]
        raise AttributeError(f"{type(self).__name__} has no attribute '{name}'")

    def __setattr__(self, name: str, value):
        if name in type(self).model_names and "models" in self.__dict__:
            self.models[name] = value
        else:
            object.__setattr__(self, name, value)

    def loaded_models(self) -> dict[str, torch.nn.Module]:
        return {k: v for k, v in self.models.items() if v is not None}

    def free_models(self, names: Iterable[str]) -> None:
        """Drop models (e.g. the stage-1 encoders before stage 2 starts)."""
        for name in names:
            self.models[name] = None

    def module_path(self, slot: str, path: str) -> str:
        """A submodule of `slot` as `--trainable_models <slot>.<path>` names it (the reference's module names) -> its
        path in the model this pipeline holds (a family whose names differ overrides it)."""
        return path

    def freeze_except(self, names: Iterable[str]) -> list[torch.nn.Module]:
        """Eval mode and no gradients for every model, except the named ones (train mode, gradients on): a slot
        trains its whole model, `<slot>.<module path>` (e.g. dit.blocks.0.self_attn.q, as the reference's
        --trainable_models takes it) that submodule alone. Returns the modules that train."""
        names = [n for n in names if n]
        unknown = sorted({n.split(".", 1)[0] for n in names} - set(self.model_names))
        if unknown:
            raise UserError(f"--trainable_models: unknown model(s) {unknown}; "
                            f"this pipeline has {list(self.model_names)}")
        for model in self.loaded_models().values():
            model.train(False)
            model.requires_grad_(False)
        trained = []
        for name in names:
            slot, _, path = name.partition(".")
            model = self.models.get(slot)
            if model is None:
                continue  # not loaded in this stage
            module = model
            if path:
                ours = self.module_path(slot, path)
                try:
                    module = model.get_submodule(ours)
                except AttributeError:
                    raise UserError(f"--trainable_models {name}: {slot} ({type(model).__name__}) has no module "
                                    f"{ours}") from None
            module.train(True)
            module.requires_grad_(True)
            trained.append(module)
        return trained

    # -- units ----------------------------------------------------------------------------------------
    def run_units(self, values: dict[str, Any], units: Iterable[PipelineUnit] | None = None,
                  cfg: bool = False, given: Iterable[str] = ()) -> dict[str, Any]:
        """Run `units` (default: the units of the run's features, or of those the values switch on) on `values`.

        `given`: values the caller computed already (e.g. validation's cached prompt embeddings): a unit that would
        write only given values is skipped, and no unit overwrites one."""
        given = set(given)
        if units is None:
            units = self.units_for(self.features_for(values))
        for unit in units:
            if given and set(unit.writes(cfg)) <= given:
                continue
            if given:
                kept = {k: values[k] for k in given if k in values}
                run_unit(self, unit, values, cfg=cfg)
                values.update(kept)
            else:
                run_unit(self, unit, values, cfg=cfg)
        return values

    def model_fn_kwargs(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """What `model_fn` reads of the values: the base inputs and every feature's (None where absent)."""
        return {k: values.get(k) for k in self.model_fn_inputs_for(self.feature_names())}

    def model_fn(self, **kwargs) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- what it generates (core/target.py) ---------------------------------------------------------
    @property
    def stream(self):
        """The target's primary stream: a sample's size, its data column and its decoding follow it."""
        return self.target.primary

    @property
    def decode_models(self) -> tuple[str, ...]:
        """Models decoding uses (the VAE): validation loads them for a render when the stage has not."""
        return tuple(dict.fromkeys(m for s in self.target.streams for m in s.decode_models))

    def decode(self, latents: torch.Tensor, stream=None) -> torch.Tensor:
        """Latents of `stream` (default: the primary one) -> decoded outputs in [-1, 1]."""
        return (stream or self.stream).decode(self, latents)

    # -- LoRA -----------------------------------------------------------------------------------------
    def load_lora(self, module, path: str, alpha: float = 1.0) -> None:
        """Fuse a LoRA file (any supported layout) into `module` (e.g. `pipe.dit`) with strength `alpha`."""
        from ..lora import fuse_lora, load_lora_file
        from ..lora.formats import DENOISER_COMPONENT

        slot = next((n for n, m in self.models.items() if m is module), None)
        prefix = self.spec.lora_prefix(slot) if slot else None
        lora = load_lora_file(path, converters=self.spec.lora_converters)
        if slot in self.loss_models[:1] and prefix not in lora.components and DENOISER_COMPONENT in lora.components:
            prefix = DENOISER_COMPONENT  # a denoiser-only layout (ComfyUI's diffusion_model., kohya's lora_unet_)
        fuse_lora(module, lora, scale=alpha, component=prefix)

    def combine_cfg(self, posi: torch.Tensor, nega: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        return nega + cfg_scale * (posi - nega)

    # -- sampling: one template, family hooks ---------------------------------------------------------
    def call_setting(self, name: str, given=None):
        """A sampling setting: the caller's value, else the family's default (`call_defaults`)."""
        if given is not None:
            return given
        if name not in self.call_defaults:
            raise TypeError(f"{type(self).__name__}: no default for {name!r}")
        return self.call_defaults[name]

    def prompt_values(self, prompt, negative_prompt) -> dict[str, Any]:
        """A call's prompts as values: lists of prompts and negatives, and the batch size."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negatives = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        return {"prompt": prompts, "negative_prompt": negatives, "batch_size": len(prompts)}

    def image_seq_len(self, values: Mapping[str, Any]) -> int:
        """Tokens the denoiser will see (a dynamic time shift depends on it): from the initial latents when given,
        else from the size the values ask for (height and width; an audio clip's seconds)."""
        latents = values.get("latents")
        if isinstance(latents, torch.Tensor):
            return self.stream.seq_len(latents)
        return self.stream.size_seq_len(values)

    def set_timesteps(self, values: Mapping[str, Any], num_inference_steps: int,
                      denoising_strength: float = 1.0) -> None:
        """The sampling timesteps for these values (a family with its own time shift overrides it)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     image_seq_len=self.image_seq_len(values))

    def sampling_settings(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Run-time settings `model_fn` takes while sampling (e.g. where two experts meet)."""
        return {}

    def scheduler_of(self, stream):
        """The scheduler that noises and steps `stream` (the pipeline's, unless the target gives the stream one)."""
        if stream.name not in self.target.schedulers:
            return self.scheduler
        own = self.__dict__.setdefault("_stream_schedulers", {})
        if stream.name not in own:
            own[stream.name] = self.target.schedulers[stream.name]()
        return own[stream.name]

    def timestep_name(self, stream) -> str:
        """The model_fn input that takes `stream`'s timestep: `timestep`, or `<stream>_timestep` for a stream
        with its own scheduler."""
        return f"{stream.name}_timestep" if stream.name in self.target.schedulers else "timestep"

    def denoise(self, values: dict[str, Any], cfg_scale: float = 1.0, progress: bool = True,
                settings: Mapping[str, Any] | None = None):
        """The denoising loop: `model_fn` over the scheduler's timesteps, with classifier-free guidance, each
        stream stepped by its scheduler (`model_fn` returns one prediction, or one per stream by name). Returns the
        latents (a dict by stream name for several streams). Gradients follow the caller's mode (`generate` runs it
        without; direct distillation through every step)."""
        streams = self.target.streams
        latents = {s.name: values[s.latents] for s in streams}
        for s in streams:
            s.check_positions(self, latents[s.name])
        settings = dict(settings or {})
        posi = self.model_fn_kwargs(values)
        nega = None
        if cfg_scale != 1.0:
            nega = {k: values.get(self.negative_name(k), v) for k, v in posi.items()}
        schedulers = {s.name: self.scheduler_of(s) for s in streams}
        timesteps = self.scheduler.timesteps
        batch = latents[streams[0].name].shape[0]
        for i in tqdm(range(len(timesteps)), disable=not progress, desc="sampling", leave=False):
            call = {s.latents: latents[s.name] for s in streams}
            call.update({self.timestep_name(s): schedulers[s.name].timesteps[i].expand(batch).to(self.device)
                         for s in streams})
            pred = self._per_stream(self.model_fn(**posi, **settings, **call))
            if nega is not None:
                pred_nega = self._per_stream(self.model_fn(**nega, **settings, **call))
                pred = {k: self.combine_cfg(pred[k], pred_nega[k], cfg_scale) for k in pred}
            latents = {s.name: schedulers[s.name].step(pred[s.name], i, latents[s.name]) for s in streams}
        return latents[streams[0].name] if len(streams) == 1 else latents

    def _per_stream(self, pred) -> dict[str, torch.Tensor]:
        return dict(pred) if isinstance(pred, Mapping) else {self.stream.name: pred}

    def finish_latents(self, latents: torch.Tensor, values: Mapping[str, Any]) -> torch.Tensor:
        """The sampled latents as the decoder takes them (e.g. a clean first frame put back)."""
        return latents

    def postprocess(self, latents, output_type: str = "pil"):
        """"latent": the latents; "pt": decoded, in [0, 1]; "pil": one output per prompt (the stream's: an image,
        a clip's frames, a waveform; for several streams a dict of them by stream name)."""
        streams = self.target.streams
        if len(streams) == 1:
            return self.stream.postprocess(self, latents, output_type)
        outs = {s.name: s.postprocess(self, latents[s.name], output_type) for s in streams}
        if output_type != "pil":
            return outs
        return [dict(zip(outs, one)) for one in zip(*outs.values())]

    def loss_reads(self, reads) -> tuple[str, ...]:
        """A loss's reads with every stream's clean latents where it reads the primary's (`input_latents`)."""
        reads = tuple(reads)
        if "input_latents" in reads:
            reads += tuple(s.input_latents for s in self.target.streams)
        return tuple(dict.fromkeys(reads))

    @torch.no_grad()
    def generate(self, values: dict[str, Any], *, cfg_scale: float, num_inference_steps: int,
                 denoising_strength: float = 1.0, settings: Mapping[str, Any] | None = None,
                 given: Iterable[str] = (), progress: bool = True, output_type: str = "pil"):
        """The sampling template: timesteps -> units -> denoise -> finish -> decode.

        `values` are the call's inputs as values; `given` names values computed already (validation's prompt
        embeddings and conditioning, the initial latents), which the units neither recompute nor overwrite."""
        self.set_timesteps(values, num_inference_steps, denoising_strength)
        self.run_units(values, cfg=cfg_scale != 1.0, given=given)
        settings = {**self.sampling_settings(values), **dict(settings or {})}
        latents = self.denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)
        return self.postprocess(self.finish(latents, values), output_type)

    def finish(self, latents: torch.Tensor, values: Mapping[str, Any]) -> torch.Tensor:
        """The family's `finish_latents`, then each of the call's features' `finish`."""
        latents = self.finish_latents(latents, values)
        active = self.features_for(values)
        for feature in self.features:
            if feature.name in active:
                latents = feature.finish(self, latents, values)
        return latents

    # -- a training row and a sampling call as values ------------------------------------------------
    # A training row hands on every feature's columns it has (by their kinds), the run's features or not: a file
    # column that no flag loads arrives as text and is refused in one line instead of ignored.
    every_feature_column = False

    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """Pipeline inputs for one data sample, as inference would be called with (batch of one): the prompt, the
        row's settings (`data_inputs`: seed, a distillation row's steps, ...), each stream's value and the size it
        gives, and the run's features' columns (`Feature.row_values`)."""
        prompt = data.get("prompt", "")
        values = {"prompt": "" if prompt is None or (isinstance(prompt, float) and prompt != prompt) else prompt,
                  "negative_prompt": "", "batch_size": 1, **dict.fromkeys(self.input_kinds())}
        columns = {c for s in self.target.streams for c in (s.column, *s.clip_columns)}
        values.update({n: data.get(n) for n in self.data_inputs if n not in columns and n != "prompt"})
        if "rand_device" in values:
            values["rand_device"] = values["rand_device"] or "cpu"
        values.update(self.training_values)
        for stream in self.target.streams:
            value = stream.row_value(data)
            values[stream.input] = value
            values.update(stream.row_size(value))
            values.update(stream.frame_values(data))
        where = row_label(data)
        if self.every_feature_column:
            values.update(self.feature_data(data, values.get("num_frames")))
        for feature in self.features:
            if self.active_features is None or feature.name in self.active_features:
                values.update(feature.row_values(self, data, values))
        for feature in self.features:
            feature.check_values(values, where)
        return values

    # Stage 1 encodes one sample at a time: always (True), or a sample that gives a feature's inputs ("features")
    encode_alone: bool | str = False

    def batch_signature(self, sample: dict[str, Any]):
        """Stage 1 encodes samples with equal signatures as one batch (None: one at a time): the streams' sizes
        and frame inputs, the features' parts (`Feature.signature`) and the noise device."""
        if self.encode_alone is True or (self.encode_alone == "features"
                                         and any(sample.get(n) is not None for n in self.input_kinds())):
            return None
        return (*(part for s in self.target.streams for part in s.row_signature(sample)),
                *(part for f in self.features for part in f.signature(sample)), sample.get("rand_device") or "cpu")

    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "", cfg_scale: float | None = None,
                 height: int | None = None, width: int | None = None, num_inference_steps: int | None = None,
                 seed: int | None = None, input_image=None, denoising_strength: float = 1.0, rand_device: str = "cpu",
                 progress: bool = True, output_type: str = "pil", **inputs):
        """One output per prompt (a list for a list of prompts). Left out, `cfg_scale`, the size and the steps are
        the family's (`call_defaults`; the size of `input_image` when one is given). `inputs`: the pipeline's own
        parameters (`call_parameters`) and the features' inputs by the reference's names (`call_inputs()`)."""
        own = {k: inputs.pop(k, v) for k, v in self.call_parameters.items()}
        given, settings = self.take_call_inputs(inputs)
        settings.update({k: own.pop(k) for k in list(own) if k in self.model_fn_settings})
        values = self.prompt_values(prompt, negative_prompt)
        inputs = self.call_inputs()
        values.update({k: v for k, v in given.items() if k not in inputs})  # the features' negatives
        for feature in self.features:
            more, more_settings = feature.call_values(given, values)
            values.update(more)
            settings.update(more_settings)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        size = {k: self.call_setting(k, v) for k, v in (("height", height), ("width", width))
                if v is not None or k in self.call_defaults}  # a target without pictures has no height
        # `input_image`: an image target's starting image, a clip's first frame
        values.update({**size, "seed": seed, "rand_device": rand_device, "input_image": input_image, **own})
        cfg_scale, state = self.call_setting("cfg_scale", cfg_scale), {}
        for feature in self.features:
            feature.prepare_call(self, values, cfg_scale, state)
        out = self.generate(values, cfg_scale=cfg_scale,
                            num_inference_steps=self.call_setting("num_inference_steps", num_inference_steps),
                            denoising_strength=denoising_strength, settings=settings, progress=progress,
                            output_type=output_type)
        for feature in self.features:
            out = feature.finish_output(out, output_type, state)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out

    @classmethod
    def call_arguments(cls) -> set[str]:
        """Every name a sampling call takes (`difftune sample` hands on only these)."""
        import inspect

        return {*inspect.signature(cls.__call__).parameters, *cls.call_parameters, *cls.call_inputs(),
                *cls.call_settings()} - {"self", "inputs"}

    # Inputs a stage-1 batch shares (samples of one signature agree on them): kept once, not as a list.
    batch_shared_inputs: tuple[str, ...] = ("height", "width")

    def training_inputs_batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Pipeline inputs for samples of one `batch_signature`, encoded as one batch (stage 1): per-sample
        values as lists (None where no sample has one), `batch_shared_inputs` once; then each feature's
        `batch_values` (a batch of one included)."""
        per = [self.training_inputs(s) for s in samples]
        values = per[0]
        if len(per) > 1:
            values = {}
            for key in per[0]:
                vals = [p[key] for p in per]
                values[key] = vals[0] if key in self.batch_shared_inputs else \
                    None if all(v is None for v in vals) else vals
            values["batch_size"] = len(per)
        for feature in self.features:
            feature.batch_values(values, len(per))
        return values

    def negative_name(self, name: str) -> str:
        """The namespace name of the negative-prompt version of a model_fn input."""
        for unit in self.all_units:
            for pair in unit.cfg_outputs.values():
                if pair[0] == name:
                    return pair[1]
        return name

    def prompt_outputs(self) -> tuple[str, ...]:
        """The values the prompt units write (positive side): what a new prompt changes."""
        return tuple(pair[0] for u in self.units if "prompt" in u.cfg_inputs for pair in u.cfg_outputs.values())


class PromptImagePipeline(BasePipeline):
    """The common shape of a prompt-to-image DiT family, which its pipeline subclasses and changes where it differs:
    the denoiser `dit`, a text encoder and a VAE; the prompt's embeddings and their padding mask in every denoiser
    call; a training row of an image (or a size), its prompt, a seed, the noise device and a distillation row's
    steps, encoded in stage 1 in batches of one size."""

    model_names = ("dit", "text_encoder", "vae")
    loss_models = ("dit",)
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask")
    padding_masks = ("prompt_embeds_mask",)
    data_inputs = ("image", "prompt", "seed", "rand_device", "num_inference_steps", "height", "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME, "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "rand_device")
