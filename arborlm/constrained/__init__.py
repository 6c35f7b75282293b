"""Grammar-constrained decoding (to be built: issue 3)."""
