"""Test support for the Wan family: tiny repositories in the diffusers layout (`tiny.py`) and in Wan-AI's original
files (`original.py`), and tiny models of the variants in the layouts the reference's scripts name (s2v, dancer,
longcat, vap). Importing it registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
from .original import *  # noqa: F401,F403
from .s2v import *  # noqa: F401,F403
from .dancer import *  # noqa: F401,F403
from .longcat import *  # noqa: F401,F403
from .vap import *  # noqa: F401,F403
from .variant_data import *  # noqa: F401,F403
