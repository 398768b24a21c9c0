"""Test support for the SDXL family: tiny models at the hub id the reference's scripts name (`tiny.py`). Importing it
registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .scripts import write_sdxl_script_workspace  # noqa: F401
