"""bf16 linear layers of decode steps on AVX-512 BF16 CPUs without AMX (issue 25).

A decode step of a small model reads every weight once; at a few rows oneDNN's bf16 GEMM
streams them here at a fraction of the memory's speed (the step profile of
`benchmarks/bench_decode_step.py`). `csrc/linear_bf16_avx512.cpp` reads a weight packed
once at load (`pack_weight`: 16-column blocks, pairs of input features interleaved, the
layout `vdpbf16ps` takes) with up to 4 rows per pass, in the summation order oneDNN takes
on the default model's shapes (see the source). `NativeLayerOps` sends bf16 inputs of up
to `AVX512_MAX_ROWS` rows here on such CPUs and larger ones to oneDNN; the torch path
(`F.linear`) is the oracle in the tests. The library is built like `cpu_ops`'s, as its own
file.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = (Path(__file__).parent / "csrc" / "linear_bf16_avx512.cpp",)
ABI_VERSION = 2
# Output columns per packed block and input features per pair (the kernel's layout).
BLOCK_N = 16
# Rows up to which decode steps take the kernel: measured here (the default model's 30
# layers of linears, one thread) at 0.65x oneDNN's time at 1 row, 0.74x at 8, 1.1x at 32.
# With `k_block_for` its outputs are oneDNN's bit for bit on the default model up to 16
# rows at least (tested up to this bound).
AVX512_MAX_ROWS = 8
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "arborlm_gemv_abi_version": ((), ctypes.c_int),
    "arborlm_linear_bf16_avx512_ready": ((), ctypes.c_int),
    "arborlm_linear_bf16_avx512": ((_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64), None),
}


@dataclass(frozen=True)
class Avx512Weight:
    """A bf16 weight (out_features, in_features) packed for `arborlm_linear_bf16_avx512`.

    data: bf16 (out / 16, in / 2, 16, 2): block b, pair i holds
    `weight[16 b + j, 2 i + t]` at [b, i, j, t].
    k_block: input features the kernel sums apart before adding the blocks' sums
        (`k_block_for`).
    onednn: `LayerOps.pack_linear`'s copy, for inputs of more rows.
    """

    data: torch.Tensor
    out_features: int
    in_features: int
    k_block: int
    onednn: object | None = None


def k_block_for(in_features: int) -> int:
    """The summation block oneDNN's bf16 GEMM takes at decode sizes on AVX-512 BF16 CPUs, as
    measured on the default model's K (576: 512 + 64; 1536: 1024 + 512): matching it keeps
    that model's outputs bit for bit oneDNN's (`tests/kernels/test_linear_avx512.py`)."""
    return 1024 if in_features > 1024 else 512


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` fits the kernel: a 2-D CPU bf16 (out, in), out % 16 == 0, in even."""
    return (
        weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_cpu
        and weight.shape[0] % BLOCK_N == 0 and weight.shape[1] % 2 == 0
    )


def pack_weight(weight: torch.Tensor, onednn: object | None = None) -> Avx512Weight:
    """Pack `weight` (out, in) for the kernel.

    Raises
    ------
    ValueError
        When `can_pack(weight)` does not hold.
    """
    if not can_pack(weight):
        raise ValueError(
            f"the AVX-512 linear needs a CPU bf16 (out, in) weight with out % {BLOCK_N} == 0 and even in, "
            f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    out_features, in_features = weight.shape
    # (block, column, pair, 2) -> (block, pair, column, 2)
    data = weight.view(out_features // BLOCK_N, BLOCK_N, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    return Avx512Weight(data, out_features, in_features, k_block_for(in_features), onednn)


def fits(x: torch.Tensor, packed: Avx512Weight, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes `x` (rows, in) with `bias`: bf16 CPU rows, at most `AVX512_MAX_ROWS`."""
    return (
        x.dim() == 2 and x.shape[0] <= AVX512_MAX_ROWS and x.dtype is torch.bfloat16 and x.is_cpu
        and x.stride(-1) == 1 and x.shape[1] == packed.in_features
        and (bias is None or (bias.dtype is torch.bfloat16 and bias.is_contiguous() and bias.is_cpu))
    )


def linear(lib: ctypes.CDLL, x: torch.Tensor, packed: Avx512Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the kernel; `fits(x, packed, bias)` must hold.

    x: (rows, in) bf16, rows contiguous; returns (rows, out) bf16.
    """
    rows = x.shape[0]
    out = torch.empty((rows, packed.out_features), dtype=torch.bfloat16)
    lib.arborlm_linear_bf16_avx512(
        x.data_ptr(), x.stride(0), rows, packed.in_features, packed.k_block, packed.data.data_ptr(), packed.out_features,
        None if bias is None else bias.data_ptr(), out.data_ptr(), packed.out_features,
    )
    return out


def load_library(cache_dir: Path) -> ctypes.CDLL:
    """Build (if needed) and load the kernel's library, with its signatures set.

    Raises
    ------
    KernelBuildError
        When it cannot be built or loaded, is of another ABI version, or was built
        for a CPU without AVX-512 BF16.
    """
    # Imported here: cpu_ops imports this module for `NativeLayerOps`.
    from arborlm.kernels import cpu_ops

    path = cpu_ops.build_library(cache_dir, SOURCES, "linear_avx512")
    lib = cpu_ops.open_library(path, "arborlm_gemv_abi_version", ABI_VERSION, _SIGNATURES)
    if not lib.arborlm_linear_bf16_avx512_ready():
        raise cpu_ops.KernelBuildError("this CPU has no AVX-512 BF16")
    return lib


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The loaded library, once per process; None (logged once at info) where it cannot be built."""
    from arborlm.kernels import cpu_ops

    return cpu_ops.load_or_none(load_library, "AVX-512 bf16 linear kernel unavailable, using oneDNN", logging.INFO)
