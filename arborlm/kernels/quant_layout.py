"""The packed layout of GGUF-quantized weights: ggml blocks in, our tiled rows out.

A quantized linear layer (`runtime/layers/quantization/`) packs each GGUF tensor
once at load with `pack_ggml_blocks`, and every later step streams the result
(`quant_ops.py` in C++, `quant_reference.py` in torch). The bits are ggml's
(`ggml_blocks.py` reads them into quants and scales per block of 32 values), only
reordered; `csrc/quant_layout.h` describes the order and why. In short, rows go in
tiles of 16 (the last padded with zero rows) and every array is ordered (tile,
block, ..., row):

- `qs` (tiles, blocks, chunks, 16 rows, 4) uint8: each row's quant bytes of a block
  in 4-byte chunks (Q8_0's quants + 128; the other formats' low 4 bits, Q4's order);
- `scales` / `mins` (tiles, blocks or super-blocks, 16) fp16: ggml's d and m (Q4_1),
  or a K-quant's super-block d and dmin;
- `highbits` (tiles, blocks, planes, 4 chunks, 2 halves, 8) uint8: Q5_K's fifth bit
  (one plane) or Q6_K's two high bits, one 64-bit mask per (chunk, half) whose bit
  4 r + v is value 16 half + 4 chunk + v of row r (an AVX-512 byte mask as is);
- `sub_scales` (tiles, blocks, [2,] 16): K-quant block scales (Q6_K's int8, per half
  block); `sub_mins` (tiles, blocks, 16) uint8: Q4_K / Q5_K block mins.

Plain tensors only; nothing here knows about models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from arborlm.kernels.ggml_blocks import (
    BLOCK,
    RECORD_BYTES,
    RECORD_VALUES,
    GgmlRows,
    parse_ggml_blocks,
)

TILE = 16  # rows interleaved together: one per 32-bit lane of an AVX-512 register
SUPER = 8  # blocks of 32 per K-quant super-block


@dataclass(frozen=True)
class QuantFormat:
    """One ggml block format we serve.

    code: the format id of `csrc/quant_layout.h`. quant_bytes: bytes of one block's
    `qs` (32 for Q8_0, 16 for 4-bit low parts). offset: stored quant minus offset =
    ggml's signed quant. has_min: a per-block min (Q4_1 adds it, K-quants subtract it).
    planes: high-bit planes beyond the low 4 (Q5_K 1, Q6_K 2). k_quant: scales per
    super-block of 256 values with sub-scales per block.
    """

    name: str
    code: int
    quant_bytes: int
    offset: int
    has_min: bool
    planes: int = 0
    k_quant: bool = False

    @property
    def nibbles(self) -> bool:
        """Whether two quants share a byte of `qs` (all but Q8_0)."""
        return self.quant_bytes == BLOCK // 2

    @property
    def ggml_block_bytes(self) -> int:
        return RECORD_BYTES[self.name]

    @property
    def ggml_block_values(self) -> int:
        return RECORD_VALUES[self.name]


QUANT_FORMATS: dict[str, QuantFormat] = {
    "q8_0": QuantFormat("q8_0", 0, 32, 128, False),
    "q4_0": QuantFormat("q4_0", 1, 16, 8, False),
    "q4_1": QuantFormat("q4_1", 2, 16, 0, True),
    "q4_k": QuantFormat("q4_k", 3, 16, 0, True, k_quant=True),
    "q5_k": QuantFormat("q5_k", 4, 16, 0, True, planes=1, k_quant=True),
    "q6_k": QuantFormat("q6_k", 5, 16, 32, False, planes=2, k_quant=True),
}


@dataclass(frozen=True)
class QuantWeight:
    """A weight (out_features, in_features) packed for the quantized kernels.

    fmt: a key of `QUANT_FORMATS`. The arrays (module docstring), each (tiles, -1)
    with tiles = ceil(out_features / 16); those a format does not use are None.
    """

    fmt: str
    out_features: int
    in_features: int
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    highbits: torch.Tensor | None = None
    sub_scales: torch.Tensor | None = None
    sub_mins: torch.Tensor | None = None

    @property
    def format(self) -> QuantFormat:
        return QUANT_FORMATS[self.fmt]

    @property
    def num_blocks(self) -> int:
        """Blocks of 32 per row."""
        return self.in_features // BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: about the GGUF tensor's, plus padding rows up to a tile."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def arrays(self) -> dict[str, torch.Tensor | None]:
        """Name -> array, in the kernels' pointer order (None where the format has none)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("fmt", "out_features", "in_features")}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds this weight."""
        return tuple(t for t in self.arrays().values() if t is not None)


def ggml_row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one ggml row of `in_features` values in format `fmt`."""
    f = QUANT_FORMATS[fmt]
    return in_features // f.ggml_block_values * f.ggml_block_bytes


def pack_ggml_blocks(fmt: str, raw: torch.Tensor, in_features: int) -> QuantWeight:
    """Pack a ggml tensor's bytes into a `QuantWeight`.

    Parameters
    ----------
    fmt: a key of `QUANT_FORMATS`.
    raw: (out_features, ggml_row_bytes(fmt, in_features)) uint8, the tensor as stored
        in the GGUF file (rows of ggml blocks; little-endian fp16 scales).
    in_features: values per row, a multiple of the format's block (32; 256 for K-quants).

    Raises
    ------
    ValueError
        For an unknown format, an in_features not a whole number of blocks, or `raw`
        of another shape or dtype.
    """
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {sorted(QUANT_FORMATS)}")
    f = QUANT_FORMATS[fmt]
    if in_features <= 0 or in_features % f.ggml_block_values:
        raise ValueError(f"{fmt} rows hold a multiple of {f.ggml_block_values} values, got in_features={in_features}")
    expected = ggml_row_bytes(fmt, in_features)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != expected or raw.shape[0] == 0:
        raise ValueError(f"{fmt} data must be (rows, {expected}) uint8, got {raw.dtype} {tuple(raw.shape)}")
    return pack_rows(fmt, parse_ggml_blocks(fmt, raw.numpy()))


def pack_rows(fmt: str, rows: GgmlRows) -> QuantWeight:
    """Rows as quants and scales -> the tiled layout (rows padded with zeros up to a tile)."""
    n, nb, width = rows.quants.shape
    tiles = -(-n // TILE)
    # 4-byte chunks as int32: (tiles, 16 rows, nb, chunks) -> (tiles, nb, chunks, 16 rows)
    qs = _tiled(rows.quants.contiguous().view(torch.int32), tiles).view(torch.uint8).reshape(tiles, -1)
    highbits = None if rows.high is None else _tiled_bits(rows.high, tiles, QUANT_FORMATS[fmt].planes)
    return QuantWeight(
        fmt, n, nb * BLOCK, qs, _tiled(rows.scales, tiles), _tiled(rows.mins, tiles), highbits,
        _tiled(rows.sub_scales, tiles), _tiled(rows.sub_mins, tiles),
    )


def _tiled(t: torch.Tensor | None, tiles: int) -> torch.Tensor | None:
    """(n, X, *inner) per-row array -> (tiles, X * prod(inner) * 16) ordered (tile, X, *inner, row)."""
    if t is None:
        return None
    pad = tiles * TILE - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    t = t.reshape(tiles, TILE, *t.shape[1:])
    return t.permute(0, *range(2, t.dim()), 1).contiguous().reshape(tiles, -1)


def _tiled_bits(high: torch.Tensor, tiles: int, planes: int) -> torch.Tensor:
    """(n, nb, 32) high parts -> (tiles, nb * planes * 4 * 2 * 8) bit masks (module docstring)."""
    h = high.numpy()
    pad = tiles * TILE - h.shape[0]
    if pad:
        h = np.concatenate([h, np.zeros((pad, *h.shape[1:]), h.dtype)])
    # value i = 16 half + 4 chunk + v: (tiles, rows, nb, half, chunk, v) -> (tiles, nb, chunk, half, rows, v)
    h = h.reshape(tiles, TILE, -1, 2, 4, 4).transpose(0, 2, 4, 3, 1, 5)
    bits = [((h >> p) & 1).reshape(*h.shape[:4], TILE * 4) for p in range(planes)]  # bit 4 r + v
    masks = [np.packbits(b, axis=-1, bitorder="little") for b in bits]  # 64 bits -> 8 bytes per (chunk, half)
    return torch.from_numpy(np.ascontiguousarray(np.stack(masks, axis=2))).reshape(tiles, -1)


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a float weight (torchao's
    `Int8WeightOnlyConfig` scheme): `weight[r] ~ q[r] * scale[r]`.

    Parameters
    ----------
    weight: (out_features, in_features), any float dtype.

    Returns
    -------
    (q, scale): q (out, in) int8 in [-127, 127]; scale (out,) float16, absmax / 127 of
    the row rounded to fp16 (the kernels read fp16 scales), 1 for an all-zero row.
    q is rounded against the fp16 scale, so q * scale is the value the kernels use.
    """
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.float().unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_int8_per_channel(weight: torch.Tensor) -> QuantWeight:
    """A float weight (out, in) quantized per channel (`quantize_per_channel_int8`) and
    packed as Q8_0 tiles, each block of 32 holding its row's scale, so the Q8_0 kernels
    serve it unchanged (1 + 2/32 bytes per weight).

    Raises
    ------
    ValueError
        For a weight that is not 2-D or whose in_features is not a multiple of 32.
    """
    if weight.dim() != 2 or weight.shape[1] % BLOCK or weight.shape[0] == 0:
        raise ValueError(
            f"int8 weights need a 2-D weight with in_features a multiple of {BLOCK}, got shape {tuple(weight.shape)}"
        )
    q, scale = quantize_per_channel_int8(weight)
    n, k = q.shape
    quants = (q.view(torch.uint8) ^ 0x80).reshape(n, k // BLOCK, BLOCK)  # Q8_0's stored + 128
    return pack_rows("q8_0", GgmlRows(quants, scale.unsqueeze(1).expand(n, k // BLOCK).contiguous()))


def unpack_rows(weight: QuantWeight, rows: torch.Tensor | None = None) -> GgmlRows:
    """Rows `rows` ((n,) int64; None = all) of a packed weight, back as quants and scales."""
    nb, f = weight.num_blocks, weight.format
    shapes = {  # each array's (X, *inner) per row
        "scales": (nb // SUPER,) if f.k_quant else (nb,),
        "mins": (nb // SUPER,) if f.k_quant else (nb,),
        "sub_scales": (nb, 2) if f.name == "q6_k" else (nb,),
        "sub_mins": (nb,),
    }
    quants = _untiled(weight.qs.view(torch.int32), (nb, f.quant_bytes // 4), weight.out_features, rows)
    quants = quants.contiguous().view(torch.uint8).reshape(quants.shape[0], nb, f.quant_bytes)
    found = {name: _untiled(getattr(weight, name), shape, weight.out_features, rows) for name, shape in shapes.items()}
    high = None if weight.highbits is None else _untiled_bits(weight, rows)
    return GgmlRows(quants, found["scales"], found["mins"], high, found["sub_scales"], found["sub_mins"])


def _untiled(t: torch.Tensor | None, shape: tuple[int, ...], n: int, rows: torch.Tensor | None) -> torch.Tensor | None:
    """The inverse of `_tiled`, for all rows (the first n) or rows `rows`."""
    if t is None:
        return None
    t = t.reshape(t.shape[0], *shape, TILE)
    if rows is not None:
        return t[(rows // TILE, *(slice(None),) * len(shape), rows % TILE)]
    return t.permute(0, t.dim() - 1, *range(1, t.dim() - 1)).reshape(-1, *shape)[:n]


def _untiled_bits(weight: QuantWeight, rows: torch.Tensor | None) -> torch.Tensor:
    """`highbits` back to (n, nb, 32) high parts."""
    tiles, nb, planes = weight.qs.shape[0], weight.num_blocks, weight.format.planes
    masks = weight.highbits.reshape(tiles, nb, planes, 4, 2, 8).to(torch.int32)
    bits = (masks.unsqueeze(-1) >> torch.arange(8)) & 1  # (tiles, nb, planes, chunk, half, 8 bytes, 8 bits)
    bits = bits.reshape(tiles, nb, planes, 4, 2, TILE, 4)  # bit 4 r + v -> (row, v)
    high = sum(bits[:, :, p] << p for p in range(planes))  # (tiles, nb, chunk, half, rows, v)
    high = high.permute(0, 4, 1, 3, 2, 5).reshape(tiles * TILE, nb, 32)  # value 16 half + 4 chunk + v
    return (high[:weight.out_features] if rows is None else high[rows]).to(torch.uint8)


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
        arrays = {name: None if t is None else torch.cat([w.arrays()[name] for w in weights])
                  for name, t in first.arrays().items()}
        return replace(first, out_features=out_features, **arrays)
    parts = [unpack_rows(w) for w in weights]
    stacked = [None if p is None else torch.cat([part[i] for part in parts]) for i, p in enumerate(parts[0])]
    return pack_rows(first.fmt, GgmlRows(*stacked))


INT4_GROUP_SIZES = (32, 128)  # values per int4 group: the kernels' block, or four of them


def quantize_groupwise_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, ...]:
    """Asymmetric group-wise 4-bit quantization of a float weight:
    `weight[r, j] ~ q[r, j] * scale[r, g] + minimum[r, g]` with g = j // group_size.

    Per group, scale = (max - min) / 15 and minimum = min, both rounded to fp16 (the kernels
    read fp16), and q = round((w - minimum) / scale) in [0, 15] against the rounded values:
    ggml's Q4_1 rule (`quantize_row_q4_1_ref`) with a group of `group_size` values (the zero
    point is the float minimum, as in HQQ's and torchao's float zero-point domain). A search
    for the range of least squared error per group (AWQ-style clipping) was tried and dropped:
    on the default model it gave perplexity 1.059x of bf16 against 1.047x for plain min / max
    (docs/kernels.md).

    Parameters
    ----------
    weight: (out_features, in_features), any float dtype; in_features a multiple of group_size.
    group_size: values per group, one of `INT4_GROUP_SIZES`.

    Returns
    -------
    (q, scale, minimum): q (out, in) uint8 in [0, 15]; scale and minimum (out, in / group_size)
    float16; a constant group gets scale 1 and q 0.

    Raises
    ------
    ValueError
        For a group size not in `INT4_GROUP_SIZES`, or a weight that is not 2-D, is empty, or
        whose in_features is not a multiple of group_size.
    """
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] == 0 or weight.shape[1] % group_size:
        raise ValueError(
            f"int4 weights need a 2-D weight with in_features a multiple of group_size={group_size}, "
            f"got shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    minimum = lo.to(torch.float16)
    q = torch.round((w - minimum.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, 15)
    return q.reshape(n, k).to(torch.uint8), scale, minimum


def pack_int4_groupwise(weight: torch.Tensor, group_size: int = 32) -> QuantWeight:
    """A float weight (out, in) quantized to 4 bits per group (`quantize_groupwise_int4`) and
    packed as Q4_1 tiles, each block of 32 holding its group's scale and minimum, so the Q4_1
    kernels (VNNI int8 dot products at decode, a dequantized GEMM at prefill) serve it
    unchanged: 0.5 + 4/32 bytes per weight for either group size (a group of 128 repeats its
    scale over four blocks: no smaller, only a coarser fit).

    Raises
    ------
    ValueError
        As `quantize_groupwise_int4`.
    """
    q, scale, minimum = quantize_groupwise_int4(weight, group_size)
    n, k = q.shape
    repeat = group_size // BLOCK
    blocks = q.reshape(n, k // BLOCK, 2, BLOCK // 2)  # Q4's byte order: value j low, value j + 16 high
    quants = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).contiguous()
    scales = scale.repeat_interleave(repeat, dim=1).contiguous()
    mins = minimum.repeat_interleave(repeat, dim=1).contiguous()
    return pack_rows("q4_1", GgmlRows(quants, scales, mins))
