"""Test support for the Wan family: tiny repositories in the diffusers layout (`tiny.py`) and in Wan-AI's original
files (`original.py`); tiny models of the variants in the layouts their released files have (file and key names):
FLF2V / Fun-InP, VACE, Fun-Control / Control-Camera, Animate, Animate-2, speed control, S2V, Wan-Dancer,
LongCat-Video, Video-As-Prompt. Importing it registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .original import *  # noqa: F401,F403
from .s2v import *  # noqa: F401,F403
from .dancer import *  # noqa: F401,F403
from .longcat import *  # noqa: F401,F403
from .vap import *  # noqa: F401,F403
from .variant_data import *  # noqa: F401,F403
from .scripts import write_wan_script_workspace  # noqa: F401
from . import contract  # noqa: F401,E402  (registers the family's tiny models, variants included)
