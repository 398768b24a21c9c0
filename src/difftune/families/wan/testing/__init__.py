"""Test support for the Wan family: tiny repositories in the diffusers layout (`tiny.py`) and in Wan-AI's original
files (`original.py`). Importing it registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .original import *  # noqa: F401,F403
