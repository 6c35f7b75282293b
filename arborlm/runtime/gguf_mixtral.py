"""Convert a Mixtral GGUF file into a Mixtral checkpoint folder, without transformers' reader.

llama.cpp writes Mixtral as a "llama" file with experts (`convert_hf_to_gguf.py`'s
`LlamaModel`): q/k rows permuted for its rotary layout, each layer's experts stacked
into `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps` (older files: one
`ffn_gate.{e}` ... per expert) and the router as `ffn_gate_inp`. transformers' GGUF
reader builds a dense Llama from such a file and drops the experts, so `model_loader`
converts these here: the tokenizer through transformers (a llama tokenizer), the
config from `gguf_config.read_settings`, the weights dequantized with the `gguf`
package into Mixtral's Hugging Face names (`block_sparse_moe.experts.{e}.w1/w3/w2`),
one float32 safetensors shard per layer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.gguf_config import GGUFSettings
from arborlm.runtime.models.weight_utils import weight_progress

# llama.cpp tensor name -> Hugging Face name; {i} is the layer.
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
}
# q / k rows llama.cpp permutes, and the config field with their head count.
_PERMUTED_HEADS = {"blk.{i}.attn_q.weight": "num_attention_heads", "blk.{i}.attn_k.weight": "num_key_value_heads"}
_EXPERT_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}  # llama.cpp ffn_{proj} -> Mixtral's w*
_STACKED = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight")
_PER_EXPERT = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)\.(?P<expert>\d+)\.weight")
_LAYER = re.compile(r"blk\.(?P<layer>\d+)\.")


def convert_mixtral(gguf_file: Path, out_dir: Path, settings: GGUFSettings, progress: bool | None = False) -> None:
    """Write `out_dir`: tokenizer files, config.json (`settings.config`), float32 safetensors.

    Parameters
    ----------
    gguf_file: a "llama" GGUF file with experts (`settings.architecture` Mixtral).
    out_dir: an empty folder.
    settings: from `gguf_config.read_settings(gguf_file)`.
    progress: a bar of the shards written (`weight_utils.weight_progress`).

    Raises
    ------
    ModelLoadError
        For a tokenizer transformers cannot read, or a tensor that is no Mixtral weight.
    """
    from gguf import GGUFReader

    _save_tokenizer(gguf_file, out_dir)
    (out_dir / "config.json").write_text(json.dumps(settings.config, indent=2, sort_keys=True) + "\n")
    shards: dict[str, list] = {}
    for tensor in GGUFReader(str(gguf_file)).tensors:
        shards.setdefault(_shard_key(tensor.name), []).append(tensor)
    _save_shards(out_dir, shards, settings.config, progress)


def _save_tokenizer(gguf_file: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot convert the tokenizer of GGUF file {str(gguf_file)!r}: {exc}") from exc
    tokenizer.save_pretrained(out_dir)


def hf_weights(tensor, config: dict) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face (name, float32 tensor) pairs of one GGUF tensor of a Mixtral file.

    Parameters
    ----------
    tensor: a `gguf.ReaderTensor` (any GGML type; dequantized here).
    config: the Mixtral config.json dict (head counts, for the q/k permutation).

    Raises
    ------
    ModelLoadError
        For a tensor name that is no Mixtral weight (e.g. Llama 3's `rope_freqs`).
    """
    for pattern in (_STACKED, _PER_EXPERT):
        match = pattern.fullmatch(tensor.name)
        if match:
            return _expert_weights(tensor, match)
    return [_named_weight(tensor, config)]


def _expert_weights(tensor, match: re.Match) -> list[tuple[str, torch.Tensor]]:
    """Per-expert w1 / w3 / w2 weights of a stacked (E, out, in) or a single-expert tensor."""
    prefix = f"model.layers.{match['layer']}.block_sparse_moe.experts"
    proj = _EXPERT_PROJ[match["proj"]]
    weight = _dequantized(tensor)
    if "expert" in match.groupdict():
        return [(f"{prefix}.{match['expert']}.{proj}.weight", weight)]
    # A copy each: safetensors refuses to save views that share one storage.
    return [(f"{prefix}.{e}.{proj}.weight", expert.clone()) for e, expert in enumerate(weight)]


def _named_weight(tensor, config: dict) -> tuple[str, torch.Tensor]:
    """A weight of `_NAMES`, q and k with llama.cpp's row permutation undone."""
    layer = _LAYER.match(tensor.name)
    generic = tensor.name if layer is None else "blk.{i}." + tensor.name[layer.end():]
    if generic not in _NAMES:
        raise ModelLoadError(f"GGUF tensor {tensor.name!r} is not a weight of a Mixtral model")
    weight = _dequantized(tensor)
    if generic in _PERMUTED_HEADS:
        weight = unpermute_rotary_rows(weight, config[_PERMUTED_HEADS[generic]])
    return _NAMES[generic].format(i=layer and layer["layer"]), weight


def _dequantized(tensor) -> torch.Tensor:
    """A GGUF tensor as float32 in torch order (rows first), whatever its GGML type.

    A copy: a float32 tensor's data is a read-only view of the mapped file.
    """
    from gguf import dequantize

    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (`LlamaModel.permute` in convert_hf_to_gguf.py).

    llama.cpp rotates adjacent pairs of a head's dims, Hugging Face the two halves; the
    converter reorders each head's rows from (2, half) to (half, 2). This reorders them back.

    Parameters
    ----------
    weight: (num_heads * head_dim, hidden) q or k projection, as the file stores it.
    num_heads: query heads for q, key/value heads for k.
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _shard_key(gguf_name: str) -> str:
    """One shard per layer, and one for the embedding, final norm and head."""
    layer = _LAYER.match(gguf_name)
    return f"layer{int(layer['layer']):05d}" if layer else "embeddings"


def _save_shards(out_dir: Path, shards: dict[str, list], config: dict, progress: bool | None = False) -> None:
    """Dequantize and save one shard at a time (`model-0000k-of-0000n.safetensors`, so
    only one layer is held in float32), then the index transformers reads."""
    from safetensors.torch import save_file

    weight_map, total_bytes = {}, 0
    keys = weight_progress(sorted(shards), len(shards), f"converting {out_dir.name}", progress, unit="shard")
    for k, key in enumerate(keys, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        weights = {name: weight for tensor in shards[key] for name, weight in hf_weights(tensor, config)}
        save_file(weights, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(weights, file))
        total_bytes += sum(w.numel() * w.element_size() for w in weights.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
