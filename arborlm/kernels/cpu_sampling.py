"""Seeded sampling on the CPU in one native pass per row (`csrc/sampling.cpp`).

Place in the request path: `runtime.sampling_filters.sample_rows` draws the sampled rows
of a decode step (and each chain row of a speculative verify step) here when the logits
are on the CPU and the library builds; elsewhere it takes the torch path
(`sampling_probs` and `sample_from_probs`), which is also this kernel's oracle in tests.

The math of a row is in the source's header: temperature and softmax, then top-k, top-p
(over top-k's survivors) and min-p in rank order (probability descending, ties by token
id), then an inverse-CDF draw with the row's uniform. Only the tokens the filters can
keep are sorted (those above the highest of a few thresholds that holds top-k's count and
top-p's mass), so a row costs two passes over its logits: for 8 rows of 49152 tokens the
torch ops took about 4 ms on a 2-core CPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from arborlm.envs import ENVS
from arborlm.kernels import cpu_ops
from arborlm.kernels.cpu_ops import KernelBuildError

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "sampling.cpp", CSRC / "fast_exp.h")
ABI_VERSION = 1
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "arborlm_sampling_abi_version": ((), _int),
    "arborlm_sample_rows": ((_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr), _int),
}


def load_library(cache_dir: Path) -> ctypes.CDLL:
    """Build (if needed) and load the sampler, with its signatures set.

    Raises
    ------
    KernelBuildError
        When the library cannot be built or loaded, or is of another ABI version.
    """
    path = cpu_ops.build_library(cache_dir, SOURCES, "sampling")
    return cpu_ops.open_library(path, "arborlm_sampling_abi_version", ABI_VERSION, _SIGNATURES)


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The loaded library, built once per process; None (logged once) when it cannot be built."""
    try:
        return load_library(ENVS.cache_dir)
    except KernelBuildError as e:
        logger.warning("native CPU sampler unavailable, using torch ops: %s", e)
        return None


def sample_rows(
    lib: ctypes.CDLL,
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per sampled row: (n,) int64, -1 where the row's probabilities are not
    finite or sum to 0.

    Parameters
    ----------
    lib: `native_library()`.
    logits: (B, V) float32 on the CPU, rows contiguous (penalties and masks applied).
    rows: (n,) int64, which rows of ``logits`` to draw.
    temperatures: (n,) float32, > 0 (a row of 0 or less gets -1).
    top_ks: (n,) int64, V or more for none; top_ps: (n,) float32, 1 for none;
    min_ps: (n,) float32, 0 for none.
    uniforms: (n,) float64 in [0, 1), one per row from its request's generator.

    Raises
    ------
    ValueError: ``logits`` is not a float32 CPU tensor with contiguous rows.
    """
    if logits.dtype != torch.float32 or not logits.is_cpu or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: (B, V) float32 CPU rows expected, got {logits.dtype} {tuple(logits.shape)} "
                         f"on {logits.device} with strides {logits.stride()}")
    n = rows.numel()
    args = [rows.to(torch.int64), temperatures.to(torch.float32), top_ks.to(torch.int64),
            top_ps.to(torch.float32), min_ps.to(torch.float32), uniforms.to(torch.float64)]
    args = [a.contiguous() for a in args]
    tokens = torch.empty(n, dtype=torch.int64)
    if n == 0:
        return tokens
    status = lib.arborlm_sample_rows(logits.data_ptr(), logits.stride(0), logits.shape[1], n,
                                     *(a.data_ptr() for a in args), tokens.data_ptr())
    if status != 0:
        raise ValueError(f"arborlm_sample_rows rejected its arguments (status {status})")
    return tokens
