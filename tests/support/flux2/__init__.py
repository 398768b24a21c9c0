"""Test support for the FLUX.2 family: tiny models at the hub ids the reference's scripts name (`tiny.py`). Importing
it registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
