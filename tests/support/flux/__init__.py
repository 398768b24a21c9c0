"""Test support for the FLUX.1 family: tiny repositories in the diffusers and BFL layouts, and tiny variant models
(ControlNets, Fill, Redux, IP-Adapter + SigLIP, InfiniteYou, ...) in the released layouts and file names the
reference's scripts name. Importing it registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .tiny import _ldm_vae_from_diffusers  # noqa: F401
from .runner import UnitPipe, run_unit_on, with_config  # noqa: F401
from .variants import (TINY_CONTROLNETS, tiny_controlnet_config, write_tiny_controlnet,  # noqa: F401
                       write_tiny_fill_dit, write_tiny_image_proj, write_tiny_ipadapter, write_tiny_redux,
                       write_tiny_siglip)
from .scripts import tiny_known_configs, write_flux_script_workspace  # noqa: F401
from .variants import tiny_dit, tiny_dit_config, write_tiny_bfl_dit  # noqa: F401
from . import contract  # noqa: F401,E402  (registers the family's tiny models, variants included)
