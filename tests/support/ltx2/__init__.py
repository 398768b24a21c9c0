"""Test support for the LTX-2 family: tiny models in the layouts users download (`tiny.py`)."""
