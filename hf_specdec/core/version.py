"""The package version, in one place (plan files and benchmark reports record it)."""

__version__ = "0.1.0"
