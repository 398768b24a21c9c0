"""Test support for the FLUX.1 family: tiny repositories in the diffusers and BFL layouts. Importing it registers the
family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .tiny import _ldm_vae_from_diffusers  # noqa: F401
