"""The package version (its own module, so that no layer imports the package root to learn it)."""

__version__ = "0.1.0"
