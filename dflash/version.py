"""The source tree's version (the installed package's metadata says the same: pyproject.toml)."""

__version__ = "0.1.0"
