"""The family seam: a `FamilySpec` says everything that is particular to one model family, and the registry
finds families by name or from the weights a user hands us.

Shared code reads a family only through its spec (and the pipeline classes the spec names, whose `spec` attribute
points back to it); it never imports a family package by name. Built-in families are found by scanning the
`difftune.families` package (each subpackage whose `FAMILY` is a spec); other packages add theirs through the
`difftune.families` entry point group or `register_family`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from ..util import first_line
from .options import NoOptions, flag_fields, option, with_sample_inputs

if TYPE_CHECKING:
    from ..models.detect import ComponentSpec, DetectedComponent

ENTRY_POINT_GROUP = "difftune.families"
BUILTIN_PACKAGE = "difftune.families"


def builtin_families() -> dict[str, str]:
    """name -> module of every package under difftune/families/ (found, not listed)."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    found = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg)
    return {name: f"{BUILTIN_PACKAGE}.{name}" for name in found}


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer or processor a family's model needs, loaded into `pipe.<attr>` with that model.

    Where it is found, first hit wins: the flag `flag` (e.g. --tokenizer_path); the folder `folder` beside the
    model's weights (official layout) or, for a hub id, that folder of the same repository; `default` (a
    `model_id:folder/` the reference uses when its command names none).
    """

    attr: str  # pipeline attribute: tokenizer, processor, ...
    slot: str  # the model it serves: loaded only when that model is
    folder: str  # folder beside the model's own folder in the official layout ("": the model's own folder)
    load: Callable[[Any], Any]  # a folder or ModelConfig -> the object
    flag: str | None = None  # the family option (CLI flag) that names it, e.g. "tokenizer_path"
    help: str = ""  # that flag's help, where the family's options do not declare the flag themselves
    default: str | None = None  # model_id:folder/ fallback
    required: bool = True
    # The feature that needs it (e.g. the edit processor: "edit"); None: every run that loads `slot`. Only a
    # needed one is fetched from the hub or its `default`; one found beside the weights is always loaded.
    feature: str | None = None
    download: bool = True  # False: only ever found beside the weights (e.g. a repository's scheduler/)
    # A folder beside the model's folder tried where `folder` has no tokenizer_config.json (a diffusers repository's
    # tokenizer/ beside text_encoder/, for a family whose official layout keeps it in the encoder's own folder)
    else_folder: str | None = None
    # (tokenizer, the loaded model it serves) -> what does not fit, or None: what the family knows its model needs of
    # a tokenizer (an architecture's own special tokens) beyond the shared checks (core/build.py)
    fits: Callable[[Any, Any], str | None] | None = None


def text_tokenizer(flag: str, default: str | None = None, folder: str = "tokenizer",
                   help: str | None = None, fits: Callable[[Any, Any], str | None] | None = None,
                   else_folder: str | None = None) -> TokenizerSpec:
    """The text encoder's tokenizer as `pipe.tokenizer`: the flag `flag` (the reference's --tokenizer_path), else
    `folder` beside the text encoder, else `default` (the reference's `model_id:folder/` when its command names
    none)."""
    from ..models.load import load_tokenizer

    where = (f"{folder}/ beside the text encoder" if folder else "the text encoder's own folder") + \
        (f", else {else_folder}/ beside it" if else_folder else "") + (f", else {default}" if default else "")
    return TokenizerSpec(attr="tokenizer", slot="text_encoder", folder=folder, load=load_tokenizer,
                         flag=flag, default=default, fits=fits, else_folder=else_folder,
                         help=help or f"Tokenizer directory or model_id:folder/ (default: {where}).")


@dataclass(frozen=True)
class FamilySpec:
    """One model family. `pipeline` is its `BasePipeline` subclass (units, model_fn, sampling); the rest says
    how the family's files are recognised and loaded and what the `train` and `sample` commands assume."""

    name: str
    pipeline: type  # the family's pipeline class
    components: tuple[ComponentSpec, ...]  # recognisable models; each fills `spec.name` (and `spec.extra_slots`)
    tokenizers: tuple[TokenizerSpec, ...] = ()
    # Slot -> key prefix of that model's weights in LoRA files (diffusers' names).
    lora_prefixes: Mapping[str, str] = field(default_factory=lambda: {"dit": "transformer"})
    lora_target_modules: str = ""  # the reference's LoRA targets on the denoiser
    # Slot -> {a module name of the reference's own model: the comma-separated names of the modules that hold
    # its weights here}, so the reference's --lora_target_modules work unchanged (e.g. FLUX's fused a_to_qkv).
    lora_target_aliases: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Slot -> the names of `lora_target_aliases` that are one Linear layer in the reference's model (a fused q/k/v
    # projection): given, the modules such a name selects in one block (its paths' `*` parts alike) train one
    # adapter, as the reference's does: one lora_A shared, one lora_B over their rows in the alias's order
    # (`lora.share_lora`); naming the modules themselves keeps an adapter each.
    lora_fused_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # LoRA file translators for layouts only this family has (FLUX: kohya files in BFL's fused-qkv names):
    # tensors -> diffusers-layout tensors, or None when the file is not theirs (see `load_lora_file`).
    lora_converters: tuple[Callable[[dict], dict | None], ...] = ()
    # The inverse for writing (`--lora_format comfyui|kohya`, whose readers know the model by its original
    # names): the denoiser's LoRA (module path -> lora_A/B, alphas by path) renamed to those names, e.g. FLUX's
    # BFL names with q, k, v re-fused; None: the diffusers module names are written.
    lora_native_names: Callable[[dict, dict], tuple[dict, dict]] | None = None
    # The same for `--lora_format reference` (the reference's own trainer's file) where the reference's module names
    # are neither diffusers' nor the original release's (ACE-Step: the original ones inside `decoder.`); None: the
    # family has no such layout (its default file is what the reference reads).
    lora_reference_names: Callable[[dict, dict], tuple[dict, dict]] | None = None
    # The layout a LoRA of the denoiser alone is written in when --lora_format is left at its default: the one that
    # diffusers, ComfyUI and the reference's own loader all read at the trained strength, or where no one layout
    # is read by all three, the one diffusers reads whole (docs/lora_files.md); LoRAs of other models are written
    # in the diffusers layout.
    lora_default_format: str = "diffusers"
    # (layout, the denoiser's LoRA module paths) -> notes printed when a file is written: what a reader skips.
    lora_export_notes: Callable[[str, list], list] | None = None
    # Slot -> its state dict in the model's original key names, for `--full_format original` (a fully trained
    # model saved where the original checkpoints load, e.g. Wan's DiT in Wan-AI's names).
    full_native_keys: Mapping[str, Callable[[dict], dict]] = field(default_factory=dict)
    # A pair of denoiser slots that share the timesteps (high-noise expert first: Wan2.2 A14B's dit, dit2), for
    # `--train_experts both`; () for one denoiser.
    experts: tuple[str, ...] = ()
    # (slot, ModelConfig) list -> the boundary between the experts that these weights were released with (read
    # from file headers, nothing loaded), or None: the default of --expert_boundary.
    expert_boundary: Callable[[list], float | None] | None = None
    # Hub ids (or id prefixes) of the family's own releases: when weights named by hub id fit several families
    # (two families sharing a text encoder and a VAE, given without a DiT), the one they come from is chosen.
    repositories: tuple[str, ...] = ()
    # The family's own options: a dataclass whose fields are its flags (core/options.py), e.g. its tokenizer
    # paths; `difftune train` / `sample` take them, a run receives them as `config.family_options`.
    options: type = NoOptions
    # Run-time settings this family's units read, from its options (options -> {name: value}); never cached.
    unit_settings: Callable[[Any], dict] | None = None
    # Training losses only this family has (`--task <name>`): name -> (loss function, the names it reads besides
    # model_fn's), as training/losses.py's table.
    losses: Mapping[str, tuple[Callable, tuple[str, ...]]] = field(default_factory=dict)
    # Pipeline classes of variants that change the algorithm (latent layout, model_fn, CFG, sampling), e.g.
    # Qwen-Image-Layered; each says which runs are its own (`claims`), tried in order before `pipeline`.
    variants: tuple[type, ...] = ()
    description: str = ""
    # kohya's `ss_base_model_version` of the family's models (sd_v1, sdxl_base_v1-0), which A1111, Forge and Civitai
    # read from a kohya-layout LoRA file's metadata; None: not written
    kohya_model_version: str | None = None

    def __post_init__(self):
        for cls in self.pipelines:
            cls.spec = self  # a pipeline knows its family without a look-up by name
        # a feature that brings a model registers it itself (`Feature.components`, `Feature.native_keys`)
        features = [f for cls in self.pipelines for f in getattr(cls, "features", ())]
        extra = []
        for component in (c for f in features for c in f.components):
            if not any(component is c for c in (*self.components, *extra)):
                extra.append(component)
        if extra:
            object.__setattr__(self, "components", (*self.components, *extra))
        natives = {slot: fn for f in features for slot, fn in f.native_keys.items()}
        if natives:
            object.__setattr__(self, "full_native_keys", {**natives, **dict(self.full_native_keys)})
        # a tokenizer's flag is an option of the family (both commands take it) unless its options declare it
        declared = {f.name for f in fields(self.options)}
        flags = {t.flag: t.help for t in self.tokenizers if t.flag and t.flag not in declared}
        if flags:
            extra = [(name, Any, option(None, help, sample=True)) for name, help in flags.items()]
            object.__setattr__(self, "options", make_dataclass(self.options.__name__, extra, bases=(self.options,),
                                                               frozen=True))
        # `difftune sample` takes the family's options and the sampling inputs its pipelines and features declare
        inputs: dict = {}
        for cls in self.pipelines:
            declared = getattr(cls, "all_sample_flags", dict)  # a class that is no BasePipeline declares none
            for name, spec in declared().items():
                inputs.setdefault(name, spec)
        group = next((f.metadata["flag"]["group"] for f in flag_fields(self.options) if f.metadata["flag"]["group"]),
                     self.name)
        object.__setattr__(self, "sample_options", with_sample_inputs(self.options, inputs, group))

    def options_for(self, command: str) -> type:
        """The options dataclass whose flags `command` (train, sample) takes."""
        return self.sample_options if command == "sample" else self.options

    @property
    def target(self):
        """What the family generates (its pipeline's `Target`: streams, prediction type)."""
        return self.pipeline.target

    @property
    def pipelines(self) -> tuple[type, ...]:
        return (*self.variants, self.pipeline)

    def pipeline_for(self, context) -> type:
        """The variant pipeline class whose runs these are (from the weights and data columns), else the family's."""
        return next((cls for cls in self.variants if cls.claims(context)), self.pipeline)

    def pipeline_named(self, name: str) -> type:
        for cls in self.pipelines:
            if cls.__name__ == name:
                return cls
        raise UserError(f"the {self.name} family has no pipeline {name} (it has "
                        f"{', '.join(c.__name__ for c in self.pipelines)})")

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for cls in self.pipelines for s in cls.model_names))

    def lora_prefix(self, slot: str) -> str:
        return self.lora_prefixes.get(slot, slot)

    def assign_slots(self, detected: Sequence[tuple[DetectedComponent, Any]]) -> list[tuple[str, Any]]:
        """(slot, item) for recognised models in order: a second model of one kind takes the spec's next slot
        (e.g. a second DiT becomes dit2 where the family has one), else it is an error, never a silent swap."""
        taken: dict[str, Any] = {}
        out = []
        for det, item in detected:
            slots = (det.spec.name, *getattr(det.spec, "extra_slots", ()))
            free = [s for s in slots if s not in taken]
            if not free:
                first = taken[det.spec.name]
                raise UserError(f"{_describe(item)} and {_describe(first)} are both a {det.spec.class_name} "
                                f"({' / '.join(slots)}); {self.name} has no slot for another: name one of them only")
            taken[free[0]] = item
            out.append((free[0], item))
        return out


def _describe(item) -> str:
    return item.describe() if hasattr(item, "describe") else str(item)


_REGISTERED: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec, *old) -> FamilySpec:
    """Make a family available as `--family <name>` and to recognition (call it when its module is imported)."""
    if not isinstance(spec, FamilySpec) or old:  # e.g. the earlier register_family(name, pipeline_class)
        raise TypeError(f"register_family takes one FamilySpec (name, pipeline, components, ...; see "
                        f"docs/adding_a_family.md), got {', '.join(type(a).__name__ for a in (spec, *old))}")
    _REGISTERED[spec.name] = spec
    return spec


def _load(name: str, target: str, what: str) -> FamilySpec:
    """`target` is `module` (its FAMILY) or `module:attribute` (a FamilySpec)."""
    module, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module)
        obj = getattr(obj, attr) if attr else obj
    except Exception as err:  # a broken plugin must not hide behind a traceback of ours
        raise UserError(f"family '{name}' ({what} {target}): cannot be imported ({first_line(err)})") from err
    spec = getattr(obj, "FAMILY", obj)
    if not isinstance(spec, FamilySpec):
        raise UserError(f"family '{name}' ({what} {target}): not a FamilySpec (got {type(spec).__name__})")
    return spec


@functools.lru_cache(maxsize=4)
def _entry_points(path: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The `difftune.families` entry points of the distributions on `path` (sys.path): reading every installed
    distribution's metadata takes milliseconds, and a run asks for the families a dozen times."""
    from importlib.metadata import entry_points

    return tuple((ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP))


def families() -> dict[str, FamilySpec]:
    """Built-in families, then packages' `difftune.families` entry points, then `register_family` calls."""
    found = {name: _load(name, target, "module") for name, target in builtin_families().items()}
    for name, target in _entry_points(tuple(sys.path)):
        found[name] = _load(name, target, "entry point")
    found.update(_REGISTERED)
    return found


def get_family(name: str) -> FamilySpec:
    """The family called `name`; a UserError naming the known ones if there is none."""
    known = families()
    if name not in known:
        raise UserError(f"--family {name}: unknown family (known: {', '.join(sorted(known))})")
    return known[name]


def recognise(configs: Sequence, family: str | None = None, log=print) -> tuple[FamilySpec, list]:
    """The family (named, or inferred from the weights) and (slot, ModelConfig, DetectedComponent) per config.

    Recognition is scoped: each family's components are tried on their own, and the family is the one that
    recognises every model given. None or several: a one-line error.
    """
    from ..models.detect import detect_component

    if family is not None:
        spec = get_family(family)
        return spec, _slots(spec, _detect_all(configs, spec))
    known = families()
    if not configs:
        raise UserError("no model given: name the weights with --model_paths or --model_id_with_origin_paths "
                        "(or name the family with --family)")
    fits, errors = [], {}
    for spec in known.values():
        try:
            fits.append((spec, _detect_all(configs, spec)))
        except UserError as err:
            errors[spec.name] = str(err)
    if len(fits) > 1:
        # a model that is one family's own and another's add-on (Qwen2.5-VL: Qwen-Image's text encoder, and the
        # encoder of FLUX's Step1X-Edit variant) belongs to the family whose base pipeline has a slot for every model
        base = [(s, d) for s, d in fits if _base_slots_only(s, d)]
        if len(base) == 1:
            fits = base
    if len(fits) > 1:
        ids = {getattr(c, "model_id", None) for c in configs}
        if None not in ids:
            own = [(s, d) for s, d in fits if all(i.startswith(s.repositories) for i in ids) and s.repositories]
            if len(own) == 1:
                fits = own
    if len(fits) > 1:
        raise UserError(f"the weights fit several families ({', '.join(s.name for s, _ in fits)}): "
                        f"choose one with --family")
    if not fits:
        # the error of the family whose denoiser is among the weights says best what is wrong (the denoiser names
        # the family: one family's DiT with another's VAE is a run of the DiT's family whose VAE does not fit, not a
        # run of the VAE's family whose DiT is unknown), then of the one that recognised the most models (on a tie,
        # one that found a near miss: "looks like a ...")
        counts = {s.name: _count_recognised(s, configs) for s in known.values()}
        best = max(known.values(), key=lambda s: (counts[s.name][1], counts[s.name][0],
                                                  "looks like" in errors[s.name]))
        raise UserError(f"{errors[best.name]} (tried the families {', '.join(sorted(known))}; "
                        f"--family names one)")
    spec, detected = fits[0]
    log(f"family: {spec.name} (recognised from the weights)")
    return spec, _slots(spec, detected)


def detect_component(config, family: str | None = None):
    """Which model of which family `config`'s weights are (`family` names it; else every family is tried)."""
    from ..models.detect import as_model_config

    config = as_model_config(config)
    if family is None:
        # a shared part (the Qwen-Image VAE of Qwen-Image and Krea-2) fits several families as the same model: for
        # one model alone, which family asks does not matter
        same = set()
        for spec in families().values():
            try:
                detected = _slots(spec, _detect_all([config], spec))[0][2]
            except UserError:
                continue
            same.add((detected.spec.library, detected.spec.class_name, repr(sorted(detected.config.items()))))
            found = detected
        if len(same) == 1:
            return found
    _, found = recognise([config], family, log=lambda *a, **k: None)
    return found[0][2]


def load_component(config, torch_dtype=None, device="cpu", family: str | None = None):
    """Recognise (as `detect_component`) and load one model, frozen, on `device` (see models.load)."""
    from ..models.detect import as_model_config
    from ..models.load import load_component as load

    config = as_model_config(config)
    kwargs = {} if torch_dtype is None else {"torch_dtype": torch_dtype}
    return load(config, device=device, detected=detect_component(config, family), **kwargs)


def _count_recognised(spec: FamilySpec, configs) -> tuple[int, bool]:
    """How many of the configs the family recognises, and whether its denoiser is among them."""
    from ..models.detect import detect_component

    n, denoiser = 0, False
    denoisers = set(getattr(spec.pipeline, "loss_models", ()) or ())
    for c in configs:
        try:
            found = detect_component(c, [s for s in spec.components if not s.companion])
        except UserError:
            continue
        n += 1
        denoiser = denoiser or found.name in denoisers
    return n, denoiser


def _detect_all(configs, spec: FamilySpec) -> list:
    """(DetectedComponent, config) for every model in the configs' files (a file may hold a companion model too)."""
    from ..models.detect import detect_components

    return [(det, c) for c in configs for det in detect_components(c, spec.components)]


def _base_slots_only(spec: FamilySpec, detected) -> bool:
    try:
        return all(slot in spec.pipeline.model_names for slot, _, _ in _slots(spec, detected))
    except UserError:
        return False


def _slots(spec: FamilySpec, detected) -> list:
    """(slot, config, DetectedComponent) in the order given."""
    return [(slot, c, det) for (slot, c), (det, _) in zip(spec.assign_slots(detected), detected)]


__all__ = ["ENTRY_POINT_GROUP", "FamilySpec", "builtin_families", "TokenizerSpec", "detect_component", "families", "get_family",
           "load_component", "recognise", "register_family", "text_tokenizer"]
