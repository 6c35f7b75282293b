"""Backends that run a program's generation calls."""
