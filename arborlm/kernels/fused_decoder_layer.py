"""A Llama-family decoder layer of a decode step as one native call (issue 25).

At a few rows per step the ~10 kernel calls per layer around the matrix products
(norms, rotary, views, SiLU-and-mul: each a ctypes call, a fresh tensor and Python
glue) cost several milliseconds of a small model's step. `csrc/fused_decoder_layer.cpp`
runs the whole layer (add + RMSNorm, qkv, rotary, K/V store and paged decode
attention, o_proj, add + RMSNorm, gate_up, SiLU-and-mul, down) through the same
kernels the unfused native path calls, in the same order, over scratch buffers
allocated once (`DecodeScratch`), so its bf16 outputs are that path's bit for bit.
float32 linears take a row-dot kernel of its own (the unfused path's are torch's):
within float32 rounding, not bit-identical. Quantized linears (`QuantLinearWeights`:
GGUF blocks, int8 / int4 weight-only) take `csrc/quant_linear.cpp`'s kernel, the one
`quant_ops.NativeQuantOps.linear` calls, with its per-row activation quantization: bit
for bit in either dtype, up to `quant_ops.INT8_MAX_ROWS` rows.

This module holds plain tensors and pointers only: `LayerParams` (one layer's
weights, built once by `layer_params`), `StepParams` (what a step shares across
layers, `step_params`), `DecodeScratch` and `run_layer`. Deciding when a model's
layer takes it is `runtime/layers/fused_decode.py`'s job. The library is built like
`cpu_ops`'s (`cpu_ops.build_library`), from its source and the two it calls into.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from arborlm.kernels import cpu_ops, linear_avx512, quant_ops

_CSRC = Path(__file__).parent / "csrc"
SOURCES = (_CSRC / "fused_decoder_layer.cpp", _CSRC / "cpu_kernels.cpp", _CSRC / "linear_bf16_avx512.cpp",
           _CSRC / "quant_linear.cpp", _CSRC / "quant_layout.h", _CSRC / "fast_exp.h")
ABI_VERSION = 4
# Weight kinds of `FusedLinear.kind` (see the source).
KIND_BF16_AVX512, KIND_BF16_AMX, KIND_FLOAT32, KIND_QUANT = 0, 1, 2, 3
# Rows up to which float32 decode steps take the fused layer: its row-dot linear reads
# each weight row once for up to 8 rows; more rows go to torch's GEMM, unfused.
FLOAT32_MAX_ROWS = 8
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class FusedLinear(ctypes.Structure):
    """One linear layer of the C struct: weight (kind's layout), bias or null, shape."""

    _fields_ = [("weight", _ptr), ("bias", _ptr), ("kind", _i64), ("out_features", _i64),
                ("in_features", _i64), ("k_block", _i64)]


class _QuantPartsStruct(ctypes.Structure):
    """`FusedQuantParts`: `arborlm_quant_linear`'s weight arguments (`StackedWeights.native_args`)."""

    _fields_ = [("num_parts", _i64), ("fmts", _ptr), ("ptrs", _ptr), ("Ns", _ptr)]


class _LayerStruct(ctypes.Structure):
    _fields_ = [
        ("dtype", _i64), ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("layer_id", _i64), ("window", _i64),
        ("input_eps", _f32), ("post_eps", _f32), ("scale", _f32), ("logit_cap", _f32),
        ("input_norm", _ptr), ("post_norm", _ptr),
        ("qkv", FusedLinear), ("o_proj", FusedLinear), ("gate_up", FusedLinear), ("down", FusedLinear),
    ]


class _StepStruct(ctypes.Structure):
    _fields_ = [
        ("rows", _i64), ("req_to_token", _ptr), ("req_to_token_stride", _i64), ("req_pool_indices", _ptr),
        ("seq_lens", _ptr), ("out_cache_loc", _ptr), ("positions", _ptr), ("cos_table", _ptr),
        ("sin_table", _ptr), ("k_pool", _ptr), ("v_pool", _ptr), ("pool_layer_stride", _i64),
        ("kv_dtype", _i64), ("k_scale", _ptr), ("v_scale", _ptr), ("scale_layer_stride", _i64),
    ]


class _ScratchStruct(ctypes.Structure):
    _fields_ = [("normed", _ptr), ("qkv", _ptr), ("attn", _ptr), ("o", _ptr), ("gate_up", _ptr), ("act", _ptr)]


_SIGNATURES = {
    "arborlm_fused_layer_abi_version": ((), ctypes.c_int),
    "arborlm_fused_decoder_layer": ((_ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _ptr), ctypes.c_int),
    "arborlm_fused_decoder_layers": ((_ptr, _i64, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _ptr), ctypes.c_int),
}


@dataclass(frozen=True)
class LinearWeights:
    """One linear layer as the torch path holds it: `weight` (out, in), `bias` (out,) or
    None, `packed` its `LayerOps.pack_linear` copy (None where nothing is packed)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: object | None


@dataclass(frozen=True)
class QuantLinearWeights:
    """One quantized linear layer as `QuantizedLinear` holds it: `weights` the packed parts
    stacked by rows (`quant_ops.StackedWeights` from `NativeQuantOps.prepare`, so with
    `native_args`), `bias` (out,) or None."""

    weights: quant_ops.StackedWeights
    bias: torch.Tensor | None


@dataclass(frozen=True)
class LayerShape:
    """The fixed sizes of one layer: hidden width, query / KV heads, head width, MLP width."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


@dataclass
class LayerParams:
    """One layer, filled in once: the C struct, its address, and the tensors it points
    into (kept alive here). `max_rows`: the most rows its linears' kernels take."""

    struct: _LayerStruct
    address: int
    dtype: torch.dtype
    shape: LayerShape
    max_rows: int
    tensors: tuple


def _fused_quant_linear(lin: QuantLinearWeights, dtype: torch.dtype, in_features: int, out_features: int
                        ) -> tuple[FusedLinear, int, tuple] | None:
    """`_fused_linear` of a quantized layer: its parts as `NativeQuantOps.linear` passes them,
    or None where that call would not take the native kernel either (so the unfused path
    stays the one that runs)."""
    parts, bias = lin.weights, lin.bias
    args = getattr(parts, "native_args", None)
    if args is None or not parts or any(w.in_features != in_features for w in parts):
        return None
    if sum(w.out_features for w in parts) != out_features or args[4] != out_features:
        return None
    if any(not t.is_cpu for w in parts for t in w.tensors()):
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous() or not bias.is_cpu
                             or bias.shape != (out_features,)):
        return None
    num_parts, fmts, ptrs, heights, _, arrays = args
    struct = _QuantPartsStruct(num_parts, fmts, ptrs, heights)
    fused_linear = FusedLinear(ctypes.addressof(struct), None if bias is None else bias.data_ptr(), KIND_QUANT,
                               out_features, in_features, 0)
    # The struct, the ctypes arrays it points to and the packed tensors stay alive with the params.
    return fused_linear, quant_ops.INT8_MAX_ROWS, (struct, arrays, *(t for w in parts for t in w.tensors()), bias)


def _fused_linear(lin: LinearWeights | QuantLinearWeights, dtype: torch.dtype, in_features: int, out_features: int
                  ) -> tuple[FusedLinear, int, tuple] | None:
    """The struct of one linear (and the rows its kernel takes, the tensors it points into),
    or None where no fused kernel reads this weight."""
    if isinstance(lin, QuantLinearWeights):
        return _fused_quant_linear(lin, dtype, in_features, out_features)
    w, bias, packed = lin.weight, lin.bias, lin.packed
    if tuple(w.shape) != (out_features, in_features) or w.dtype != dtype or not w.is_cpu:
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous() or bias.shape != (out_features,)):
        return None
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(packed, linear_avx512.Avx512Weight):
        return (FusedLinear(packed.data.data_ptr(), bias_ptr, KIND_BF16_AVX512, out_features, in_features,
                            packed.k_block), linear_avx512.AVX512_MAX_ROWS, (packed.data, bias))
    if isinstance(packed, cpu_ops.AmxWeight):
        return (FusedLinear(packed.data.data_ptr(), bias_ptr, KIND_BF16_AMX, out_features, in_features, 0),
                cpu_ops.AMX_MAX_ROWS, (packed.data, bias))
    # Without AVX-512 the row-dot kernel is scalar: 2.3x slower a step than MKL's GEMM unfused
    # (SmolLM2-135M at batch 1 on an AVX2-only EPYC, bench_quant.py), so it is not taken there.
    if packed is None and dtype == torch.float32 and w.is_contiguous() and cpu_ops.cpu_has_avx512f():
        return FusedLinear(w.data_ptr(), bias_ptr, KIND_FLOAT32, out_features, in_features, 0), FLOAT32_MAX_ROWS, (w, bias)
    return None


def layer_params(
    shape: LayerShape, dtype: torch.dtype, layer_id: int,
    input_norm: tuple[torch.Tensor, float], post_norm: tuple[torch.Tensor, float],
    qkv: LinearWeights, o_proj: LinearWeights, gate_up: LinearWeights, down: LinearWeights,
    scale: float, sliding_window: int | None = None, logit_cap: float = 0.0,
) -> LayerParams | None:
    """One decoder layer for `run_layer`, or None where the fused layer does not take it.

    Parameters
    ----------
    shape, dtype: the layer's sizes; float32 or bfloat16.
    layer_id: its layer in the KV pool.
    input_norm, post_norm: (weight (hidden,) in `dtype`, eps) of the two RMSNorms.
    qkv: (q + 2 kv heads) * head_dim outputs, q heads first; o_proj: hidden outputs;
    gate_up: 2 * intermediate outputs, gate first; down: hidden outputs.
    scale, sliding_window, logit_cap: the attention's (`RadixAttention`'s).

    Each linear is a `LinearWeights` or a `QuantLinearWeights`. Returns None (the caller
    keeps the unfused path) for another dtype, a weight no fused kernel reads (bf16 without
    the AVX-512 or AMX packing, a quantized one not prepared by `NativeQuantOps`),
    mismatched shapes, or norm weights not contiguous in `dtype`.
    """
    if dtype not in _DTYPE_CODES:
        return None
    q_size = shape.num_heads * shape.head_dim
    linears = [
        _fused_linear(qkv, dtype, shape.hidden, shape.qkv_width),
        _fused_linear(o_proj, dtype, q_size, shape.hidden),
        _fused_linear(gate_up, dtype, shape.hidden, 2 * shape.intermediate),
        _fused_linear(down, dtype, shape.intermediate, shape.hidden),
    ]
    norms = (input_norm[0], post_norm[0])
    if any(lin is None for lin in linears) or any(
        n.dtype != dtype or n.shape != (shape.hidden,) or not n.is_contiguous() or not n.is_cpu for n in norms
    ):
        return None
    struct = _LayerStruct(
        _DTYPE_CODES[dtype], shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate,
        layer_id, sliding_window or 0, input_norm[1], post_norm[1], scale, logit_cap,
        norms[0].data_ptr(), norms[1].data_ptr(), *(lin[0] for lin in linears),
    )
    tensors = (*norms, *(t for lin in linears for t in lin[2]))
    max_rows = min(lin[1] for lin in linears)
    return LayerParams(struct, ctypes.addressof(struct), dtype, shape, max_rows, tensors)


@dataclass
class StepParams:
    """What one decode step shares across layers: the C struct, its address, and the
    tensors it points into (kept alive until the step is done)."""

    struct: _StepStruct
    address: int
    rows: int
    tensors: tuple


def step_params(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
    positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    k_pool: torch.Tensor, v_pool: torch.Tensor, dtype: torch.dtype, head_dim: int,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> StepParams | None:
    """A decode step's shared inputs, or None where the fused layer does not take them.

    req_to_token: (pool_rows, max_context) int32, rows contiguous; req_pool_indices,
    seq_lens (after this step's token), out_cache_loc, positions: (rows,) int64
    contiguous CPU. cos_table, sin_table: (max_positions, head_dim) contiguous in
    `dtype` (full-width rotary, `rotate_half`'s sign in sin, as `RotaryStep`).
    k_pool, v_pool: (layers, slots, num_kv_heads, head_dim) contiguous in `dtype`, or
    int8 with `kv_scales` ((layers, slots, num_kv_heads) float16 contiguous: an int8
    `TokenToKVPool`'s, which the layer fills as `set_kv_buffer` does). Indices are the
    scheduler's and are not range-checked, as in `NativeLayerOps.decode_attention`.
    """
    rows = positions.shape[0]
    index_ok = all(
        t.dtype == torch.int64 and t.is_contiguous() and t.is_cpu and t.shape == (rows,)
        for t in (req_pool_indices, seq_lens, out_cache_loc, positions)
    )
    table_ok = all(
        t.dtype == dtype and t.is_contiguous() and t.dim() == 2 and t.shape[1] == head_dim for t in (cos_table, sin_table)
    )
    pool_dtype = torch.int8 if kv_scales is not None else dtype
    pool_ok = all(
        t.dtype == pool_dtype and t.is_contiguous() and t.is_cpu and t.dim() == 4 and t.shape[3] == head_dim
        for t in (k_pool, v_pool)
    ) and k_pool.shape == v_pool.shape
    if pool_ok and kv_scales is not None:
        pool_ok = all(s.dtype == torch.float16 and s.is_contiguous() and s.shape == k_pool.shape[:3]
                      for s in kv_scales)
    r2t_ok = req_to_token.dtype == torch.int32 and req_to_token.dim() == 2 and req_to_token.stride(1) == 1
    if not (rows > 0 and index_ok and table_ok and pool_ok and r2t_ok):
        return None
    scales = (None, None, 0) if kv_scales is None else (kv_scales[0].data_ptr(), kv_scales[1].data_ptr(),
                                                          kv_scales[0].stride(0))
    struct = _StepStruct(
        rows, req_to_token.data_ptr(), req_to_token.stride(0), req_pool_indices.data_ptr(), seq_lens.data_ptr(),
        out_cache_loc.data_ptr(), positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(),
        k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0),
        cpu_ops.KV_DTYPE_CODES[pool_dtype], *scales,
    )
    tensors = (req_to_token, req_pool_indices, seq_lens, out_cache_loc, positions, cos_table, sin_table, k_pool, v_pool,
               *(kv_scales or ()))
    return StepParams(struct, ctypes.addressof(struct), rows, tensors)


class DecodeScratch:
    """The intermediate rows of a layer, allocated once for `capacity` rows and reused by
    every layer and step of that shape and dtype; `out(rows)` is the layer's output
    buffer (a (rows, hidden) view, the same for every layer: the next layer reads it
    before it writes it).
    """

    def __init__(self, shape: LayerShape, dtype: torch.dtype, capacity: int):
        self.shape, self.dtype, self.capacity = shape, dtype, capacity
        q_size = shape.num_heads * shape.head_dim
        widths = (shape.hidden, shape.qkv_width, q_size, shape.hidden, 2 * shape.intermediate, shape.intermediate)
        self.buffers = tuple(torch.empty((capacity, w), dtype=dtype) for w in widths)
        self.out_buffer = torch.empty((capacity, shape.hidden), dtype=dtype)
        self.struct = _ScratchStruct(*(b.data_ptr() for b in self.buffers))
        self.address = ctypes.addressof(self.struct)
        self._out_views = [self.out_buffer[:rows] for rows in range(capacity + 1)]

    def fits(self, shape: LayerShape, dtype: torch.dtype, rows: int) -> bool:
        return self.shape == shape and self.dtype == dtype and rows <= self.capacity

    def out(self, rows: int) -> torch.Tensor:
        return self._out_views[rows]


def _residual_stream(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The residual buffer and the C entries' `add_residual` flag: the first layer (residual
    None) starts the stream as x itself, normalised rather than added."""
    return (x, 0) if residual is None else (residual, 1)


def run_layer(lib: ctypes.CDLL, layer: LayerParams, step: StepParams, scratch: DecodeScratch,
              x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of a decode step: `(hidden, residual)` in and out, as
    `LlamaDecoderLayer.forward` (the layer's input is `x + residual`; residual None for
    the first layer, which then starts the residual stream as x itself).

    x, residual: (step.rows, hidden) in the layer's dtype, rows contiguous (checked
    by the caller: `layer.max_rows`, `scratch.fits`). Writes this layer's K/V of the
    new tokens into the pool; updates `residual` in place. Returns `(scratch.out(rows),
    residual)`: the output is a scratch view, valid until the next layer runs.

    Raises
    ------
    ValueError
        When the library refuses the layer's linear kinds for its dtype, or a quantized
        weight's format (nothing written).
    """
    residual, add = _residual_stream(x, residual)
    out = scratch.out(step.rows)
    if lib.arborlm_fused_decoder_layer(layer.address, step.address, scratch.address, x.data_ptr(),
                                       residual.data_ptr(), add, out.data_ptr()) != 0:
        raise ValueError("fused decoder layer: a linear layer's kind does not match the layer's dtype "
                         "(or a quantized weight's format is unknown)")
    return out, residual


@dataclass(frozen=True)
class LayerStack:
    """Consecutive layers for `run_layers`: their params (kept alive here) and the C array
    of their struct addresses, built once by `layer_stack`."""

    layers: tuple[LayerParams, ...]
    array: ctypes.Array
    address: int
    max_rows: int


def layer_stack(layers: tuple[LayerParams, ...]) -> LayerStack | None:
    """The stack of `layers` (in order), or None where they cannot share one call: none
    given, or their dtypes or shapes differ (one scratch serves them all)."""
    if not layers or any(p.dtype != layers[0].dtype or p.shape != layers[0].shape for p in layers):
        return None
    array = (_ptr * len(layers))(*(p.address for p in layers))
    return LayerStack(layers, array, ctypes.addressof(array), min(p.max_rows for p in layers))


def run_layers(lib: ctypes.CDLL, stack: LayerStack, step: StepParams, scratch: DecodeScratch,
               x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`run_layer` over every layer of `stack` in one native call: the same kernels in the
    same order, so the same output bit for bit, without the per-layer Python and ctypes
    work. x, residual: the first layer's (as `run_layer`); rows within `stack.max_rows`
    (checked by the caller). Returns `(scratch.out(rows), residual)` after the last layer.

    Raises
    ------
    ValueError
        As `run_layer`, for any layer of the stack (checked before anything is written).
    """
    residual, add = _residual_stream(x, residual)
    out = scratch.out(step.rows)
    if lib.arborlm_fused_decoder_layers(stack.address, len(stack.layers), step.address, scratch.address,
                                        x.data_ptr(), residual.data_ptr(), add, out.data_ptr()) != 0:
        raise ValueError("fused decoder layers: a linear layer's kind does not match the layer's dtype "
                         "(or a quantized weight's format is unknown)")
    return out, residual


def load_library(cache_dir: Path) -> ctypes.CDLL:
    """Build (if needed) and load the fused layer's library, signatures set.

    Raises
    ------
    KernelBuildError
        When it cannot be built or loaded, or is of another ABI version.
    """
    path = cpu_ops.build_library(cache_dir, SOURCES, "fused_decoder_layer")
    return cpu_ops.open_library(path, "arborlm_fused_layer_abi_version", ABI_VERSION, _SIGNATURES)


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The loaded library, once per process; None (logged once) where it cannot be built."""
    return cpu_ops.load_or_none(load_library, "fused decoder layer unavailable, decode steps take the per-op kernels")
