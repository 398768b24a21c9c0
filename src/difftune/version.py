"""The package version (its own module, so the modules that stamp files with it import nothing above them)."""

__version__ = "0.1.0"
