"""Tiny models of the Wan variants in the layouts their released files have (file and key names), written
deterministically, for tests: VACE, Fun-Control / Control-Camera, Animate, Animate-2, speed control."""
