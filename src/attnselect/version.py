"""attnselect's version (read by the build and by calibrations, which hold per version)."""

__version__ = "0.1.0"
