"""Seeded sampling on the CPU in one native pass per row, and the penalties before it
(`csrc/sampling.cpp`).

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
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from arborlm.kernels import cpu_ops

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "sampling.cpp", CSRC / "fast_exp.h")
ABI_VERSION = 4
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "arborlm_sampling_abi_version": ((), _int),
    "arborlm_sample_rows": ((_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr), _int),
    "arborlm_apply_penalties": ((_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr), _int),
    "arborlm_row_max": ((_ptr, _i64, _i64, _i64, _ptr, _ptr), _int),
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
    return cpu_ops.load_or_none(load_library, "native CPU sampler unavailable, using torch ops")


def _check_logits(logits: torch.Tensor) -> None:
    """ValueError unless ``logits`` is a (B, V) float32 CPU tensor with contiguous rows (what
    every entry point of the library reads)."""
    if logits.dtype != torch.float32 or not logits.is_cpu or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: (B, V) float32 CPU rows expected, got {logits.dtype} {tuple(logits.shape)} "
                         f"on {logits.device} with strides {logits.stride()}")


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
    temperatures: (B,) float32 contiguous, one per logits row, > 0 on the rows drawn (a row
        of 0 or less gets -1).
    top_ks: (B,) int64, V or more for none; top_ps: (B,) float32, 1 for none;
        min_ps: (B,) float32, 0 for none (each contiguous, one per logits row).
    uniforms: (n,) float64 in [0, 1), one per row drawn, from its request's generator.

    Raises
    ------
    ValueError: ``logits`` is not a float32 CPU tensor with contiguous rows, or an argument
        is not of its dtype, contiguous and of its length.
    """
    _check_logits(logits)
    n, batch = rows.numel(), logits.shape[0]
    expected = ((rows, torch.int64, n), (temperatures, torch.float32, batch), (top_ks, torch.int64, batch),
                (top_ps, torch.float32, batch), (min_ps, torch.float32, batch), (uniforms, torch.float64, n))
    if any(t.dtype != dtype or t.numel() != size or not t.is_contiguous() for t, dtype, size in expected):
        raise ValueError("rows (n,) int64, temperatures, top_ks, top_ps, min_ps (B,) float32 / int64 / float32 / "
                         "float32 and uniforms (n,) float64, each contiguous, are expected")
    tokens = torch.empty(n, dtype=torch.int64)
    if n == 0:
        return tokens
    if bool((rows < 0).any()) or bool((rows >= batch).any()):
        raise ValueError(f"rows must be in [0, {batch})")
    status = lib.arborlm_sample_rows(logits.data_ptr(), logits.stride(0), logits.shape[1], n,
                                     *(t.data_ptr() for t, _, _ in expected), tokens.data_ptr())
    if status != 0:
        raise ValueError(f"arborlm_sample_rows rejected its arguments (status {status})")
    return tokens


def row_max(lib: ctypes.CDLL, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum and the first index holding it, as ``logits.max(dim=-1)``: (B,)
    float32 values and (B,) int64 indices; a row with a NaN gives NaN and its first NaN's
    index, an all -inf row -inf at 0. One pass over each row in lanes (torch's ops took
    60 us at 1 row of 49152 and 300 us at 32 on a 2-core CPU).

    Raises
    ------
    ValueError: ``logits`` is not a (B, V) float32 CPU tensor with contiguous rows, or V is
        0 or 2**31 - 64 or more.
    """
    _check_logits(logits)
    rows = logits.shape[0]
    values, indices = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.int64)
    if rows == 0:
        return values, indices
    status = lib.arborlm_row_max(logits.data_ptr(), logits.stride(0), logits.shape[1], rows, values.data_ptr(),
                                 indices.data_ptr())
    if status != 0:
        raise ValueError(f"arborlm_row_max rejected a ({rows}, {logits.shape[1]}) logits tensor (status {status})")
    return values, indices


def _flat_ids(ids_list: Sequence[Sequence[int]]) -> tuple[array, array]:
    """Rows of token ids (lists, or int32 `array`s, which are copied whole) as one int32
    array and int64 row offsets (len(ids_list) + 1): an `array` from the lists takes ~15 ns
    an id where `torch.tensor` took ~150."""
    offsets = array("q", [0])
    flat = array("i")
    for ids in ids_list:
        try:
            flat.extend(ids)
        except OverflowError:  # ids that do not fit int32 are out of any vocabulary: -1, which the kernel skips
            del flat[offsets[-1]:]
            flat.extend(i if -(2**31) <= i < 2**31 else -1 for i in ids)
        offsets.append(len(flat))
    return flat, offsets


def _pointer(values: array) -> int:
    return values.buffer_info()[0] if len(values) else 0


def apply_penalties(
    lib: ctypes.CDLL,
    logits: torch.Tensor,
    output_ids_list: list[list[int]],
    prompt_ids_list: list[list[int]] | None,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor | None,
    presence: torch.Tensor | None,
) -> None:
    """Repetition (over prompt and output ids), then frequency and presence (over output ids)
    penalties on ``logits`` in place, at the tokens each row has seen only.

    Parameters
    ----------
    lib: `native_library()`.
    logits: (B, V) float32 on the CPU, rows contiguous.
    output_ids_list, prompt_ids_list: B lists of token ids (ids outside [0, V) are ignored);
        prompt ids count for the repetition penalty only (None: no prompt).
    repetition: (B,) float32, or None for no repetition penalty.
    frequency, presence: (B,) float32 each, or both None for neither.

    Raises
    ------
    ValueError: ``logits`` is not a float32 CPU tensor with contiguous rows, or the lists or
        penalties do not have one entry per row.
    """
    rows = logits.shape[0]
    _check_logits(logits)
    lists = [output_ids_list] + ([prompt_ids_list] if prompt_ids_list is not None else [])
    penalties = [p for p in (repetition, frequency, presence) if p is not None]
    if any(len(x) != rows for x in lists) or any(p.numel() != rows for p in penalties):
        raise ValueError(f"one output (and prompt) list and one penalty per row ({rows}) are needed")
    if (frequency is None) != (presence is None):
        raise ValueError("frequency and presence penalties come together (0 for none)")
    out_ids, out_offsets = _flat_ids(output_ids_list)
    prompt_ids, prompt_offsets = _flat_ids(prompt_ids_list) if prompt_ids_list is not None else (None, None)
    floats = [None if p is None else p.to(torch.float32).contiguous() for p in (repetition, frequency, presence)]
    status = lib.arborlm_apply_penalties(
        logits.data_ptr(), logits.stride(0), logits.shape[1], rows, _pointer(out_ids), _pointer(out_offsets),
        None if prompt_ids is None else _pointer(prompt_ids) or None,
        None if prompt_offsets is None else _pointer(prompt_offsets),
        *(None if p is None else p.data_ptr() for p in floats))
    if status != 0:
        raise ValueError(f"arborlm_apply_penalties rejected its arguments (status {status})")
