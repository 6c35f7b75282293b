"""llama.cpp's tensor names and row order, mapped back to the Hugging Face checkpoint's.

llama.cpp's `convert_hf_to_gguf.py` renames every tensor (`model.layers.0.self_attn.q_proj.weight`
-> `blk.0.attn_q.weight`) and, for the `llama` architecture only, permutes the rows
of q and k so that rotary pairs are adjacent (`LlamaModel.permute`). The quantized
loader (`gguf_loader.py`) reads the tensors as stored and uses `hf_name` and
`hf_row_order` to put them where our models (which follow Hugging Face's names and
row order) expect them; transformers' GGUF reader does the same
(`modeling_gguf_pytorch_utils.py`, `TENSOR_NAME_MAP`, `LlamaTensorProcessor`).
Covers the decoders whose GGUF files use llama.cpp's standard names: Llama,
Mistral, Qwen2, Qwen3, Mixtral (a "llama" file with experts), Qwen3-MoE, Gemma 3
(its own norm names; norms stored as 1 + weight, undone by `hf_values` as
transformers' `Gemma2TensorProcessor` does) and Phi-3 (q/k/v fused as `attn_qkv`,
gate/up as `ffn_up`, which are our fused `qkv_proj` / `gate_up_proj` as they are).
MoE experts come stacked, one 3-D tensor per projection (`ffn_gate_exps`, ...):
`expert_tensor` names the sparse block and the projection they fill.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from arborlm.runtime.layers.moe import DOWN, GATE, UP

# GGUF architectures whose tensors these tables name.
QUANTIZED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3")

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
    "ffn_gate_inp": "mlp.gate",  # a sparse block's router (Mixtral's block_sparse_moe.gate)
}
# Where an architecture's names differ from the table above.
_ARCH_PER_LAYER = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Stacked experts (E, out, in): llama.cpp name -> the expert projection they fill.
_EXPERTS = {"ffn_gate_exps": GATE, "ffn_up_exps": UP, "ffn_down_exps": DOWN}
# Per-expert checkpoint names our models' `load_weights` read, per projection: Mixtral's
# w1/w3/w2 (a "llama" file), else Qwen3-MoE's.
_EXPERT_HF_PROJ = {"mixtral": {GATE: "w1", UP: "w3", DOWN: "w2"},
                   "qwen3_moe": {GATE: "gate_proj", UP: "up_proj", DOWN: "down_proj"}}
# Tensors our models compute themselves or read from config.json (Llama 3's rotary
# frequency factors, Phi-3's LongRoPE factors, written there at conversion).
_IGNORED = ("rope_freqs", "rope_factors_long", "rope_factors_short")
_LAYER_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.(?P<kind>\w+)\.weight")


class ExpertTensor(NamedTuple):
    """A stacked expert tensor: the sparse block it belongs to ("model.layers.3.mlp")
    and the projection (`GATE` / `UP` / `DOWN` of `layers/moe.py`)."""

    block: str
    shard: str


def is_ignored(gguf_name: str) -> bool:
    """Whether the loader skips this tensor (recomputed by our models)."""
    return gguf_name.split(".")[0] in _IGNORED


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for a name not in the tables.

    "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight",
    "token_embd.weight" -> "model.embed_tokens.weight"; a stacked expert tensor
    -> "model.layers.3.mlp.experts.gate" (no checkpoint has it: `expert_tensor` says
    where it goes). `architecture` is the file's general.architecture.
    """
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_LEVEL:
        return f"{_TOP_LEVEL[parts[0]]}.{parts[1]}"
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    if parts[2] in _EXPERTS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.mlp.experts.{_EXPERTS[parts[2]]}"
    table = {**_PER_LAYER, **_ARCH_PER_LAYER.get(architecture, {})}
    if parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    return None


def expert_tensor(gguf_name: str) -> ExpertTensor | None:
    """Where a stacked expert tensor ("blk.3.ffn_up_exps.weight") goes; None for other tensors."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match["kind"] not in _EXPERTS:
        return None
    return ExpertTensor(f"model.layers.{match['layer']}.mlp", _EXPERTS[match["kind"]])


def expert_hf_names(expert: ExpertTensor, num_experts: int, model_type: str) -> list[str]:
    """The per-expert checkpoint names of a stacked tensor, expert by expert, as the
    family's `load_weights` reads them ("model.layers.3.mlp.experts.0.w3.weight" for
    Mixtral, "...experts.0.up_proj.weight" for Qwen3-MoE)."""
    proj = _EXPERT_HF_PROJ.get(model_type, _EXPERT_HF_PROJ["qwen3_moe"])[expert.shard]
    return [f"{expert.block}.experts.{e}.{proj}.weight" for e in range(num_experts)]


def hf_values(gguf_name: str, architecture: str, values: np.ndarray) -> np.ndarray:
    """A dequantized tensor as the Hugging Face checkpoint holds it: Gemma 3's norms
    are stored as the 1 + weight they scale by (llama.cpp's `Gemma3Model`), so 1 is
    taken off (transformers' `Gemma2TensorProcessor`); other tensors unchanged."""
    if architecture == "gemma3" and "norm" in gguf_name.split(".")[-2]:
        return values - 1
    return values


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
