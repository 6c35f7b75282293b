"""The package version, at ground level so that any module can read it without importing the DSL."""

__version__ = "0.1.0"
