"""Model families: one package each, registered by the `FamilySpec` in its `__init__.py` (see core/family.py)."""
