"""Serve a GGUF file's weights in their quantized form: the `quantization="gguf"` load path.

`model_loader.load_model` builds the model as for any checkpoint (its weights
uninitialised, so untouched) and calls `load_gguf_weights`, which

1. reads the tensor table (`gguf_file.py`) and maps llama.cpp's names to Hugging
   Face's (`gguf_names.py`);
2. installs quantized layers: every `Linear` / `MergedLinear` whose checkpoint
   weights are all of a format the kernels serve (`SERVED_TYPES`) becomes a
   `QuantizedLinear`, a `VocabEmbedding` whose table is one becomes a
   `QuantizedEmbedding`, a head tied to that table a `QuantizedLinear` over
   the same packed bytes, and a MoE block's `FusedMoE` whose three stacked expert
   tensors are served a `QuantizedFusedMoE` (`quant_moe.py`; one packed weight per
   expert and projection). A fused checkpoint tensor (Phi-3's `attn_qkv`, `ffn_up`)
   fills a whole `MergedLinear` as one packed weight;
3. streams the file once: served tensors are packed (`pack_ggml_blocks`, q/k rows
   put back in Hugging Face's order) into their layers; everything else (norms,
   biases, F16 / F32 tensors, quantized types the kernels do not serve, logged once
   per type) is dequantized by `gguf.quants` and handed to the model's own
   `load_weights`, one tensor at a time (stacked experts split into the family's
   per-expert names, Gemma 3's norms back from 1 + weight: `gguf_names.hf_values`).

No float copy of a served tensor is ever made: resident weights are the file's
bytes (plus row padding to tiles of 16) and the dequantized rest.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.kernels.quant_layout import pack_ggml_blocks
from arborlm.kernels.quant_ops import QuantOps
from arborlm.runtime.layers.linear import Linear, MergedLinear
from arborlm.runtime.layers.moe import DOWN, GATE, UP, FusedMoE
from arborlm.runtime.layers.quantization.gguf_file import GGUFFile, GGUFTensorInfo
from arborlm.runtime.layers.quantization.gguf_names import (
    expert_hf_names,
    expert_tensor,
    hf_name,
    hf_row_order,
    hf_values,
    is_ignored,
)
from arborlm.runtime.layers.quantization.quant_linear import (
    WHOLE,
    QuantizedEmbedding,
    QuantizedLinear,
)
from arborlm.runtime.layers.quantization.quant_moe import QuantizedFusedMoE
from arborlm.runtime.layers.vocab_embedding import VocabEmbedding

logger = logging.getLogger(__name__)

# ggml type id (GGMLQuantizationType) -> our packed format (kernels/quant_layout.py).
SERVED_TYPES = {8: "q8_0", 2: "q4_0", 3: "q4_1", 12: "q4_k", 13: "q5_k", 14: "q6_k"}


@dataclass
class GGUFLoadReport:
    """What the load did: tensors served packed and dequantized, by ggml type name."""

    quantized: collections.Counter = field(default_factory=collections.Counter)
    dequantized: collections.Counter = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: a quantized layer's shard weight, its bias, or a table."""

    module: nn.Module
    shard: Hashable
    kind: str  # "weight" | "bias" | "table" | "experts"


def load_gguf_weights(model: nn.Module, gguf: GGUFFile, hf_config, ops: QuantOps) -> GGUFLoadReport:
    """Install quantized layers in `model` and fill it from `gguf` (see the module docstring).

    Parameters
    ----------
    model: built by its family's class, weights unloaded; its `load_weights` takes
        Hugging Face names, and its `_STACKED` table (checkpoint projection ->
        fused module, shard) says which shards a `MergedLinear` stacks.
    gguf: the parsed file (`read_gguf_file`).
    hf_config: the model's transformers config (head counts for q/k row order).
    ops: the quantized ops the new layers run on.

    Raises
    ------
    ModelLoadError
        For a tensor name outside the table of `gguf_names`, a shape that does not
        match the model, or a weight missing from the file.
    """
    stacked = getattr(model, "_STACKED", {})
    served = {hf_name(t.name, gguf.architecture) for t in gguf.tensors if t.ggml_type in SERVED_TYPES} - {None}
    targets, tied_heads = _install(model, served, stacked, ops)
    report = GGUFLoadReport()
    model.load_weights(_stream(gguf, hf_config, targets, report))
    for path, module in model.named_modules():
        if isinstance(module, QuantizedFusedMoE) or (
            isinstance(module, QuantizedLinear) and module not in tied_heads.values()
        ):
            module.finish(path)
    for table, head in tied_heads.items():
        head.set_weights((table.weight,))
    _log(gguf, report)
    return report


def _install(
    model: nn.Module, served: set[str], stacked: Mapping[str, tuple[str, Hashable]], ops: QuantOps
) -> tuple[dict[str, _Target], dict[QuantizedEmbedding, QuantizedLinear]]:
    """Swap in the quantized layers; returns where each served tensor goes, and tied heads."""
    targets: dict[str, _Target] = {}
    tables: dict[int, QuantizedEmbedding] = {}  # id of the replaced embedding weight -> its table
    for path, module in list(model.named_modules()):
        if isinstance(module, VocabEmbedding) and f"{path}.weight" in served:
            table = QuantizedEmbedding(*module.weight.shape, module.weight.dtype, ops)
            model.set_submodule(path, table)
            tables[id(module.weight)] = table
            targets[f"{path}.weight"] = _Target(table, WHOLE, "table")
    tied_heads: dict[QuantizedEmbedding, QuantizedLinear] = {}
    for path, module in list(model.named_modules()):
        if isinstance(module, FusedMoE) and all(f"{path}.{shard}" in served for shard in (GATE, UP, DOWN)):
            experts = QuantizedFusedMoE.replacing(module, ops)
            model.set_submodule(path, experts)
            targets.update({f"{path}.{shard}": _Target(experts, shard, "experts") for shard in (GATE, UP, DOWN)})
        if not isinstance(module, Linear):
            continue
        if id(module.weight) in tables:  # a head tied to a quantized table reads the same bytes
            head = QuantizedLinear.replacing(module, ops)
            model.set_submodule(path, head)
            tied_heads[tables[id(module.weight)]] = head
            continue
        names = _checkpoint_names(path, module, stacked)
        if f"{path}.weight" in served:  # one tensor for the whole layer, a fused one included
            names = {WHOLE: f"{path}.weight"}
        if not names or not all(name in served for name in names.values()):
            continue
        layer = QuantizedLinear.replacing(module, ops, whole=set(names) == {WHOLE})
        model.set_submodule(path, layer)
        for shard, name in names.items():
            targets[name] = _Target(layer, shard, "weight")
            if module.bias is not None:
                targets[name.removesuffix("weight") + "bias"] = _Target(layer, shard, "bias")
    return targets, tied_heads


def _checkpoint_names(path: str, linear: Linear, stacked: Mapping[str, tuple[str, Hashable]]) -> dict:
    """Shard id -> the checkpoint weight name that fills it ("...qkv_proj" -> q/k/v_proj);
    empty for a fused layer the model's table does not cover (it stays a plain layer)."""
    if not isinstance(linear, MergedLinear):
        return {WHOLE: f"{path}.weight"}
    prefix, _, ours = path.rpartition(".")
    names = {shard: f"{prefix}.{hf_part}.weight" for hf_part, (fused, shard) in stacked.items() if fused == ours}
    return names if set(names) == set(linear.shard_slices) else {}


def _stream(
    gguf: GGUFFile, hf_config, targets: dict[str, _Target], report: GGUFLoadReport
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pack the served tensors into their layers; yield the rest, dequantized, in HF names."""
    for info in gguf.tensors:
        if is_ignored(info.name):
            continue
        name = hf_name(info.name, gguf.architecture)
        if name is None:
            raise ModelLoadError(
                f"GGUF tensor {info.name!r} of {str(gguf.path)!r} is not one quantization='gguf' knows "
                f"(architecture {gguf.architecture!r}); serve the file with quantization='none'"
            )
        rows = hf_row_order(info.name, gguf.architecture, info.num_rows, hf_config)
        target = targets.get(name)
        if target is not None and target.kind == "experts":
            target.module.load_shard(target.shard, _packed_experts(gguf, info), name)
            report.quantized[info.type_name] += 1
            continue
        if target is not None and target.kind != "bias":
            _load_packed(target, _packed(gguf, info, rows), name)
            report.quantized[info.type_name] += 1
            continue
        values = hf_values(info.name, gguf.architecture, gguf.values(info))
        tensor = torch.from_numpy(values if rows is None else values[rows])
        report.dequantized[info.type_name] += 1
        expert = expert_tensor(info.name)
        if target is not None:
            target.module.load_bias(target.shard, tensor, name)
        elif expert is not None:  # the family's per-expert names, one expert at a time
            yield from zip(expert_hf_names(expert, tensor.shape[0], hf_config.model_type), tensor)
        else:
            yield name, tensor


def _packed(gguf: GGUFFile, info: GGUFTensorInfo, rows: np.ndarray | None):
    """The tensor's ggml rows (reordered when `rows`), packed; one copy of its bytes."""
    raw = gguf.raw(info)
    raw = raw[rows] if rows is not None else np.array(raw)
    try:
        return pack_ggml_blocks(SERVED_TYPES[info.ggml_type], torch.from_numpy(raw), info.row_width)
    except ValueError as exc:
        raise ModelLoadError(f"GGUF tensor {info.name!r}: {exc}") from exc


def _packed_experts(gguf: GGUFFile, info: GGUFTensorInfo):
    """A stacked (E, out, in) expert tensor packed expert by expert."""
    if len(info.shape) != 3:
        raise ModelLoadError(f"GGUF tensor {info.name!r} has shape {info.shape}, expected (experts, out, in)")
    experts, out_features, in_features = info.shape
    raw = gguf.raw(info)
    try:
        return [
            pack_ggml_blocks(
                SERVED_TYPES[info.ggml_type], torch.from_numpy(np.array(raw[e * out_features:(e + 1) * out_features])),
                in_features,
            )
            for e in range(experts)
        ]
    except ValueError as exc:
        raise ModelLoadError(f"GGUF tensor {info.name!r}: {exc}") from exc


def _load_packed(target: _Target, weight, name: str) -> None:
    if target.kind == "table":
        target.module.set_weight(weight, name)
    else:
        target.module.load_shard(target.shard, weight, name)


def _log(gguf: GGUFFile, report: GGUFLoadReport) -> None:
    served = {f.upper() for f in SERVED_TYPES.values()}
    unserved = {t: n for t, n in report.dequantized.items() if t not in ("F32", "F16", "BF16")}
    no_kernel = {t: n for t, n in unserved.items() if t not in served}
    if no_kernel:
        logger.warning(
            "%s: %s tensors served dequantized: the quantized kernels cover %s",
            gguf.path.name, no_kernel, ", ".join(sorted(served)),
        )
    fused = {t: n for t, n in unserved.items() if t in served}
    if fused:  # a stacked projection (qkv, gate_up) is served one way for all its parts
        logger.warning(
            "%s: %s tensors served dequantized: they share a fused projection (qkv or gate_up) "
            "with a tensor of a type the kernels do not cover", gguf.path.name, fused,
        )
    logger.info(
        "%s: serving %s tensors quantized, %s dequantized", gguf.path.name, dict(report.quantized),
        dict(report.dequantized),
    )


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every tensor `module` holds (parameters and buffers), each storage once."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
