"""What every family's tiny repositories share: quiet hub libraries, an offline hub, example data sets,
and the registry the family contract suite reads (`register_tiny`)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from difftune.example import write_example_dataset  # noqa: F401  (the product's own 4-image data set)


def quiet_hf():
    """diffusers and transformers print no warnings or progress bars (the tiny writers' saves and loads)."""
    import diffusers
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()


def populate_offline_hub(model_base_path: str | os.PathLike, model_id: str, source: str | os.PathLike) -> Path:
    """Copy a repository into `<model_base_path>/<model_id>/`, where hub ids resolve without a download.

    This is where `ModelConfig(model_id=..., origin_file_pattern=...)` looks first
    (`DIFFTUNE_MODEL_BASE_PATH`, default `./models`).
    """
    dest = Path(model_base_path) / model_id
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    return dest


# -- tiny families for the family contract suite (tests/families/) -------------------------------------

@dataclass
class TinyFamily:
    """A tiny, randomly initialised set of one family's models plus what training them needs: the family
    contract suite runs every registered family from this (a new family registers one with `register_tiny`)."""

    model_paths: list  # --model_paths entries (a path, or a list of shard paths), one per model
    lora_base_model: str  # the denoiser's slot
    lora_target_modules: str
    # A small image data set in the reference's layout: folder -> metadata file.
    write_dataset: object = None
    flags: tuple = ()  # more flags every run needs (sizes, ...)
    # Other trainable sets to check split == one-stage on: name -> flags.
    trainable_cases: dict = field(default_factory=dict)
    # Slots only some runs fill (an add-on model such as a ControlNet): the tiny models may leave them empty.
    optional_slots: tuple = ()
    # The family's variants (its features and variant pipeline classes): name -> TinyVariant. The contract suite
    # trains each (one stage and split) and renders its validation.
    variants: dict = field(default_factory=dict)
    # How far one stage and split may differ on a saved tensor (fp32). Adam's first steps divide each gradient by
    # its own magnitude, so where a gradient is ~1e-8 a rounding difference in it moves that weight by a part of lr.
    split_tolerance: float = 1e-5
    # A sampling call's size arguments (an image family's height and width; an audio family's seconds).
    call_args: dict = field(default_factory=lambda: {"height": 32, "width": 32})


@dataclass
class TinyVariant:
    """One variant of a tiny family: the flags that select it, and (where they differ from the family's) its data
    set writer and its models."""

    flags: tuple = ()
    write_dataset: object = None  # root -> metadata path; None: the family's
    model_paths: object = None  # a list, or a function that writes the variant's models and returns one; None: the
    # family's


_TINY: dict = {}


def register_tiny(family: str, make) -> None:
    """`make(folder) -> TinyFamily` writes the family's tiny models under `folder`."""
    _TINY[family] = make


def family_support_module(spec):
    """A family's test-support package (`support.<family name>`), imported (which registers its tiny models), or
    None if it has none."""
    import importlib

    name = f"{__package__}.{spec.name}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        return None


def tiny_family(family: str, folder: str | os.PathLike) -> TinyFamily:
    if family not in _TINY:
        from difftune.core.family import families

        spec = families().get(family)
        if spec is not None:
            family_support_module(spec)
    if family not in _TINY:
        raise KeyError(f"family {family!r} registers no tiny models for the contract suite "
                       f"(support.register_tiny)")
    return _TINY[family](Path(folder))


