"""The runtime: everything that turns requests into tokens."""
