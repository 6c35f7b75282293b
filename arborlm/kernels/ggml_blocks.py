"""Read ggml's quantized blocks into their integer quants and scales, row by row.

`quant_layout.pack_ggml_blocks` calls `parse_ggml_blocks` on a GGUF tensor's bytes,
then tiles what it returns. The block layouts are llama.cpp's (`ggml-common.h`,
`dequantize_row_*` in `ggml-quants.c`; the `gguf` package's `quants.py` is their
Python port and our tests' oracle):

- Q8_0 / Q4_0 / Q4_1: 32 values; fp16 d (Q4_1 also fp16 m), 32 int8 quants or
  16 bytes of 4-bit quants (byte j: value j low, value j + 16 high).
  Values d * q, d * (q - 8), d * q + m.
- Q4_K / Q5_K: 256 values = 8 blocks of 32; fp16 d and dmin, 12 bytes of 6-bit
  block scales sc and mins m (`get_scale_min_k4`), 128 bytes of low 4-bit quants
  (32-byte piece j: block 2j in the low nibbles, block 2j + 1 in the high ones), and
  for Q5_K 32 bytes of fifth bits (bit s of byte l: value l of block s).
  Values d * sc * q - dmin * m.
- Q6_K: 256 values = 16 blocks of 16; 128 bytes of low 4 bits, 64 bytes of high 2
  bits, 16 int8 scales, fp16 d (last). Values d * sc * (q - 32).

Everything is returned per block of 32 values, the unit of our kernels: low 4 bits
in Q4's byte order, the bits above them apart (`high`), scales per block (Q6_K: per
half block). Plain numpy/torch; no model knowledge.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

BLOCK = 32  # values per block of our kernels
SUPER_BLOCK = 256  # values per K-quant block


class GgmlRows(NamedTuple):
    """Rows of a weight as integer quants and scales, per block of 32 values.

    quants: (rows, blocks, quant_bytes) uint8: Q8_0's 32 quants + 128; otherwise the
        low 4 bits of 32 quants in Q4's byte order (16 bytes).
    scales: fp16, (rows, blocks) ggml's d, or (rows, blocks / 8) a K-quant's super-block d.
    mins: the same for Q4_1's m and Q4_K / Q5_K's dmin; else None.
    high: (rows, blocks, 32) uint8, each quant's bits above the low 4 (Q5_K, Q6_K); else None.
    sub_scales: Q4_K / Q5_K (rows, blocks) uint8 sc; Q6_K (rows, blocks, 2) int8, one per
        half block; else None.
    sub_mins: Q4_K / Q5_K (rows, blocks) uint8 m; else None.
    """

    quants: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    high: torch.Tensor | None = None
    sub_scales: torch.Tensor | None = None
    sub_mins: torch.Tensor | None = None


_RECORDS = {
    "q8_0": [("d", "<f2"), ("qs", "u1", (32,))],
    "q4_0": [("d", "<f2"), ("qs", "u1", (16,))],
    "q4_1": [("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))],
    "q4_k": [("d", "<f2"), ("dmin", "<f2"), ("sc", "u1", (12,)), ("qs", "u1", (128,))],
    "q5_k": [("d", "<f2"), ("dmin", "<f2"), ("sc", "u1", (12,)), ("qh", "u1", (32,)), ("qs", "u1", (128,))],
    "q6_k": [("ql", "u1", (128,)), ("qh", "u1", (64,)), ("sc", "i1", (16,)), ("d", "<f2")],
}
RECORD_BYTES = {fmt: np.dtype(fields).itemsize for fmt, fields in _RECORDS.items()}
RECORD_VALUES = {fmt: SUPER_BLOCK if fmt.endswith("_k") else BLOCK for fmt in _RECORDS}


def parse_ggml_blocks(fmt: str, raw: np.ndarray) -> GgmlRows:
    """Split ggml blocks (rows, row bytes) uint8 of format `fmt` into a `GgmlRows`."""
    blocks = raw.view(np.dtype(_RECORDS[fmt])).reshape(raw.shape[0], -1)  # (rows, ggml blocks)
    if fmt in ("q8_0", "q4_0", "q4_1"):
        quants = blocks["qs"] ^ 0x80 if fmt == "q8_0" else blocks["qs"]  # Q8_0: int8 q -> uint8 q + 128
        mins = _tensor(blocks["m"]) if fmt == "q4_1" else None
        return GgmlRows(_tensor(quants), _tensor(blocks["d"]), mins)
    if fmt == "q6_k":
        return _parse_q6_k(blocks)
    return _parse_q45_k(fmt, blocks)


def _tensor(a: np.ndarray) -> torch.Tensor:
    # A copy, not `ascontiguousarray`: that keeps a record field's strides where a dim is 1,
    # and torch's byte-to-int32 views need the plain ones.
    return torch.from_numpy(np.array(a, order="C", copy=True))


def _as_blocks_of_32(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, n, 256) quants -> (rows, n * 8, 16) low-nibble bytes in Q4 order, (rows, n * 8, 32) high bits."""
    q = q.reshape(q.shape[0], -1, BLOCK)
    low = q & 0x0F
    return low[..., :16] | (low[..., 16:] << 4), q >> 4


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's `get_scale_min_k4` on (..., 12) bytes: the 8 six-bit scales and mins, (..., 8) each."""
    sc = np.empty(packed.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = packed[..., 0:4] & 63
    m[..., :4] = packed[..., 4:8] & 63
    sc[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    m[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    return sc, m


def _parse_q45_k(fmt: str, blocks: np.ndarray) -> GgmlRows:
    rows = blocks.shape[0]
    qs = blocks["qs"].reshape(rows, -1, 4, 32)  # 4 pieces of 32 bytes: blocks 2j (low), 2j + 1 (high)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1, SUPER_BLOCK)
    if fmt == "q5_k":
        bits = (blocks["qh"][:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (rows, n, 8, 32)
        q = q | (bits.reshape(rows, -1, SUPER_BLOCK) << 4)
    low, high = _as_blocks_of_32(q)
    sc, m = _scale_min_k4(blocks["sc"])
    return GgmlRows(
        _tensor(low), _tensor(blocks["d"]), _tensor(blocks["dmin"]),
        _tensor(high) if fmt == "q5_k" else None, _tensor(sc.reshape(rows, -1)), _tensor(m.reshape(rows, -1)),
    )


def _parse_q6_k(blocks: np.ndarray) -> GgmlRows:
    rows = blocks.shape[0]
    ql = blocks["ql"].reshape(rows, -1, 2, 64)  # per 128 values: 64 bytes of low bits
    qh = blocks["qh"].reshape(rows, -1, 2, 32)  # per 128 values: 32 bytes of 2-bit pairs
    # Values 0-31, 32-63, 64-95, 96-127 of each half: ql[:32] low, ql[32:] low, ql[:32] high, ql[32:] high.
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=-1)
    q = (low | (high << 4)).reshape(rows, -1, SUPER_BLOCK)
    nibbles, high_bits = _as_blocks_of_32(q)
    return GgmlRows(
        _tensor(nibbles), _tensor(blocks["d"]), None, _tensor(high_bits), _tensor(blocks["sc"].reshape(rows, -1, 2)),
    )
