"""Toy families, each one package module with no edit outside it: the image family docs/adding_a_family.md walks
through (`toy`, toy_family.py), and the other targets: audio (`toy_audio`), a clip with its sound track (`toy_av`:
two streams, one loss each), and epsilon- / v-prediction images (`toy_eps`, `toy_v`). Importing this package
registers them and their tiny models (the contract suite's registry)."""

from . import audio, joint, prediction, toy_family  # noqa: F401
