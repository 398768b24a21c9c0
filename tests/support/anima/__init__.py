"""Test support for the Anima family: tiny models in circlestone-labs/Anima's ComfyUI split-file layout and tiny
tokenizers at the hub ids the reference's scripts name (`tiny.py`). Importing it registers the family's tiny models
for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .scripts import write_anima_script_workspace  # noqa: F401
