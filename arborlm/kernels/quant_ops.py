"""GGUF-quantized linear layers and embedding rows on the CPU, built from `csrc/quant_*.cpp`.

`QuantizedLinear` and `QuantizedEmbedding` (`runtime/layers/quantization/`) call
these ops with the weights `quant_layout.pack_ggml_blocks` packed at load:

- `linear`: for decode-sized inputs (up to `int8_max_rows(dtype)` rows: 64 in bf16 on
  CPUs with AMX, else 4096, a whole prefill batch) the C++ kernel of `csrc/quant_linear.cpp` streams each weight
  block once per call, quantizing the activations to int8 per block of 32 and taking
  VNNI dot products (ggml's Q8_0 x Q8_0 / Q4_x x Q8_1 scheme); longer inputs
  (prefills) dequantize the weight to the activations' dtype (`csrc/quant_dequant.cpp`)
  and run one GEMM, which is faster there;
- `embedding`: dequantizes only the looked-up rows.

`QuantOps` is the same interface in torch (`quant_reference.py`): the fallback
where the library cannot be built, and the oracle. On CUDA, `TritonQuantOps` runs
the Q8_0 / Q4_0 / Q4_1 linears through `triton_quant_linear.py` (dequantized in
the kernel) and the rest the torch way. The library is compiled like
`cpu_ops`'s (`g++ -O3 -march=native -fopenmp`, keyed by source, flags and CPU;
its AVX-512 VNNI loops where the compiler targets them, else AVX2 + FMA loops, else
scalar ones)
and called through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from arborlm.kernels import cpu_ops, quant_reference
from arborlm.kernels.quant_layout import QuantWeight

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "quant_layout.h", CSRC / "quant_linear.cpp", CSRC / "quant_dequant.cpp")
ABI_VERSION = 2
# `arborlm_quant_simd`'s codes.
SIMD_NAMES = {0: "scalar", 1: "avx512_vnni", 2: "avx2"}
# Rows up to which the int8 kernel runs (`int8_max_rows`); more rows dequantize the weight
# and take torch's GEMM. bf16 activations on a CPU with AMX: 64, past which oneDNN's AMX
# bf16 GEMM overtakes the int8 dot products (docs/benchmarks.md, "Quantized weights").
# float32 activations (`auto` on CPUs without bf16), and bf16 ones without AMX: 4096 (a
# whole default prefill batch, `max_prefill_tokens`). On an AVX2 EPYC the int8 kernel took
# 0.23-0.88x the time of the float32 GEMM over the dequantized weight from 65 to 4096 rows,
# level with it (1.01x) only for the 49152-row lm_head at 4096; on an AVX-512 BF16 EPYC
# without AMX 0.13-0.97x of oneDNN's bf16 GEMM (docs/kernels.md, "Prefills through the int8
# kernel"). A prompt's rows then round as its decode steps do, whatever else shares the
# prefill (docs/serving.md, "The same answer alone and under load").
INT8_MAX_ROWS = 64
INT8_MAX_ROWS_PREFILL = 4096
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "arborlm_quant_abi_version": ((), _int),
    "arborlm_quant_simd": ((), _int),
    "arborlm_quant_linear": ((_ptr, _i64, _int, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64), _int),
    "arborlm_quant_dequantize": ((_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _int), _int),
}


def int8_max_rows(dtype: torch.dtype) -> int:
    """The most rows of activations in `dtype` that `NativeQuantOps.linear` runs through the
    int8 kernel (more take the dequantized GEMM)."""
    if dtype == torch.bfloat16 and cpu_ops.cpu_has_amx():
        return INT8_MAX_ROWS
    return INT8_MAX_ROWS_PREFILL


class StackedWeights(tuple):
    """Weights stacked by rows (one projection's shards), as `QuantOps.prepare` returns
    them: a tuple of `QuantWeight`; the native ops attach their kernel's arguments,
    computed once, as `native_args`."""

    native_args: tuple | None = None


def load_library(cache_dir: Path) -> ctypes.CDLL:
    """Build (if needed) and load the quantized kernels, with their signatures set.

    Raises
    ------
    KernelBuildError
        When the library cannot be built or loaded, or is of another ABI version.
    """
    path = cpu_ops.build_library(cache_dir, SOURCES, "quant_kernels")
    return cpu_ops.open_library(path, "arborlm_quant_abi_version", ABI_VERSION, _SIGNATURES)


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The loaded library, built once per process; None (logged once) when it cannot be built."""
    return cpu_ops.load_or_none(load_library, "native quantized kernels unavailable, using torch ops")


class QuantOps:
    """The quantized layers' ops in torch (any device): dequantize, then a plain op."""

    native = False

    def prepare(self, weights: Sequence[QuantWeight]) -> StackedWeights:
        """`weights` as `linear` takes them fastest (call once, after loading)."""
        return StackedWeights(weights)

    def linear(
        self, x: torch.Tensor, weights: Sequence[QuantWeight], bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x [W_0; W_1; ...]^T (+ bias)`: the weights stacked by rows (shards of one projection).

        x: (rows, in_features) float32 / bf16; every weight has that in_features.
        weights: a sequence of `QuantWeight`, best from `prepare`.
        bias: (sum of out_features,) in x's dtype, or None.
        Returns (rows, sum of out_features) in x's dtype.
        """
        outs = [quant_reference.quant_linear(x, w) for w in weights]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias

    def embedding(self, weight: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` ((n,) int64, each in [0, out_features)) of the table: (n, in_features) in `dtype`.

        Raises
        ------
        IndexError
            For an id outside the table.
        """
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.out_features):
            raise IndexError(f"token id out of range [0, {weight.out_features})")
        return quant_reference.embedding(weight, ids, dtype)


class NativeQuantOps(QuantOps):
    """`QuantOps` through the C++ kernels; inputs they do not take (not CPU, another
    dtype, strided rows) go the torch way.

    `simd`: which loops the library's decode kernel runs, "avx512_vnni", "avx2" or
    "scalar" (what the compiler targeted for this CPU)."""

    native = True

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.simd = SIMD_NAMES[lib.arborlm_quant_simd()]

    def prepare(self, weights):
        stacked = StackedWeights(weights)
        n = len(weights)
        fmts = (ctypes.c_int32 * n)(*[w.format.code for w in weights])
        ptrs = (ctypes.c_uint64 * (6 * n))(*[p for w in weights for p in _array_pointers(w)])
        heights = (ctypes.c_int64 * n)(*[w.out_features for w in weights])
        # The ctypes arrays ride along so that their addresses stay valid.
        addresses = (ctypes.addressof(fmts), ctypes.addressof(ptrs), ctypes.addressof(heights))
        stacked.native_args = (n, *addresses, sum(w.out_features for w in weights), (fmts, ptrs, heights))
        return stacked

    def linear(self, x, weights, bias=None):
        # Called once per projection per step: the checks use the cheapest tensor attributes.
        ok = (
            x.dim() == 2 and x.is_cpu and x.dtype in _DTYPE_CODES and x.stride(1) == 1
            and (bias is None or (bias.dtype is x.dtype and bias.is_contiguous() and bias.is_cpu))
        )
        if not ok:
            return super().linear(x, weights, bias)
        if x.shape[0] > int8_max_rows(x.dtype):
            return self._dequantized_linear(x, weights, bias)
        args = getattr(weights, "native_args", None) or self.prepare(weights).native_args
        num_parts, fmts, ptrs, heights, out_features, _ = args
        rows, in_features = x.shape
        out = torch.empty((rows, out_features), dtype=x.dtype)
        status = self.lib.arborlm_quant_linear(
            x.data_ptr(), x.stride(0), _DTYPE_CODES[x.dtype], rows, in_features, num_parts, fmts, ptrs, heights,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
        )
        if status != 0:
            raise ValueError(f"arborlm_quant_linear failed ({status})")
        return out

    def _dequantized_linear(self, x: torch.Tensor, weights: Sequence[QuantWeight], bias: torch.Tensor | None):
        """Prefills: dequantize every weight to x's dtype (one buffer), then one GEMM."""
        w = torch.empty((sum(w.out_features for w in weights), x.shape[1]), dtype=x.dtype)
        row = 0
        for part in weights:
            self._dequantize_into(part, None, part.out_features, w[row:row + part.out_features])
            row += part.out_features
        return F.linear(x, w, bias)

    def embedding(self, weight, ids, dtype):
        if dtype not in _DTYPE_CODES or not ids.is_cpu:
            return super().embedding(weight, ids, dtype)
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.shape[0], weight.in_features), dtype=dtype)
        self._dequantize_into(weight, ids, ids.shape[0], out)
        return out

    def _dequantize_into(self, w: QuantWeight, ids: torch.Tensor | None, num_rows: int, out: torch.Tensor) -> None:
        """Rows `ids` (None = the first num_rows) of w into `out` (num_rows, in), rows contiguous."""
        arrays = (ctypes.c_uint64 * 6)(*_array_pointers(w))
        status = self.lib.arborlm_quant_dequantize(
            w.format.code, ctypes.addressof(arrays), w.out_features, w.in_features,
            None if ids is None else ids.data_ptr(), num_rows, out.data_ptr(), out.stride(0), _DTYPE_CODES[out.dtype],
        )
        if status == -2:
            raise IndexError(f"token id out of range [0, {w.out_features})")
        if status != 0:
            raise ValueError(f"arborlm_quant_dequantize failed ({status}) for format {w.fmt}")


class TritonQuantOps(QuantOps):
    """`QuantOps` with the linears of the formats `triton_quant_linear.TRITON_FORMATS`
    covers through the Triton GEMM (CUDA, or the CPU under `TRITON_INTERPRET=1`);
    other formats and the embedding take the torch path."""

    def linear(self, x, weights, bias=None):
        from arborlm.kernels import triton_quant_linear

        if x.dim() != 2 or x.stride(1) != 1 or any(w.fmt not in triton_quant_linear.TRITON_FORMATS for w in weights):
            return super().linear(x, weights, bias)
        outs = [triton_quant_linear.quant_linear(x, w) for w in weights]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias


def _array_pointers(w: QuantWeight) -> list[int]:
    """The addresses of w's six arrays in the kernels' order (0 where the format has none)."""
    return [0 if t is None else t.data_ptr() for t in w.arrays().values()]


def quant_ops(device: torch.device | str, native: bool = True) -> QuantOps:
    """The quantized ops for `device`: the C++ kernels on the CPU when `native` and they
    build here, the Triton GEMM on CUDA when `native` and Triton imports, else torch."""
    if native and torch.device(device).type == "cpu":
        lib = native_library()
        if lib is not None:
            return NativeQuantOps(lib)
    if native and torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return QuantOps()
        return TritonQuantOps()
    return QuantOps()
