"""Model parts two or more families use: text encoders, autoencoders, EliGen's entity masks, a ControlNet's control
encode. A shared layer between the shared core and the families: families import it; it imports no family and
names none (no family package, pipeline class or flag; `tests/families/test_seam.py`). Its modules are named for the
architecture or the technique they hold (Qwen2.5-VL, Qwen3, the FLUX.1 AE), which is not a family.
"""
