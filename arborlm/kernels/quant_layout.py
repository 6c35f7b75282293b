"""The packed layout of GGUF-quantized weights: ggml blocks in, our interleaved rows out.

A quantized linear layer (`runtime/layers/quantization/`) packs each GGUF tensor
once at load with `pack_ggml_blocks`, and every later step streams the result
(`quant_ops.py` in C++, `quant_reference.py` in torch). The bits are ggml's
(llama.cpp `ggml-common.h`), only reordered; `csrc/quant_layout.h` describes the
order and why:

- ggml: a row of K values is K / 32 blocks; block_q8_0 = {fp16 d; int8 qs[32]},
  block_q4_0 = {fp16 d; uint8 qs[16]}, block_q4_1 = {fp16 d, m; uint8 qs[16]}
  (q4 byte j: value j in the low nibble, value j + 16 in the high one). Values:
  Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m.
- ours: rows in tiles of 16 (the last padded with zero rows); `qs` (tiles,
  K / 32 * 16 * quant bytes) uint8 holds, per tile and block, the block's quant
  bytes of the 16 rows ordered (4-byte chunk, row, byte); Q8_0's quants are
  stored + 128 (uint8, for VNNI's unsigned x signed products); `scales` and
  `mins` (tiles, K / 32 * 16) fp16, ggml's d and m, ordered (block, row).

Plain tensors only; nothing here knows about models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

BLOCK = 32  # values per block (all three formats)
TILE = 16  # rows interleaved together: one per 32-bit lane of an AVX-512 register


@dataclass(frozen=True)
class QuantFormat:
    """One ggml block format we serve.

    code: the format id of `csrc/quant_layout.h`. ggml_block_bytes: bytes of one
    ggml block (scales + quants). header_bytes: its fp16 scale (and min) before the
    quants. quant_bytes: bytes of one block's quants. offset: stored quant minus
    offset = ggml's signed quant. has_min: Q4_1's per-block additive m.
    """

    name: str
    code: int
    ggml_block_bytes: int
    header_bytes: int
    quant_bytes: int
    offset: int
    has_min: bool

    @property
    def nibbles(self) -> bool:
        """Whether two quants share a byte (4-bit formats)."""
        return self.quant_bytes == BLOCK // 2


QUANT_FORMATS: dict[str, QuantFormat] = {
    "q8_0": QuantFormat("q8_0", 0, 34, 2, 32, 128, False),
    "q4_0": QuantFormat("q4_0", 1, 18, 2, 16, 8, False),
    "q4_1": QuantFormat("q4_1", 2, 20, 4, 16, 0, True),
}


@dataclass(frozen=True)
class QuantWeight:
    """A weight (out_features, in_features) packed for the quantized kernels.

    fmt: a key of `QUANT_FORMATS`. qs: (tiles, in / 32 * 16 * quant_bytes) uint8.
    scales: (tiles, in / 32 * 16) fp16. mins: the same for Q4_1, else None.
    tiles = ceil(out_features / 16).
    """

    fmt: str
    out_features: int
    in_features: int
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def format(self) -> QuantFormat:
        return QUANT_FORMATS[self.fmt]

    @property
    def num_blocks(self) -> int:
        """Blocks per row (in_features / 32)."""
        return self.in_features // BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: the GGUF tensor's, plus padding rows up to a tile."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds this weight."""
        return (self.qs, self.scales) if self.mins is None else (self.qs, self.scales, self.mins)


class GgmlRows(NamedTuple):
    """Rows of a weight in ggml's order: quants (rows, blocks, quant_bytes) uint8 as
    stored (Q8_0 + 128), scales (rows, blocks) fp16, mins likewise or None."""

    quants: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None


def ggml_row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one ggml row of `in_features` values (a multiple of 32) in format `fmt`."""
    return in_features // BLOCK * QUANT_FORMATS[fmt].ggml_block_bytes


def pack_ggml_blocks(fmt: str, raw: torch.Tensor, in_features: int) -> QuantWeight:
    """Pack a ggml tensor's bytes into a `QuantWeight`.

    Parameters
    ----------
    fmt: "q8_0", "q4_0" or "q4_1".
    raw: (out_features, ggml_row_bytes(fmt, in_features)) uint8, the tensor as stored
        in the GGUF file (rows of ggml blocks; little-endian fp16 scales).
    in_features: values per row, a multiple of 32.

    Raises
    ------
    ValueError
        For an unknown format, an in_features not a multiple of 32, or `raw` of
        another shape or dtype.
    """
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {sorted(QUANT_FORMATS)}")
    if in_features <= 0 or in_features % BLOCK:
        raise ValueError(f"{fmt} rows hold a multiple of {BLOCK} values, got in_features={in_features}")
    f = QUANT_FORMATS[fmt]
    expected = ggml_row_bytes(fmt, in_features)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != expected or raw.shape[0] == 0:
        raise ValueError(f"{fmt} data must be (rows, {expected}) uint8, got {raw.dtype} {tuple(raw.shape)}")
    # ggml's block as a numpy record: fp16 fields and the quant bytes come out as
    # (rows, nb[, bytes]) arrays in one strided copy each (torch copies strided bytes slowly).
    header = [("d", "<f2"), ("m", "<f2")] if f.has_min else [("d", "<f2")]
    record = np.dtype([*header, ("qs", "u1", (f.quant_bytes,))])
    blocks = raw.numpy().view(record).reshape(raw.shape[0], in_features // BLOCK)
    quants = np.ascontiguousarray(blocks["qs"])
    if fmt == "q8_0":
        quants ^= 0x80  # int8 q -> uint8 q + 128
    mins = _as_fp16(blocks["m"]) if f.has_min else None
    return pack_rows(fmt, GgmlRows(torch.from_numpy(quants), _as_fp16(blocks["d"]), mins))


def _as_fp16(field: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(field))


def pack_rows(fmt: str, rows: GgmlRows) -> QuantWeight:
    """Rows in ggml's order -> the tiled layout (rows padded with zeros up to a tile)."""
    n, nb, width = rows.quants.shape
    tiles = -(-n // TILE)

    def tiled(t: torch.Tensor) -> torch.Tensor:
        pad = tiles * TILE - n
        return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t

    # 4-byte chunks as int32: (tiles, 16 rows, nb, chunks) -> (tiles, nb, chunks, 16 rows)
    chunks = tiled(rows.quants.contiguous()).view(torch.int32).reshape(tiles, TILE, nb, width // 4)
    qs = chunks.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(tiles, -1)

    def tiled_scales(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else tiled(t).reshape(tiles, TILE, nb).transpose(1, 2).reshape(tiles, -1).contiguous()

    return QuantWeight(fmt, n, nb * BLOCK, qs, tiled_scales(rows.scales), tiled_scales(rows.mins))


def unpack_rows(weight: QuantWeight, rows: torch.Tensor | None = None) -> GgmlRows:
    """Rows `rows` ((n,) int64; None = all) of a packed weight, back in ggml's order."""
    tiles, nb, width = weight.qs.shape[0], weight.num_blocks, weight.format.quant_bytes
    chunks = weight.qs.view(torch.int32).view(tiles, nb, width // 4, TILE)

    def scales_of(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.view(tiles, nb, TILE)
        if rows is None:
            return t.transpose(1, 2).reshape(tiles * TILE, nb)[:weight.out_features]
        return t[rows // TILE, :, rows % TILE]

    if rows is None:
        quants = chunks.permute(0, 3, 1, 2).reshape(tiles * TILE, nb, width // 4)[:weight.out_features]
    else:
        quants = chunks[rows // TILE, :, :, rows % TILE]
    quants = quants.contiguous().view(torch.uint8).reshape(quants.shape[0], nb, width)
    return GgmlRows(quants, scales_of(weight.scales), scales_of(weight.mins))


def cat_rows(weights: Sequence[QuantWeight]) -> QuantWeight:
    """Stack weights of one format and width by rows (the shards of a fused projection).

    Tiles are concatenated as they are when every part but the last fills its tiles
    (q/k/v and gate/up of real models); otherwise rows are unpacked and packed again.

    Raises
    ------
    ValueError
        When the formats or widths differ.
    """
    first = weights[0]
    if any(w.fmt != first.fmt or w.in_features != first.in_features for w in weights):
        raise ValueError("cat_rows needs weights of one format and in_features")
    out_features = sum(w.out_features for w in weights)
    if all(w.out_features % TILE == 0 for w in weights[:-1]):
        mins = None if first.mins is None else torch.cat([w.mins for w in weights])
        return QuantWeight(
            first.fmt, out_features, first.in_features, torch.cat([w.qs for w in weights]),
            torch.cat([w.scales for w in weights]), mins,
        )
    parts = [unpack_rows(w) for w in weights]
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    quants = torch.cat([p.quants for p in parts])
    return pack_rows(first.fmt, GgmlRows(quants, torch.cat([p.scales for p in parts]), mins))
