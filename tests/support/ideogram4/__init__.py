"""Test support for the Ideogram-4 family: tiny models at the hub ids the reference's scripts name. Importing it
registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .scripts import write_ideogram4_script_workspace  # noqa: F401
