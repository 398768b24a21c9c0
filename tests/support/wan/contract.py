"""The Wan family's tiny models for the contract suite (T2V, with the I2V / TI2V variants and the variants with models
of their own), registered when the family's support package is imported."""

from __future__ import annotations

from pathlib import Path

from ..common import TinyFamily, TinyVariant, register_tiny, write_example_dataset
from .tiny import tiny_wan_paths, write_tiny_wan
from .variants_b import variants_b


def _tiny_wan(folder: Path) -> TinyFamily:
    from difftune.families.wan.components import LORA_TARGET_MODULES

    paths = tiny_wan_paths(write_tiny_wan(folder / "repo", "t2v"))
    entries = [p if len(p) > 1 else p[0] for p in paths.values()]
    def with_input_image(root):
        meta = write_example_dataset(root, n=2, size=(48, 32))  # a still is a one-frame clip: its first frame
        lines = meta.read_text().splitlines()
        meta.write_text("\n".join([lines[0] + ",input_image"] + [f"{ln},{ln.split(',')[0]}" for ln in lines[1:]]))
        return meta

    def repo(variant):
        return lambda: [p if len(p) > 1 else p[0]
                        for p in tiny_wan_paths(write_tiny_wan(folder / variant, variant)).values()]

    image_to_video = {name: TinyVariant(flags=("--extra_inputs", "input_image"), write_dataset=with_input_image,
                                        model_paths=repo(name)) for name in ("i2v", "ti2v")}
    return TinyFamily(model_paths=entries, lora_base_model="dit", lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(48, 32)),
                      flags=("--max_pixels", "4096"),
                      # a second expert, CLIP and the variants' own models: not in the T2V repository
                      optional_slots=("dit2", "image_encoder", "vace", "vace2", "animate_adapter", "motion_controller",
                                      "audio_encoder", "vap"),
                      trainable_cases={"umt5_lora": ("--lora_base_model", "text_encoder", "--lora_target_modules",
                                                     "q,v")},
                      variants={**image_to_video, **variants_b(folder)})


register_tiny("wan", _tiny_wan)
