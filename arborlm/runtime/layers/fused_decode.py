"""When a decoder layer of a decode step runs as one native call (issue 25).

`FusedDecode` is shared by the layers of one Llama-family model. A layer asks it
first (`LlamaDecoderLayer.forward`); it runs the layer through
`kernels/fused_decoder_layer.py` only where that gives what the unfused path
would: a DECODE step on the native CPU attention path (`NativeDecodeMetadata`
from `TorchAttentionBackend`, a K/V pool in the model dtype, or from
`QuantizedKVAttentionBackend` over an int8 pool), bf16 with the
AVX-512 or AMX linear packing or float32, rows within the linears' kernels'
bound, full-width rotary, plain `Linear` projections or `QuantizedLinear` ones on
the native quantized kernels (GGUF blocks, int8 / int4 weight-only; not
tensor-parallel) and a SiLU `GatedMLP`. Anything else returns None and the layer
takes its modules as before. `enabled = False` turns it off (the tests' and the
benchmark's baseline).
"""

from __future__ import annotations

import ctypes
from operator import is_

import torch

from arborlm.kernels import fused_decoder_layer as fused
from arborlm.kernels.cpu_ops import NativeLayerOps, RotaryStep
from arborlm.kernels.quant_ops import NativeQuantOps
from arborlm.runtime.forward_batch_info import ForwardBatch
from arborlm.runtime.layers.attention.torch_native_backend import NativeDecodeMetadata
from arborlm.runtime.layers.linear import Linear, MergedLinear
from arborlm.runtime.layers.mlp import GatedMLP
from arborlm.runtime.layers.quantization.quant_linear import QuantizedLinear


def _plain_linear(module) -> bool:
    """A `Linear` / `MergedLinear` of its own weights: not a subclass (quantized), not
    split across tensor-parallel ranks."""
    return type(module) in (Linear, MergedLinear) and getattr(module, "tp_size", 1) == 1


def _native_quantized_linear(module) -> bool:
    """A `QuantizedLinear` whose unfused forward takes the native kernel the fused layer
    calls (`NativeQuantOps`, not the torch or Triton ops), not tensor-parallel."""
    return (type(module) is QuantizedLinear and type(module.ops) is NativeQuantOps
            and getattr(module, "tp_size", 1) == 1)


def _weights(linear) -> fused.LinearWeights | fused.QuantLinearWeights:
    if isinstance(linear, QuantizedLinear):
        return fused.QuantLinearWeights(linear.weights, linear.bias)
    return fused.LinearWeights(linear.weight, linear.bias, linear.packed_weight)


def _packs(layer) -> tuple:
    """The packed weights a layer's params point into (rebuilt when one changes).

    Checked for every layer of every decode step, so it reads the modules' dicts
    directly: through `nn.Module.__getattr__` the check took 183-290 us a step over the
    default model's 30 layers, through the dicts 30 us (docs/decode_step.md).
    """
    attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    # .get: an MoE layer has no such module (and no fused params).
    return (_pack_of(attn.get("qkv_proj")), _pack_of(attn.get("o_proj")), _pack_of(mlp.get("gate_up_proj")),
            _pack_of(mlp.get("down_proj")))


def _pack_of(module) -> object | None:
    """A projection's packed parts (`_pack_name`), from the module's dict."""
    if module is None:
        return None
    return module.__dict__.get(_pack_name(module))


def _pack_name(module) -> str:
    """A quantized linear's packed parts are its `weights` (replaced by `set_weights`), a plain
    linear's its `packed_weight` (replaced by `pack`): plain attributes, in the module's dict."""
    return "weights" if isinstance(module, QuantizedLinear) else "packed_weight"


def _watched(layers) -> tuple[list[dict], list[str]]:
    """Where a stack of `layers`' params comes from, as (dict, key) pairs: each layer's
    entry in the `ModuleList`, its attention and MLP, their four projections and each
    projection's packed weights (as `_packs`). A layer or projection replaced, or weights
    re-packed, changes one of their values."""
    dicts, keys = [], []
    for name, layer in layers._modules.items():
        dicts.append(layers._modules)
        keys.append(name)
        mods = layer._modules
        for part, projections in (("self_attn", ("qkv_proj", "o_proj")), ("mlp", ("gate_up_proj", "down_proj"))):
            dicts.append(mods)
            keys.append(part)
            owner = mods[part]._modules
            for proj in projections:
                module = owner[proj]
                dicts += [owner, module.__dict__]
                keys += [proj, _pack_name(module)]
    return dicts, keys


class FusedDecode:
    """The fused decode path of one model's decoder layers: per-layer params (built on
    first use), the step's shared params (built by the step's first layer), scratch.

    `create(ops, attention_cls)` gives None where the native kernels or the fused library
    are missing; `attention_cls` is the one attention block the kernel reproduces (the
    Llama family's; subclasses such as Qwen3's q/k norms keep their modules).
    """

    def __init__(self, lib: ctypes.CDLL, ops: NativeLayerOps, attention_cls: type):
        self.lib = lib
        self.ops = ops
        self.attention_cls = attention_cls
        self.enabled = True
        self._layers: dict[int, tuple[object, tuple, fused.LayerParams | None]] = {}
        self._step_key: tuple | None = None
        self._step: fused.StepParams | None = None
        self._scratch: fused.DecodeScratch | None = None
        self._stack: fused.LayerStack | None = None
        # (layers, dicts, keys, values) the stack was built from (`_watched`).
        self._stack_watch: tuple | None = None

    @classmethod
    def create(cls, ops, attention_cls: type) -> FusedDecode | None:
        if not isinstance(ops, NativeLayerOps):
            return None
        lib = fused.native_library()
        return None if lib is None else cls(lib, ops, attention_cls)

    def __call__(self, layer, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryStep,
                 forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`layer.forward`'s result through the fused kernel, or None where it does not apply."""
        if not self._takes_step(forward_batch):
            return None
        params = self._layer_params(layer)
        if params is None:
            return None
        ready = self._prepare(params, params.max_rows, hidden, residual, rotary, forward_batch)
        if ready is None:
            return None
        return fused.run_layer(self.lib, params, *ready, hidden, residual)

    def run_layers(self, layers, hidden: torch.Tensor, rotary: RotaryStep,
                   forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every decoder layer of `layers` (a model's, in order, the first one starting the
        residual stream) in one native call: `(hidden, residual)` after the last, as the
        layers one by one through `__call__` would give them bit for bit; None where any
        layer does not take the fused call (the caller then runs them one by one)."""
        if not self._takes_step(forward_batch):
            return None
        stack = self._layer_stack(layers)
        if stack is None:
            return None
        ready = self._prepare(stack.layers[0], stack.max_rows, hidden, None, rotary, forward_batch)
        if ready is None:
            return None
        return fused.run_layers(self.lib, stack, *ready, hidden, None)

    def _takes_step(self, forward_batch: ForwardBatch) -> bool:
        """A DECODE (or verify) step on the native decode kernel; EXTEND steps laid out as
        decode rows (`NativeDecodeMetadata.of_extend_rows`) keep the layers' modules, which
        give the same bits: a prefill's thousands of rows are beyond the fused scratch."""
        return (self.enabled and forward_batch.forward_mode.is_decode()
                and isinstance(forward_batch.attn_metadata, NativeDecodeMetadata))

    def _prepare(self, params: fused.LayerParams, max_rows: int, hidden: torch.Tensor, residual: torch.Tensor | None,
                 rotary: RotaryStep, forward_batch: ForwardBatch
                 ) -> tuple[fused.StepParams, fused.DecodeScratch] | None:
        """The step's params and a scratch that fits, or None where the step's tensors do not
        take the fused call (dtype, rows beyond `max_rows`, shape, layout)."""
        if hidden.dtype != params.dtype:
            return None
        step = self._step_params(forward_batch.attn_metadata, rotary, forward_batch, params)
        if step is None or step.rows > max_rows:
            return None
        shape = (step.rows, params.shape.hidden)
        if hidden.shape != shape or not hidden.is_contiguous():
            return None
        if residual is not None and (residual.shape != shape or not residual.is_contiguous()
                                     or residual.dtype != params.dtype):
            return None
        scratch = self._scratch
        if scratch is None or not scratch.fits(params.shape, params.dtype, step.rows):
            scratch = self._scratch = fused.DecodeScratch(params.shape, params.dtype, params.max_rows)
        return step, scratch

    def _layer_stack(self, layers) -> fused.LayerStack | None:
        """The stack of `layers`' params (rebuilt when any layer's params are), or None
        where one of them has none.

        Checked every decode step: while every value `_watched` names is the one the stack
        was built from, the stack stands, in one C-level pass over ~330 dict entries
        for the default model's 30 layers (17 us timed alone, 69 us inside a step; the
        per-layer `_layer_params` checks took 143 us there)."""
        watch = self._stack_watch
        if (watch is not None and watch[0] is layers
                and all(map(is_, map(dict.get, watch[1], watch[2]), watch[3]))):
            return self._stack
        params = tuple(self._layer_params(layer) for layer in layers)
        if any(p is None for p in params):
            self._stack_watch = None
            return None
        stack = self._stack
        if stack is None or len(stack.layers) != len(params) or any(a is not b for a, b in zip(stack.layers, params)):
            stack = self._stack = fused.layer_stack(params)
        dicts, keys = _watched(layers)
        self._stack_watch = (layers, dicts, keys, list(map(dict.get, dicts, keys)))
        return stack

    def _layer_params(self, layer) -> fused.LayerParams | None:
        entry = self._layers.get(id(layer))
        packs = _packs(layer)
        if entry is not None and entry[0] is layer:
            old = entry[1]  # the four projections' packs, compared without a generator (every step)
            if old[0] is packs[0] and old[1] is packs[1] and old[2] is packs[2] and old[3] is packs[3]:
                return entry[2]
        params = self._build_layer(layer)
        self._layers[id(layer)] = (layer, packs, params)
        return params

    def _build_layer(self, layer) -> fused.LayerParams | None:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        ok = (
            type(attn) is self.attention_cls and type(mlp) is GatedMLP and mlp.act_and_mul == self.ops.silu_and_mul
            and all(_plain_linear(m) or _native_quantized_linear(m)
                    for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            and not any(n.unit_offset for n in norms)
        )
        if not ok:
            return None
        radix = attn.attn
        shape = fused.LayerShape(
            norms[0].weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size
        )
        return fused.layer_params(
            shape, norms[0].weight.dtype, radix.layer_id, (norms[0].weight, norms[0].eps),
            (norms[1].weight, norms[1].eps), _weights(attn.qkv_proj), _weights(attn.o_proj),
            _weights(mlp.gate_up_proj), _weights(mlp.down_proj), radix.scale, radix.sliding_window, radix.logit_cap,
        )

    def _step_params(self, meta: NativeDecodeMetadata, rotary: RotaryStep, forward_batch: ForwardBatch,
                     params: fused.LayerParams) -> fused.StepParams | None:
        """The step's shared params, built once per (step, dtype, head_dim)."""
        key = (meta, rotary, params.dtype, params.shape.head_dim)
        last = self._step_key
        if last is not None and last[0] is meta and last[1] is rotary and last[2:] == key[2:]:
            return self._step
        pool = forward_batch.token_to_kv_pool
        # An int8 pool comes with its scales (the layer stores and attends over it in place);
        # an fp8 pool has no fused store and is refused by `step_params` (its dtype).
        scales = (pool.k_scale, pool.v_scale) if getattr(pool, "k_scale", None) is not None else None
        self._step = fused.step_params(
            forward_batch.req_to_token_pool.req_to_token, meta.req_pool_indices, meta.seq_lens, meta.out_cache_loc,
            rotary.positions, rotary.cos_table, rotary.sin_table, getattr(pool, "k_buffer", None),
            getattr(pool, "v_buffer", None), params.dtype, params.shape.head_dim, scales,
        ) if isinstance(getattr(pool, "k_buffer", None), torch.Tensor) else None
        self._step_key = key
        return self._step
