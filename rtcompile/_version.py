"""The package version, defined here only: modules below the CLI import it from here, never
from the package root (which would load the public API, and torch with it, from inside it)."""

__version__ = "0.2.0"
