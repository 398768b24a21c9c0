"""The base pipeline every family subclasses: model slots by name, device and dtype, freezing, the units,
and the sampling loop (`model_fn` over the scheduler's steps with classifier-free guidance)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from .units import PipelineUnit, run_unit


class BasePipeline:
    """Models by name, device and dtype, the units, `freeze_except`, and the sampling loop.

    Families subclass it and set `model_names`, `units`, `model_fn` and `model_fn_inputs`.
    """

    model_names: tuple[str, ...] = ()
    # Names that are run-time settings, not data: supplied by each stage's own arguments, never cached.
    settings: frozenset[str] = frozenset()
    # Names `model_fn` reads from the values besides `latents` and `timestep`.
    model_fn_inputs: tuple[str, ...] = ()
    # The data columns `training_inputs` reads (empty: not declared, nothing is checked). A column a flag names
    # (--extra_inputs, --data_file_keys) that the family does not read is refused rather than dropped.
    data_inputs: tuple[str, ...] = ()
    # How values that come with the data batch (units declare theirs in `PipelineUnit.batching`).
    input_batching: Mapping[str, Any] = {}
    # Run-time settings the loss hands on to `model_fn` (a family adds its own, e.g. Qwen's zero_cond_t).
    model_fn_settings: tuple[str, ...] = ("use_gradient_checkpointing", "use_gradient_checkpointing_offload")
    # Models `model_fn` uses (the denoiser): stage 2 always loads them.
    loss_models: tuple[str, ...] = ()
    # Models `decode` uses (the VAE): validation loads them for a render when the stage has not.
    decode_models: tuple[str, ...] = ()
    # Training images are cropped so both sides are multiples of this.
    division_factor: int = 1
    # Video families (`FamilySpec.data == "video"`): a clip trains on `--num_frames` frames (default
    # `default_num_frames`), which must be time_division_factor * k + time_division_remainder (Wan: 4k+1);
    # a shorter clip is cut to the largest such count it has.
    default_num_frames: int = 81
    time_division_factor: int = 4
    time_division_remainder: int = 1
    # --extra_inputs taken from a clip's frames when the metadata has no such column: name -> (clip column,
    # frame index), e.g. {"input_image": ("video", 0), "end_image": ("video", -1)} (the reference's Wan script).
    frame_inputs: Mapping[str, tuple[str, int]] = {}
    # The family's name (`FamilySpec.name`): how the shared code finds its spec.
    family: str = ""
    # Latent layout, for the loss and sampling: latents (B, C, [frames,] H, W) are cut into patch_size^2 tokens.
    patch_size: int = 1
    latent_channels: int = 4
    vae_scale: int = 1

    def __init__(self, device: str | torch.device = "cpu", torch_dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.torch_dtype = torch_dtype
        self.models: dict[str, torch.nn.Module | None] = {name: None for name in self.model_names}
        self.units: list[PipelineUnit] = []
        self.scheduler = None

    @property
    def batching(self) -> dict[str, Any]:
        """Every value's batching rule: the pipeline's inputs and each unit's outputs (cfg pairs on both sides)."""
        from .batch import Pad, normalize

        rules = dict(normalize(self.input_batching))
        for unit in self.units:
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
        weights) and the tokenizers / processors passed as `<name>_config` (e.g. `tokenizer_config`)."""
        from ..models.load import load_component
        from .family import get_family

        spec = get_family(cls.family)
        pipe = cls(device=device, torch_dtype=torch_dtype, scheduler=scheduler)
        from ..models.detect import detect_component

        detected = [(detect_component(c, spec.components), c) for c in model_configs]
        by_id = {id(c): d for d, c in detected}
        for slot, config in spec.assign_slots(detected):
            setattr(pipe, slot, load_component(config, torch_dtype=torch_dtype, device=device,
                                               detected=by_id[id(config)]).module)
        known = {f"{t.attr}_config": t for t in spec.tokenizers}
        unknown = set(configs) - set(known)
        if unknown:
            raise TypeError(f"{cls.__name__}.from_pretrained: unknown argument(s) {sorted(unknown)}; "
                            f"known: {sorted(known)}")
        for key, config in configs.items():
            if config is not None:
                setattr(pipe, known[key].attr, known[key].load(config))
        return pipe

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

    def freeze_except(self, names: Iterable[str]) -> None:
        """Eval mode and no gradients for every model, except the named ones (train mode, gradients on)."""
        names = set(n for n in names if n)
        unknown = names - set(self.model_names)
        if unknown:
            raise UserError(f"--trainable_models: unknown model(s) {sorted(unknown)}; "
                            f"this pipeline has {list(self.model_names)}")
        for name, model in self.loaded_models().items():
            train = name in names
            model.train(train)
            model.requires_grad_(train)

    # -- units ----------------------------------------------------------------------------------------
    def run_units(self, values: dict[str, Any], units: Iterable[PipelineUnit] | None = None,
                  cfg: bool = False) -> dict[str, Any]:
        for unit in self.units if units is None else units:
            run_unit(self, unit, values, cfg=cfg)
        return values

    def model_fn_kwargs(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {k: values.get(k) for k in self.model_fn_inputs}

    def model_fn(self, **kwargs) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- latent layout (the loss and validation read these) -----------------------------------------
    def seq_len(self, latents: torch.Tensor) -> int:
        """Tokens the denoiser sees for these latents (what a dynamic time shift depends on)."""
        tokens = 1
        for side in latents.shape[-2:]:
            tokens *= side // self.patch_size
        return tokens * (latents.shape[2] if latents.dim() == 5 else 1)

    def loss_mask(self, values: Mapping[str, Any]) -> torch.Tensor | None:
        """Which latent elements count in the loss (broadcast against the latents); None: all of them."""
        return None

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one sample's initial noise for an image of this size (validation draws it)."""
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Latents -> images (B, 3, H, W) in [-1, 1]."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode latents to images")

    # -- LoRA -----------------------------------------------------------------------------------------
    def load_lora(self, module, path: str, alpha: float = 1.0) -> None:
        """Fuse a LoRA file (any supported layout) into `module` (e.g. `pipe.dit`) with strength `alpha`."""
        from ..lora import fuse_lora, load_lora_file
        from .family import get_family

        slot = next((n for n, m in self.models.items() if m is module), None)
        family = get_family(self.family)
        prefix = family.lora_prefix(slot) if slot else None
        fuse_lora(module, load_lora_file(path, converters=family.lora_converters), scale=alpha, component=prefix)

    def combine_cfg(self, posi: torch.Tensor, nega: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        return nega + cfg_scale * (posi - nega)

    # -- sampling -------------------------------------------------------------------------------------
    @torch.no_grad()
    def denoise(self, values: dict[str, Any], cfg_scale: float = 1.0, progress: bool = True,
                settings: Mapping[str, Any] | None = None) -> torch.Tensor:
        """The sampling loop: `model_fn` over the scheduler's timesteps, with classifier-free guidance."""
        latents = values["latents"]
        settings = dict(settings or {})
        posi = self.model_fn_kwargs(values)
        nega = None
        if cfg_scale != 1.0:
            nega = {k: values.get(self.negative_name(k), v) for k, v in posi.items()}
        timesteps = self.scheduler.timesteps
        for i in tqdm(range(len(timesteps)), disable=not progress, desc="sampling", leave=False):
            t = timesteps[i].expand(latents.shape[0]).to(self.device)
            pred = self.model_fn(**posi, **settings, latents=latents, timestep=t)
            if nega is not None:
                pred_nega = self.model_fn(**nega, **settings, latents=latents, timestep=t)
                pred = self.combine_cfg(pred, pred_nega, cfg_scale)
            latents = self.scheduler.step(pred, i, latents)
        return latents

    # -- training data (families override `training_inputs`; the rest have working defaults) ---------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - abstract
        """Pipeline inputs for one data sample, as inference would be called with (batch of one)."""
        raise NotImplementedError

    def batch_signature(self, sample: dict[str, Any]):
        """Stage 1 encodes samples with equal signatures as one batch; None (the default): one at a time."""
        return None

    # Inputs a stage-1 batch shares (samples of one signature agree on them): kept once, not as a list.
    batch_shared_inputs: tuple[str, ...] = ("height", "width")

    def training_inputs_batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Pipeline inputs for samples of one `batch_signature`, encoded as one batch (stage 1): per-sample
        values as lists (None where no sample has one), `batch_shared_inputs` once."""
        per = [self.training_inputs(s) for s in samples]
        if len(per) == 1:
            return per[0]
        values = {}
        for key in per[0]:
            vals = [p[key] for p in per]
            values[key] = vals[0] if key in self.batch_shared_inputs else \
                None if all(v is None for v in vals) else vals
        values["batch_size"] = len(per)
        return values

    def from_cache_values(self, sample: dict[str, Any]) -> dict[str, Any]:
        """Values read back from a stage-1 cache: images come back as PIL, bookkeeping keys are dropped."""
        from ..media.image import images_from_cache

        return {k: images_from_cache(v) for k, v in sample.items() if not k.startswith("_")}

    def negative_name(self, name: str) -> str:
        """The namespace name of the negative-prompt version of a model_fn input."""
        for unit in self.units:
            for pair in unit.cfg_outputs.values():
                if pair[0] == name:
                    return pair[1]
        return name
