"""llama.cpp's tensor names and row order, mapped back to the Hugging Face checkpoint's.

llama.cpp's `convert_hf_to_gguf.py` renames every tensor (`model.layers.0.self_attn.q_proj.weight`
-> `blk.0.attn_q.weight`) and, for the `llama` architecture only, permutes the rows
of q and k so that rotary pairs are adjacent (`LlamaModel.permute`). The quantized
loader (`gguf_loader.py`) reads the tensors as stored and uses `hf_name` and
`hf_row_order` to put them where our models (which follow Hugging Face's names and
row order) expect them; transformers' GGUF reader does the same
(`modeling_gguf_pytorch_utils.py`, `TENSOR_NAME_MAP`, `LlamaTensorProcessor`).
Covers the Llama-style decoders whose GGUF files use llama.cpp's standard names.
"""

from __future__ import annotations

import numpy as np

# GGUF architectures whose tensors this table names (llama.cpp's names for the
# Llama, Mistral, Qwen2 and Qwen3 decoders).
QUANTIZED_ARCHS = ("llama", "qwen2", "qwen3")

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors our models compute themselves (Llama 3's rotary frequency factors).
_IGNORED = ("rope_freqs",)


def is_ignored(gguf_name: str) -> bool:
    """Whether the loader skips this tensor (recomputed by our models)."""
    return gguf_name.split(".")[0] in _IGNORED


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for a name not in the table.

    "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight",
    "token_embd.weight" -> "model.embed_tokens.weight".
    """
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_LEVEL:
        return f"{_TOP_LEVEL[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{parts[3]}"
    return None


def hf_row_order(gguf_name: str, architecture: str, num_rows: int, hf_config) -> np.ndarray | None:
    """The GGUF rows that make the Hugging Face tensor, in order; None when they are the same.

    llama.cpp permutes q and k of `llama` files: per head, HF rows
    (half 0: 0..d/2-1, half 1: d/2..d-1) are stored interleaved (0, d/2, 1, d/2+1, ...).
    Undoing it is `reshape(heads, d/2, 2).swapaxes(1, 2)` on the row index, as
    transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    if architecture != "llama":
        return None
    part = gguf_name.split(".")
    if len(part) != 4 or part[2] not in ("attn_q", "attn_k"):
        return None
    heads = hf_config.num_attention_heads
    if part[2] == "attn_k":
        heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return np.arange(num_rows).reshape(heads, num_rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
