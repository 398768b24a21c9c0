"""The Wan family's tests (a package, so their module names cannot clash with tests/ of the same basename)."""
