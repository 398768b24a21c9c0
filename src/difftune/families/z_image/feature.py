"""What a Z-Image feature adds to the core `Feature`: how its inputs of a call become values for its units and
settings for its part of the denoiser call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.features import Feature


class ZImageFeature(Feature):
    def call_values(self, given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Its inputs of a call (`given`, by the reference's names) -> (values, denoiser-call settings); by default
        the inputs as given."""
        return {name: given.get(name) for name in self.call_inputs}, {}


__all__ = ["ZImageFeature"]
