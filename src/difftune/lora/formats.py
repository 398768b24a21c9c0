"""LoRA files: export in diffusers', ComfyUI's or kohya's layout (docs/lora_files.md: which reader takes which),
import every common layout.

A component is named by its file prefix: `transformer` (the `dit` slot, as diffusers names it) or
`text_encoder`; `""` holds LoRAs whose keys carry no prefix (raw peft keys, the reference's files), which
fit whichever model they are loaded into. A family may map more slots to prefixes (`FamilySpec.lora_prefixes`).

Strength: the diffusers-layout file difftune writes has alpha/rank folded into `lora_B` and alpha = rank in
its metadata, because ComfyUI reads alpha only from per-module `.alpha` tensors (never from metadata; without
them it applies scale 1) while diffusers refuses `transformer.`-prefixed files that carry `.alpha` tensors.
So the same file loads at the trained strength in both. `difftune_lora` records the trained alpha and
`alpha_folded`; difftune's import divides B back (exact when alpha/rank is a power of two, else within one
fp32 rounding step), so continuing training from the file keeps the trained alpha and B's learning-rate
scale. (A tool that ignores our metadata and continues training from the folded B sees alpha = rank: B's
updates then act on the weights rank/alpha times as strongly.) The ComfyUI and kohya layouts
(`layout="comfyui"|"kohya"`) keep B as trained and write a `.alpha` tensor per module.

Alpha read from per-module `.alpha` tensors (ComfyUI, kohya) is kept per module on import, not folded.
Per-module values that differ from the common one go into peft's `rank_pattern` / `alpha_pattern`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..util import PICKLE_SUFFIXES, first_line, non_finite
from ..util import names as _names
from .inject import _WEIGHT_KEY, _is_peft_internal, _linear_of, _module_paths, canonical_lora_keys, layer_sides

COMPONENT_PREFIX = {"dit": "transformer", "transformer": "transformer", "text_encoder": "text_encoder"}
# What the denoiser-only layouts (ComfyUI's diffusion_model., kohya's lora_unet_, the reference's pipe.dit.) are read
# as: the denoiser of whichever family loads them, whatever its slot is named (a DiT's transformer, a UNet's unet).
DENOISER_COMPONENT = "transformer"
ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # what diffusers' save_lora_weights writes
DIFFTUNE_METADATA_KEY = "difftune_lora"
# what save_lora writes (--lora_format); "reference": the reference's own trainer's file (bare module paths in its
# model's names, alpha folded), for a family whose diffusers names differ from those (`lora_reference_names`)
LAYOUTS = ("diffusers", "comfyui", "kohya", "reference")
# The denoiser's key prefix in the ComfyUI and kohya layouts; other models have no name there that every
# family shares (ComfyUI names text-encoder LoRAs after its own module tree, `text_encoders.<its key>`).
_DENOISER_PREFIX = {"comfyui": "diffusion_model.", "kohya": "lora_unet_"}
_ALPHA_KEY = re.compile(r"^(?P<path>.+)\.alpha$")
# (key prefix, component, layout, flattened kohya names)
_PREFIXES = (
    ("transformer.", "transformer", "diffusers", False),
    ("text_encoder.", "text_encoder", "diffusers", False),
    ("diffusion_model.", "transformer", "comfyui", False),
    ("pipe.dit.", "transformer", "reference", False),
    ("pipe.text_encoder.", "text_encoder", "reference", False),
    ("lora_unet_", "transformer", "kohya", True),
    ("lycoris_", "transformer", "lycoris", True),  # SimpleTuner's LyCORIS LoRA (ComfyUI maps it for Qwen-Image)
    ("lora_transformer_", "transformer", "onetrainer", True),  # OneTrainer
    ("lora_te1_", "text_encoder", "kohya", True),
    ("lora_te_", "text_encoder", "kohya", True),
)


def component_prefix(name: str | None) -> str | None:
    """The key prefix of a pipeline slot in LoRA files (`dit` -> `transformer`); other names pass through."""
    return None if name is None else COMPONENT_PREFIX.get(name, name)


# -- export ---------------------------------------------------------------------------------------------

def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> Path:
    """Write a safetensors file atomically (see difftune.io)."""
    from ..io import atomic_save_safetensors

    return atomic_save_safetensors(tensors, path, metadata)


def _pattern_value(patterns: Mapping[str, Any], path: str, default):
    # peft's rule for rank_pattern / alpha_pattern (peft.utils.other.get_pattern_key)
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def _config_spec(config, sd: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """LoraConfig / (rank, alpha, targets) / dict -> the LoraConfig fields a loader needs, checked against sd."""
    if isinstance(config, tuple):
        rank, alpha, targets = config
        spec = {"r": int(rank), "lora_alpha": float(rank if alpha is None else alpha),
                "target_modules": _names(targets)}
    else:
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        targets = get("target_modules")
        targets = sorted(targets) if isinstance(targets, (set, frozenset)) else _names(targets)
        spec = {"r": int(get("r")), "lora_alpha": float(get("lora_alpha")), "target_modules": targets}
        for k in ("rank_pattern", "alpha_pattern"):
            if get(k):
                spec[k] = dict(get(k))
        if get("exclude_modules"):
            spec["exclude_modules"] = sorted(get("exclude_modules"))
        if get("use_rslora") or get("use_dora"):
            raise ValueError("rsLoRA / DoRA adapters cannot be exported by difftune")
    spec.setdefault("rank_pattern", {})
    spec.setdefault("alpha_pattern", {})
    for path in _module_paths(sd):
        want = _pattern_value(spec["rank_pattern"], path, spec["r"])
        got = sd[f"{path}.lora_A.weight"].shape[0]
        if got != want:
            raise ValueError(f"{path}: lora_A has rank {got} but the config says {want}")
    return spec


def _module_alphas(spec: Mapping[str, Any], sd: Mapping[str, torch.Tensor]) -> dict[str, float]:
    return {p: float(_pattern_value(spec["alpha_pattern"], p, spec["lora_alpha"])) for p in _module_paths(sd)}


def lora_layout_problem(layout: str, slots: Iterable[str], denoiser: str | None,
                        prefixes: Mapping[str, str] | None = None, reference: bool = False) -> str | None:
    """Why `layout` cannot hold LoRAs of `slots` (None if it can): ComfyUI / kohya names exist for the denoiser only;
    the reference layout only where the family names its modules as the reference does (`reference`)."""
    if layout not in LAYOUTS:
        return f"unknown LoRA layout {layout!r} (known: {', '.join(LAYOUTS)})"
    if layout == "diffusers":
        return None
    if layout == "reference" and not reference:
        return ("this family has no reference layout of its own: its default file (--lora_format default) is the "
                "one the reference's loader reads")
    for slot in slots:
        if slot != denoiser:
            prefix = (prefixes or {}).get(slot) or component_prefix(slot)
            return (f"the {layout} layout names only the denoiser's LoRA ({denoiser}); {slot} ({prefix}) has no "
                    f"{layout} key names: use --lora_format diffusers")
    return None


def save_lora(path: str | os.PathLike, state_dicts: Mapping[str, Mapping[str, torch.Tensor]],
              configs: Mapping[str, Any], base_info: Mapping[str, Any] | None = None,
              prefixes: Mapping[str, str] | None = None, layout: str = "diffusers",
              denoiser: str | None = None, native_names: Callable | None = None,
              reference_names: Callable | None = None) -> Path:
    """Write one LoRA file in `layout`; which readers load which layout of which family at the trained strength is
    docs/lora_files.md (every layout loads in difftune; the diffusers layout in diffusers and ComfyUI; the comfyui
    layout of Qwen-Image and Wan also in DiffSynth-Studio's loader, which is why it is their default).

    `state_dicts` / `configs` are keyed by component or pipeline slot; `prefixes` maps a slot to its key prefix
    (the family's `lora_prefixes`; by default `dit` is written as `transformer`).
    A config is a `LoraConfig`, a `(rank, alpha, target_modules)` tuple or a dict of LoraConfig fields.

    `layout="diffusers"`: keys `<prefix>.<module path>.lora_A.weight`, alpha/rank folded into lora_B;
    metadata `format=pt`, `lora_adapter_metadata` (the prefixed LoraConfig fields as diffusers writes them,
    alpha = rank) and `difftune_lora` (per-component rank, trained alpha, targets, `alpha_folded`, the base
    model described by `base_info`). `"comfyui"`: `diffusion_model.<path>.lora_A/B.weight` + `.alpha`;
    `"kohya"`: `lora_unet_<path with _>.lora_down/up.weight` + `.alpha`; both hold the `denoiser` slot only
    (default: the slot written with the `transformer` prefix), renamed by `native_names` (the family's
    `lora_native_names`, e.g. FLUX's BFL names) where given; `"reference"`: `<path>.lora_A/B.weight` in the
    reference's module names (`reference_names`, the family's `lora_reference_names`), alpha folded as diffusers'.
    """
    from ..version import __version__

    if denoiser is None:
        denoiser = next((n for n in state_dicts if ((prefixes or {}).get(n) or component_prefix(n)) == "transformer"),
                        None)
    problem = lora_layout_problem(layout, state_dicts, denoiser, prefixes, reference=reference_names is not None)
    if problem:
        raise UserError(f"{path}: {problem}")
    tensors: dict[str, torch.Tensor] = {}
    adapter_meta: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    for name, sd in state_dicts.items():
        prefix = (prefixes or {}).get(name) or component_prefix(name)
        sd = canonical_lora_keys(sd)
        spec = _config_spec(configs[name], sd)
        alphas = _module_alphas(spec, sd)
        ours[prefix] = {"model": name, "rank": spec["r"], "alpha": spec["lora_alpha"], "layout": layout,
                        "alpha_folded": layout in ("diffusers", "reference"),
                        **{k: v for k, v in spec.items() if k not in ("r", "lora_alpha")}}
        if layout in ("comfyui", "kohya"):
            if native_names is not None:
                sd, alphas = native_names(sd, alphas)
                ours[prefix]["names"] = "native"
            write = to_comfyui if layout == "comfyui" else to_kohya
            tensors.update(write(sd, alphas, prefix=_DENOISER_PREFIX[layout]))
            continue
        for p in _module_paths(sd):
            scale = alphas[p] / sd[f"{p}.lora_A.weight"].shape[0]
            if scale != 1.0:
                sd[f"{p}.lora_B.weight"] = sd[f"{p}.lora_B.weight"] * scale
        if layout == "reference":
            sd, _ = reference_names(sd, alphas)
            ours[prefix]["names"] = "reference"
            tensors.update(sd)
            continue
        tensors.update({f"{prefix}.{k}": v for k, v in sd.items()})
        folded = {**spec, "lora_alpha": float(spec["r"]), "alpha_pattern": dict(spec["rank_pattern"])}
        adapter_meta.update({f"{prefix}.{k}": v for k, v in folded.items() if k != "exclude_modules"})
    metadata = {
        "format": "pt",
        DIFFTUNE_METADATA_KEY: json.dumps({"version": 1, "difftune_version": __version__, "components": ours,
                                           "base_model": dict(base_info or {})}, sort_keys=True, default=str),
    }
    if layout == "kohya":  # the training metadata kohya's trainer writes, which A1111, Forge and Civitai show
        spec = ours[next(iter(ours))]
        metadata.update({"ss_network_module": "networks.lora", "ss_network_dim": str(spec["rank"]),
                         "ss_network_alpha": str(spec["alpha"]), "ss_training_comment": "trained with difftune"})
        if (base_info or {}).get("kohya_model_version"):
            metadata["ss_base_model_version"] = str(base_info["kohya_model_version"])
    if adapter_meta:  # only for the diffusers layout: diffusers would apply it on top of the .alpha tensors
        metadata[ADAPTER_METADATA_KEY] = json.dumps(adapter_meta, indent=2, sort_keys=True)
    return write_safetensors(path, tensors, metadata)


def _alpha_for(alpha: float | Mapping[str, float], path: str) -> float:
    return float(alpha[path] if isinstance(alpha, Mapping) else alpha)


def to_comfyui(state_dict: Mapping[str, torch.Tensor], alpha: float | Mapping[str, float],
               prefix: str = "diffusion_model.") -> dict[str, torch.Tensor]:
    """A DiT LoRA in ComfyUI's layout: `diffusion_model.<path>.lora_A/B.weight` + a `.alpha` tensor per module."""
    sd = canonical_lora_keys(state_dict)
    out: dict[str, torch.Tensor] = {}
    for path in _module_paths(sd):
        out[f"{prefix}{path}.lora_A.weight"] = sd[f"{path}.lora_A.weight"]
        out[f"{prefix}{path}.lora_B.weight"] = sd[f"{path}.lora_B.weight"]
        out[f"{prefix}{path}.alpha"] = torch.tensor(_alpha_for(alpha, path), dtype=torch.float32)
    return out


def to_kohya(state_dict: Mapping[str, torch.Tensor], alpha: float | Mapping[str, float],
             prefix: str = "lora_unet_") -> dict[str, torch.Tensor]:
    """A DiT LoRA in kohya's layout: `lora_unet_<path, dots as _>.lora_down/lora_up.weight` + `.alpha`."""
    sd = canonical_lora_keys(state_dict)
    out: dict[str, torch.Tensor] = {}
    for path in _module_paths(sd):
        flat = prefix + path.replace(".", "_")
        out[f"{flat}.lora_down.weight"] = sd[f"{path}.lora_A.weight"]
        out[f"{flat}.lora_up.weight"] = sd[f"{path}.lora_B.weight"]
        out[f"{flat}.alpha"] = torch.tensor(_alpha_for(alpha, path), dtype=torch.float32)
    return out


# -- import ---------------------------------------------------------------------------------------------

@dataclass
class ImportedLora:
    """A LoRA file read into canonical form.

    `components`: prefix (`transformer`, `text_encoder`, or `""` for unprefixed keys) -> canonical state
    dict. `alphas`: prefix -> module path -> alpha (rank where the file stores none: scale 1, as diffusers
    and the reference use it). `targets`: prefix -> target_modules (from metadata, else the module paths).
    Components in `unresolved` still carry kohya's flattened names; they are matched against the model's
    module names when the LoRA is loaded or fused.
    """

    source: str
    layout: str
    components: dict[str, dict[str, torch.Tensor]]
    alphas: dict[str, dict[str, float]]
    targets: dict[str, list[str]]
    alpha_source: str
    info: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, dict[str, str]] = field(default_factory=dict)  # prefix -> path -> a key as in the file
    unresolved: frozenset[str] = frozenset()

    def ranks(self, component: str | None = None) -> dict[str, int]:
        key = self.select(component)
        return {p: self.components[key][f"{p}.lora_A.weight"].shape[0] for p in _module_paths(self.components[key])}

    def select(self, component: str | None = None) -> str:
        """The component key for a pipeline slot or prefix (None: the only one)."""
        prefix = component_prefix(component)
        if prefix is not None and prefix in self.components:
            return prefix
        if "" in self.components and (prefix is None or len(self.components) == 1):
            return ""
        if prefix is None and len(self.components) == 1:
            return next(iter(self.components))
        have = ", ".join(k or "(unprefixed)" for k in self.components)
        what = f"for {component}" if component else "without naming the model (it has several)"
        raise UserError(f"{self.source}: no LoRA {what} in this file (it holds: {have})")

    def config(self, component: str | None = None) -> dict[str, Any]:
        """LoraConfig fields reproducing this LoRA exactly (common rank/alpha + per-module patterns)."""
        key = self.select(component)
        ranks, alphas = self.ranks(key), self.alphas[key]
        r = Counter(ranks.values()).most_common(1)[0][0]
        a = Counter(alphas.values()).most_common(1)[0][0]
        return {"r": r, "lora_alpha": a, "target_modules": list(self.targets[key]),
                # anchored at the start: peft matches a pattern as a suffix, so a bare `proj_out` would also
                # take every `single_transformer_blocks.N.proj_out`
                "rank_pattern": {"^" + re.escape(p): v for p, v in ranks.items() if v != r},
                "alpha_pattern": {"^" + re.escape(p): v for p, v in alphas.items() if v != a}}

    def resolved(self, module: nn.Module, component: str | None = None) -> ImportedLora:
        """This LoRA with kohya names replaced by `module`'s module names, checked to fit `module`."""
        key, fitted = _fit(self, module, component)
        new = {old: real for old, (real, *_rest) in fitted.items()}
        sd = {}
        for real, a, b, _ in fitted.values():
            sd[f"{real}.lora_A.weight"], sd[f"{real}.lora_B.weight"] = a, b
        return replace(
            self, components={**self.components, key: sd},
            alphas={**self.alphas, key: {real: al for real, _, _, al in fitted.values()}},
            keys={**self.keys, key: {new[p]: k for p, k in self.keys.get(key, {}).items()}},
            targets={**self.targets, key: [new.get(t, t) for t in self.targets[key]]},
            unresolved=self.unresolved - {key})


def _find_file(path: Path) -> Path:
    if path.is_dir():
        for name in ("pytorch_lora_weights.safetensors", "adapter_model.safetensors"):
            if (path / name).is_file():
                return path / name
        found = sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            raise UserError(f"{path}: expected one .safetensors LoRA file in this folder, found {len(found)}")
        return found[0]
    if not path.is_file():
        raise UserError(f"{path}: no such LoRA file")
    return path


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UserError(f"{path}: pickled checkpoints are refused (they can run code); convert it to .safetensors")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a safetensors file ({first_line(e)});"
                        " LoRAs are read from .safetensors only") from None
    return tensors, metadata


def _json_meta(path: Path, metadata: Mapping[str, str], key: str) -> dict[str, Any]:
    raw = metadata.get(key)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        raise UserError(f"{path}: its '{key}' metadata is not valid JSON") from None
    return value if isinstance(value, dict) else {}


def _split_prefix(path: str, family_prefixes: Iterable[str] = ()) -> tuple[str, str, str, bool]:
    path = path.removeprefix("base_model.model.")  # PeftModel.save_pretrained
    known = tuple((f"{p}.", p, "diffusers", False) for p in family_prefixes
                  if p and not any(q == f"{p}." for q, *_ in _PREFIXES))
    for prefix, component, layout, flat in known + _PREFIXES:
        if path.startswith(prefix):
            return component, path[len(prefix):], layout, flat
    return "", path, "peft", False


def _adapter_config(path: Path, comp_meta: dict[str, dict], components: Iterable[str]) -> None:
    # PEFT's adapter_model.safetensors keeps its LoraConfig beside it, in adapter_config.json.
    cfg = path.with_name("adapter_config.json")
    if "" in components and "" not in comp_meta and cfg.is_file():
        try:
            comp_meta[""] = json.loads(cfg.read_text())
        except json.JSONDecodeError:
            raise UserError(f"{cfg}: not valid JSON") from None


# alpha / rank above this is no LoRA anyone trained (1e30 overflowed to a non-finite loss, far from the file)
MAX_ALPHA_PER_RANK = 1e4


def _shown(value) -> str:
    try:
        return f"{float(value):g}"
    except (TypeError, ValueError):
        return repr(value)


def _alpha_problem(alpha: float, rank: int) -> str | None:
    """Why a LoRA module's alpha cannot be trained or applied (None: it can): as `--lora_alpha`, a positive finite
    number, and at most MAX_ALPHA_PER_RANK x the rank."""
    if not math.isfinite(alpha) or alpha <= 0:
        return f"alpha {alpha:g}: a LoRA's alpha must be a positive finite number, as --lora_alpha"
    if alpha / rank > MAX_ALPHA_PER_RANK:
        return (f"alpha {alpha:g} at rank {rank} (a scale of {alpha / rank:g}, at most {MAX_ALPHA_PER_RANK:g} is "
                f"taken): no trained LoRA has it")
    return None


def _folded_alphas(src: str, info: Mapping[str, Any], comp: str) -> tuple[float, dict] | None:
    """(trained alpha, alpha_pattern) of a component difftune saved with alpha folded into lora_B, else None."""
    comps = info.get("components") if isinstance(info, Mapping) else None
    ours = comps.get(comp) if isinstance(comps, Mapping) else None
    if not isinstance(ours, Mapping) or ours.get("alpha_folded") is not True:
        return None
    pattern = ours.get("alpha_pattern") or {}
    try:
        alpha = float(ours["alpha"])
        ok = isinstance(pattern, Mapping) and all(float(v) > 0 for v in pattern.values()) and alpha > 0
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"{src}: its '{DIFFTUNE_METADATA_KEY}' metadata says alpha was folded into lora_B but gives "
                        f"no valid alpha for '{comp}' (alpha {_shown(ours.get('alpha'))}; it must be a positive "
                        f"number, as --lora_alpha)")
    return alpha, dict(pattern)


def load_lora_file(path: str | os.PathLike, resolve_against: nn.Module | None = None,
                   component: str | None = None, prefixes: Iterable[str] = (),
                   converters: Iterable[Callable[[dict], dict | None]] = ()) -> ImportedLora:
    """Read a LoRA in any supported layout into canonical form.

    Layouts: difftune's and diffusers' (`transformer.` / `text_encoder.` prefixes, alpha from
    `lora_adapter_metadata`; difftune's folded alpha is divided back out of B), raw peft keys (alpha from an
    `adapter_config.json` beside the file), ComfyUI (`diffusion_model.` + `.alpha`), kohya
    (`lora_unet_..._to_q.lora_down/lora_up` + `.alpha`), SimpleTuner's LyCORIS LoRA (`lycoris_...`) and
    OneTrainer's (`lora_transformer_...`), both kohya-style, and
    the reference's (`...to_q.lora_A.default.weight`, no alpha: alpha = rank). With `resolve_against`, kohya
    names are resolved against that module's names and the LoRA is checked to fit it (`component`
    picks which part of the file, if it has several). Component prefixes beyond diffusers' are taken from
    `prefixes` (a family's `lora_prefixes` values) and from the file's own metadata. `converters` (a family's
    `lora_converters`) may translate a family-specific layout (e.g. FLUX's fused-qkv kohya LoRAs) into the
    diffusers layout first: each takes the file's tensors and returns the translation, or None to pass.
    """
    path = _find_file(Path(path))
    tensors, metadata = _read(path)
    for key, value in tensors.items():
        problem = non_finite(value)
        if problem:  # a NaN alpha or weight would surface only as a non-finite loss
            raise UserError(f"{path}: tensor '{key}' holds {problem}")
    for convert in converters:
        try:
            converted = convert(dict(tensors))
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
        if converted is not None:
            tensors = converted
            break
    adapter_meta = _json_meta(path, metadata, ADAPTER_METADATA_KEY)
    info = _json_meta(path, metadata, DIFFTUNE_METADATA_KEY)
    prefixes = {*prefixes, *(info.get("components") or {}), *(k.rpartition(".")[0] for k in adapter_meta)}
    src = str(path)
    parts: dict[str, dict[str, dict[str, Any]]] = {}
    layouts: set[str] = set()
    flat_components: set[str] = set()
    lora_keys = [k for k in tensors if _WEIGHT_KEY.match(k)]
    if not lora_keys:
        example = next(iter(tensors), "(the file is empty)")
        raise UserError(f"{src}: not a LoRA file (no lora_A/lora_B or lora_down/lora_up keys; e.g. '{example}')")
    for key, value in tensors.items():
        m = _WEIGHT_KEY.match(key) or _ALPHA_KEY.match(key)
        if m is None:
            raise UserError(f"{src}: unsupported key '{key}' (only lora_A/lora_B, lora_down/lora_up and .alpha "
                            "weights of Linear layers are supported)")
        comp, mpath, layout, flat = _split_prefix(m["path"], prefixes)
        kind = m.groupdict().get("kind") or "alpha"
        if m.groupdict().get("adapter") and layout == "peft":
            layout = "reference"  # peft parameter names with the adapter name left in
        layouts.add(layout)
        if flat:
            flat_components.add(comp)
        entry = parts.setdefault(comp, {}).setdefault(mpath, {})
        slot = {"lora_A": "A", "lora_down": "A", "lora_B": "B", "lora_up": "B"}.get(kind, "alpha")
        if slot in entry:
            raise UserError(f"{src}: '{key}' duplicates another key for module '{mpath}' (several adapters?)")
        entry[slot] = value
        if slot == "A":
            entry["key"] = key

    comp_meta: dict[str, dict] = {}
    for k, v in adapter_meta.items():
        comp, _, field_name = k.rpartition(".")
        comp_meta.setdefault(comp, {})[field_name] = v
    _adapter_config(path, comp_meta, parts)

    components: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, dict[str, float]] = {}
    targets: dict[str, list[str]] = {}
    keys: dict[str, dict[str, str]] = {}
    sources: set[str] = set()
    for comp, modules in parts.items():
        meta = comp_meta.get(comp, {})
        if meta.get("use_dora"):
            raise UserError(f"{src}: DoRA LoRAs are not supported")
        trained = _folded_alphas(src, info, comp)
        sd, al, kk = {}, {}, {}
        for mpath, entry in sorted(modules.items()):
            if "A" not in entry or "B" not in entry:
                have = "lora_A" if "A" in entry else "lora_B" if "B" in entry else "only an alpha"
                raise UserError(f"{src}: module '{mpath}' has {have} but not both lora_A and lora_B")
            a, b = entry["A"], entry["B"]
            # a Linear's LoRA (2-D A and B), or a convolution's (LoCon: A of the kernel's shape, B 1x1)
            conv = a.ndim == b.ndim and 3 <= a.ndim <= 5 and all(side == 1 for side in b.shape[2:])
            if not (a.ndim == b.ndim == 2 or conv) or a.shape[0] != b.shape[1]:
                raise UserError(f"{src}: '{entry['key']}' is not a Linear or convolution LoRA (lora_A "
                                f"{tuple(a.shape)}, lora_B {tuple(b.shape)})")
            rank = a.shape[0]
            if "alpha" in entry:
                alpha, how = float(entry["alpha"].float().item()), "alpha tensors"
            elif meta.get("lora_alpha") is not None:
                want = _pattern_value(meta.get("rank_pattern") or {}, mpath, meta.get("r", rank))
                if int(want) != rank:
                    raise UserError(f"{src}: metadata says rank {want} for '{mpath}' but its lora_A has {rank} rows")
                alpha, how = float(_pattern_value(meta.get("alpha_pattern") or {}, mpath, meta["lora_alpha"])), \
                    "metadata"
                if meta.get("use_rslora"):  # scale alpha/sqrt(r) == (alpha*sqrt(r))/r
                    alpha *= math.sqrt(rank)
            else:
                alpha, how = float(rank), "none stored: alpha = rank"
            if trained is not None and "alpha" not in entry:
                # difftune folded alpha/rank into B on save: give back the trained B and alpha
                alpha, how = float(_pattern_value(trained[1], mpath, trained[0])), "metadata (unfolded from lora_B)"
                if alpha != rank:
                    b = b.float() / (alpha / rank)
            problem = _alpha_problem(alpha, rank)
            if problem:  # it trained and saved as it was, or overflowed into a non-finite loss later
                raise UserError(f"{src}: module '{mpath}' has {problem} (from its {how})")
            sources.add(how)
            sd[f"{mpath}.lora_A.weight"] = a.float().contiguous()
            sd[f"{mpath}.lora_B.weight"] = b.float().contiguous()
            al[mpath] = alpha
            kk[mpath] = entry["key"]
        components[comp], alphas[comp], keys[comp] = sd, al, kk
        targets[comp] = _names(meta.get("target_modules")) or sorted(al)

    if info and layouts == {"diffusers"}:
        layouts = {"difftune"}
    imported = ImportedLora(source=src, layout="+".join(sorted(layouts)), components=components, alphas=alphas,
                            targets=targets, alpha_source=", ".join(sorted(sources)), info=info, keys=keys,
                            unresolved=frozenset(flat_components))
    if resolve_against is not None:
        imported = imported.resolved(resolve_against, component)
    return imported


def _kohya_index(module: nn.Module) -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for name, m in module.named_modules():
        if name and not _is_peft_internal(name) and _linear_of(m) is not None:
            index.setdefault(name.replace(".", "_"), []).append(name)
    return index


def _fit(imported: ImportedLora, module: nn.Module, component: str | None):
    """Match the LoRA to `module`: (component key, {path in file: (module path, A, B, alpha)}).

    UserError when the LoRA is for another model (a module is missing or has other shapes).
    """
    key = imported.select(component)
    sd, alphas, orig = imported.components[key], imported.alphas[key], imported.keys.get(key, {})
    index = _kohya_index(module) if key in imported.unresolved else None
    what = f"{type(module).__name__}" + (f" ({component})" if component else "")
    fitted: dict[str, tuple[str, torch.Tensor, torch.Tensor, float]] = {}
    missing: list[str] = []
    for path in _module_paths(sd):
        a, b = sd[f"{path}.lora_A.weight"], sd[f"{path}.lora_B.weight"]
        real = path
        if index is not None:
            found = index.get(path, [])
            if len(found) > 1:
                raise UserError(f"{imported.source}: kohya name '{orig.get(path, path)}' is ambiguous in {what} "
                                f"({', '.join(found)})")
            real = found[0] if found else None
        try:
            linear = _linear_of(module.get_submodule(real)) if real else None
        except AttributeError:
            linear = None
        if linear is None:
            missing.append(path)
            continue
        sides = layer_sides(linear)
        if a.shape[1] != sides[0] or b.shape[0] != sides[1] or a.shape[2:] != linear.weight.shape[2:] \
                or a.dim() != linear.weight.dim():
            raise UserError(f"{imported.source}: LoRA key '{orig.get(path, path)}' has shapes A {tuple(a.shape)}, "
                            f"B {tuple(b.shape)} but '{real}' of {what} is {type(linear).__name__}({sides[0]} -> "
                            f"{sides[1]}); is this a LoRA for another model?")
        fitted[path] = (real, a, b, alphas[path])
    if missing:
        raise UserError(f"{imported.source}: {len(missing)} of {len(sd) // 2} LoRA modules match no Linear layer "
                        f"of {what} (e.g. key '{orig.get(missing[0], missing[0])}'); is this a LoRA for another "
                        f"model?")
    return key, fitted


