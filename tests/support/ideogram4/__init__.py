"""Test support for the Ideogram-4 family: tiny models at the hub ids the reference's scripts name. Importing it
registers the family's tiny models for the contract suite."""

from .tiny import *  # noqa: F401,F403
