"""What a FLUX.1 feature does around the denoise loop of a sampling call, beyond core's `Feature`: it may turn the
call's inputs into other features' inputs before the units run (Insert-Anything's diptych for Fill and Redux, the
reference's ControlNet inputs), fill in call defaults that differ from training's, check a training row's values,
and change the sampled images (Insert-Anything pastes its half back)."""

from __future__ import annotations

from typing import Any

from ...core.features import Feature


class FluxFeature(Feature):
    """A FLUX.1 feature. A subclass overrides what it needs; `unit_settings` names the run-time settings its units
    read (from the family's flags in training: never cached, not data); `attributes` are the pipeline's attributes
    its units read besides models (a processor, a face embedder), with their defaults."""

    unit_settings: tuple[str, ...] = ()
    attributes: dict[str, Any] = {}

    def prepare_call(self, pipe, values: dict[str, Any], cfg_scale: float, state: dict[str, Any]) -> None:
        """A sampling call's values, before the units run (in place; `state` is kept for `finish_images`)."""

    def training_values(self, values: dict[str, Any], where: str) -> None:
        """A training row's values (in place): its columns checked together, one line naming the row."""

    def finish_images(self, images, output_type: str, state: dict[str, Any]):
        """The call's output after decoding."""
        return images


__all__ = ["FluxFeature"]
