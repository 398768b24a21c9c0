"""Test support for the Krea-2 family: tiny models at the hub ids the reference's scripts name (`tiny.py`).
Importing it registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .scripts import write_krea2_script_workspace  # noqa: F401
