"""The package version (one place: setup.cfg reads it, hf_cascade and diagnostics re-export it)."""
__version__ = "0.1.0"
