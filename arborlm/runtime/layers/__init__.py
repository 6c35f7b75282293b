"""Layers shared by the model families: attention backends over the paged KV pool."""
