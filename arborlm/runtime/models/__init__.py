"""Model implementations over the paged KV layout, one file per family.

`registry.py` maps checkpoint architecture names (config.json, GGUF) to the class
that serves them; `base.CausalLM` is what such a class provides. This `__init__`
imports nothing, so the registry can be read without importing torch.
"""
