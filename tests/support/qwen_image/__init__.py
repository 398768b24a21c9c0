"""Test support for the Qwen-Image family: tiny repositories in the official layouts (`tiny.py`) and the workspace
every reference script runs in (`scripts.py`). Importing it registers the family's tiny models for the contract
suite."""

from .tiny import *  # noqa: F401,F403
from .scripts import write_qwen_image_script_workspace  # noqa: F401
