"""Read a GGUF file's tensors as they are stored: the quantized loader's input.

`read_gguf_file` parses the header, the metadata (keeping the few keys the
loader needs) and the tensor table of a GGUF v2/v3 file (llama.cpp
`docs/gguf.md`), then maps the data section read-only; `GGUFFile.raw` hands out
one tensor's bytes at a time, so no more than one tensor is copied at once. The
`gguf` package's `GGUFReader` reads the same, but parses every metadata array
into Python objects (seconds for a 49k-token vocabulary), so only its type table
and dequantizers are used here. Any malformed or truncated file is a
`ModelLoadError`, checked before a byte of tensor data is used.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from arborlm.errors import ModelLoadError

# GGUF metadata value types (gguf.md): byte sizes of the scalars, and the two with a length.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
# Metadata the loader reads; everything else is skipped unparsed.
_KEPT_KEYS = ("general.architecture", "general.alignment", "general.file_type", "general.name")
# Guards against a corrupt length field asking for gigabytes of names.
_MAX_NAME_BYTES = 1 << 16
_MAX_DIMS = 4


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table.

    name: llama.cpp's name ("blk.0.attn_q.weight"). ggml_type: the GGMLQuantizationType
    value. shape: torch order (rows first: (out, in) for a matrix, (n,) for a vector),
    the reverse of GGUF's dims. offset: bytes from the start of the data section.
    nbytes: its size there.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """ggml's name of the type ("Q4_1", "F32"), or "type <n>" for one gguf does not know."""
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"

    @property
    def row_width(self) -> int:
        """Values per row (GGUF's first dim)."""
        return self.shape[-1]

    @property
    def num_rows(self) -> int:
        return math.prod(self.shape[:-1])


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata kept by `read_gguf_file`, the tensor table, the data."""

    path: Path
    metadata: dict[str, object]
    tensors: list[GGUFTensorInfo]
    data: np.ndarray  # the data section, uint8, memory-mapped read-only

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as (num_rows, bytes per row) uint8 (a view of the mapping)."""
        return self.data[info.offset:info.offset + info.nbytes].reshape(info.num_rows, -1)

    def values(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor dequantized by `gguf.quants.dequantize`, float32 in `info.shape`.

        Raises
        ------
        ModelLoadError
            For a type the gguf package cannot dequantize.
        """
        import gguf

        try:
            return gguf.quants.dequantize(self.raw(info), info.ggml_type).reshape(info.shape).astype(np.float32)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(f"cannot dequantize {info.name} ({info.type_name}) of {self.path}: {exc}") from exc


def read_gguf_file(path: Path) -> GGUFFile:
    """Parse `path`'s header, kept metadata and tensor table; map its data read-only.

    Raises
    ------
    ModelLoadError
        For a file that is not GGUF v2/v3, is truncated, or whose table names a type,
        shape or range that does not fit the file.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            metadata, tensors = _read_tables(f, path)
            alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
            if alignment <= 0 or alignment & (alignment - 1):
                raise ModelLoadError(f"{path} has general.alignment {alignment}, not a power of two")
            data_start = -(-f.tell() // alignment) * alignment
    except _HeaderTruncated as exc:
        raise ModelLoadError(f"GGUF file {str(path)!r} is truncated: {exc}") from None
    except (OSError, struct.error, UnicodeDecodeError, KeyError, OverflowError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {exc!r}") from exc
    for info in tensors:
        if data_start + info.offset + info.nbytes > size:
            raise ModelLoadError(
                f"GGUF file {str(path)!r} is truncated: tensor {info.name} ends at byte "
                f"{data_start + info.offset + info.nbytes}, the file has {size}"
            )
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start) if size > data_start else np.zeros(0, np.uint8)
    return GGUFFile(path, metadata, tensors, data)


def _read_tables(f: BinaryIO, path: Path) -> tuple[dict[str, object], list[GGUFTensorInfo]]:
    magic, version, num_tensors, num_kv = struct.unpack("<4sIQQ", _read(f, 24))
    if magic != b"GGUF" or version not in (2, 3):
        raise ModelLoadError(f"{str(path)!r} is not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    metadata: dict[str, object] = {}
    for _ in range(num_kv):
        key = _read_string(f)
        (value_type,) = struct.unpack("<I", _read(f, 4))
        if key in _KEPT_KEYS and (value_type == _STRING or value_type in _SCALAR_FORMATS):
            metadata[key] = _read_string(f) if value_type == _STRING else _read_scalar(f, value_type)
        else:
            _skip_value(f, value_type)
    return metadata, [_read_tensor_info(f, path) for _ in range(num_tensors)]


def _read_tensor_info(f: BinaryIO, path: Path) -> GGUFTensorInfo:
    import gguf

    name = _read_string(f)
    (num_dims,) = struct.unpack("<I", _read(f, 4))
    if not 1 <= num_dims <= _MAX_DIMS:
        raise ModelLoadError(f"{path}: tensor {name} has {num_dims} dims")
    dims = struct.unpack(f"<{num_dims}Q", _read(f, 8 * num_dims))
    ggml_type, offset = struct.unpack("<IQ", _read(f, 12))
    try:
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from exc
    if dims[0] % block or 0 in dims:
        raise ModelLoadError(f"{path}: tensor {name} has dims {dims}, not whole blocks of {block}")
    nbytes = math.prod(dims) // block * type_bytes
    return GGUFTensorInfo(name, ggml_type, tuple(reversed(dims)), offset, nbytes)


class _HeaderTruncated(Exception):
    """The header ends early (`read_gguf_file` names the file)."""


def _read(f: BinaryIO, n: int) -> bytes:
    at = f.tell()
    data = f.read(n)
    if len(data) != n:
        raise _HeaderTruncated(f"its header ends at byte {at + len(data)}, inside a field of {n} bytes at byte {at}")
    return data


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", _read(f, 8))
    if length > _MAX_NAME_BYTES:
        raise ModelLoadError(f"GGUF string of {length} bytes in the header: corrupt file")
    return _read(f, length).decode("utf-8")


def _read_scalar(f: BinaryIO, value_type: int) -> object:
    return struct.unpack(_SCALAR_FORMATS[value_type], _read(f, _SCALAR_BYTES[value_type]))[0]


def _skip_value(f: BinaryIO, value_type: int) -> None:
    """Move past one value of `value_type` (KeyError for an unknown type)."""
    if value_type == _STRING:
        (length,) = struct.unpack("<Q", _read(f, 8))
        f.seek(length, os.SEEK_CUR)
    elif value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", _read(f, 12))
        if item_type in _SCALAR_BYTES:
            f.seek(count * _SCALAR_BYTES[item_type], os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    else:
        f.seek(_SCALAR_BYTES[value_type], os.SEEK_CUR)
