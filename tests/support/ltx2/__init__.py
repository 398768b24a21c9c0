"""Test support for the LTX-2 family: tiny models in the official, Repackage, JoyAI-Echo and Gemma-3 layouts
(`tiny.py`) and the reference scripts' workspace (`scripts.py`)."""

from .tiny import *  # noqa: F401,F403
from .scripts import write_ltx2_dataset, write_ltx2_script_workspace  # noqa: F401
