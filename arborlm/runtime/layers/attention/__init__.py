"""Attention backends: how a layer's attention reads and writes the paged KV pool.

`base.AttentionBackend` states the contract; each backend is one module
(`torch_native_backend`, `triton_backend`, `reference_backend`) over the plain-tensor
kernels of `arborlm/kernels/`; `names` lists them (torch-free, read by
`runtime/config.py`) and `factory.create_attention_backend` builds one by name.

Keep this file free of imports: the front process imports `names` through it.
"""
