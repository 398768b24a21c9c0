"""Tiny, deterministic FLUX.1 variant models in the released layouts and file names the reference's scripts name
(ControlNets, Fill, Redux, IP-Adapter + SigLIP, InfiniteYou), sized to `difftune.testing.flux.TinyFluxSpec`."""

from .runner import UnitPipe, run_unit_on, with_config
from .variants import (TINY_CONTROLNETS, tiny_controlnet_config, write_tiny_controlnet, write_tiny_fill_dit,
                       write_tiny_image_proj, write_tiny_ipadapter, write_tiny_redux, write_tiny_siglip)

__all__ = ["TINY_CONTROLNETS", "UnitPipe", "run_unit_on", "with_config", "tiny_controlnet_config", "write_tiny_controlnet", "write_tiny_fill_dit",
           "write_tiny_image_proj", "write_tiny_ipadapter", "write_tiny_redux", "write_tiny_siglip"]
