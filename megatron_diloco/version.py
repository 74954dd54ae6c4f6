"""The package's version (a leaf module: what reads it imports nothing else of the package)."""

__version__ = "0.1.0"
