"""Layers whose weights stay quantized as the checkpoint ships them (GGUF today).

`quant_linear` holds `QuantizedLinear` / `QuantizedEmbedding` (the same seams as
`layers/linear.py` and `layers/vocab_embedding.py`, over `kernels/quant_ops.py`);
`gguf_file` reads a GGUF file's tensor table and bytes, `gguf_names` maps
llama.cpp's names and row order back to Hugging Face's, and `gguf_loader` installs
the quantized layers in a built model and fills it (`quantization="gguf"`).
"""
