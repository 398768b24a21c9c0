"""Tiny models of the Wan variants in the layouts the reference's scripts name (file names, key names), for the
tests: deterministic, a few channels, 1-2 blocks."""
