"""The release of deepsolve (read by the build from here: ``pyproject.toml``)."""

__version__ = "0.1.0"
