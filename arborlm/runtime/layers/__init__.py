"""Layers shared by the model families, one responsibility per module.

`models/<family>.py` builds its decoder from these: `linear` (the projection seam
where quantized and tensor-parallel linears plug in), `layernorm`, `rotary_embedding`,
`mlp`, `vocab_embedding`, `radix_attention` (one layer's attention over the paged KV
pool) and `attention/` (the backends that attention runs on).

This package and `attention/` keep their `__init__` free of imports: the front
process reads `attention.names` without importing torch.
"""
