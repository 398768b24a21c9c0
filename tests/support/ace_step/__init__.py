"""Test support for the ACE-Step 1.5 family: tiny models in the release's layouts (`tiny.py`). Importing it
registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .scripts import write_ace_step_script_workspace  # noqa: F401
