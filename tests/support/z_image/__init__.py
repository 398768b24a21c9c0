"""Test support for the Z-Image family: tiny models at the hub ids the reference's scripts name (`tiny.py`) and the
workspace every Z-Image script runs in (`scripts.py`). Importing it registers the family's tiny models for the
contract suite."""

from .tiny import *  # noqa: F401,F403
from .scripts import write_z_image_script_workspace  # noqa: F401
