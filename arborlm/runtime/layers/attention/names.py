"""The attention backends by name: the one list both processes read.

`runtime/config.py` (imported by the HTTP front process, which must not import
torch) validates `attention_backend` against `ATTENTION_BACKEND_NAMES`;
`factory.create_attention_backend` imports the class a name points to. A new
backend is one module in this package plus one line here. No torch import here.
"""

from __future__ import annotations

from types import MappingProxyType

AUTO = "auto"  # Triton on CUDA where it runs, torch elsewhere (see `factory.resolve_name`)

# name -> "module:Class", imported on first use.
ATTENTION_BACKENDS = MappingProxyType({
    "triton": "arborlm.runtime.layers.attention.triton_backend:TritonAttentionBackend",
    "torch": "arborlm.runtime.layers.attention.torch_native_backend:TorchAttentionBackend",
    "reference": "arborlm.runtime.layers.attention.reference_backend:ReferenceAttentionBackend",
})

# Every name `attention_backend` accepts, "auto" first.
ATTENTION_BACKEND_NAMES: tuple[str, ...] = (AUTO, *ATTENTION_BACKENDS)
