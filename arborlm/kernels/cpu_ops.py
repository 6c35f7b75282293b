"""Fused CPU kernels for the decoder layer, built from `csrc/cpu_kernels.cpp` on first use.

On the CPU a decode step of a small model spends as long in the ~40 small torch
ops of each layer (dispatch, allocation, one pass over memory each) as in its
matrix products. `NativeLayerOps` runs each group as one C++ kernel, in float32
with one rounding to the tensor's dtype, as vLLM's and SGLang's CPU kernels do:

- `rms_norm` with the residual add fused (`fused_add_rms_norm`),
- `silu_and_mul` (SwiGLU's activation on the fused gate/up output),
- `rotary_` (in place, reading the cos/sin tables at each token's position),
- `decode_attention` over the paged pool, reading K/V through `req_to_token` in
  place (no gather, no padding; this and the extend kernels in `cpu_attention.py`),
- `extend_attention` (prefill) for bf16 on CPUs with AMX: every request's new
  tokens against its pool rows, S = QK^T and O = PV on AMX tiles, K/V packed once
  per (request, KV head) straight from the pool,
- `linear` for bf16 on CPUs with AMX: up to `AMX_MAX_ROWS` rows (decode steps)
  go through AMX tiles over a weight packed once at load (`pack_amx_weight`),
  streaming the weights at the memory's speed; more rows go to oneDNN; on CPUs
  with AVX-512 BF16 but no AMX, up to `linear_avx512.AVX512_MAX_ROWS` rows take
  `linear_avx512`'s kernel (oneDNN's summation order on the default model).

`LayerOps` is the same interface in plain torch ops: the fallback, and the oracle
the native kernels are tested against. The library is compiled with the system
C++ compiler (`g++ -O3 -march=native -fopenmp`, about a second, no torch headers)
into `ARBORLM_CACHE/kernels/`, keyed by the source, the flags and the CPU; it is
called through ctypes. Where it cannot be built (no compiler), `layer_ops` logs
why once and returns the torch ops.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from arborlm.envs import ENVS
from arborlm.kernels import cpu_linear, linear_avx512
from arborlm.kernels.cpu_attention import (  # noqa: F401  (KV_DTYPE_CODES: the fused layer's too)
    _DTYPE_CODES,
    AMX_QUERY_ROWS,
    AMX_STEP_K,
    KV_DTYPE_CODES,
    NativeAttentionOps,
    _rows_ok,
)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# Headers the sources include: they count in the library's key.
HEADERS = (Path(__file__).parent / "csrc" / "fast_exp.h",)
# -ffp-contract=off: no fused multiply-adds, so float32 results round as torch's ops do.
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
ABI_VERSION = 5
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "arborlm_rms_norm": (ctypes.c_int, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32),
    "arborlm_silu_and_mul": (ctypes.c_int, _ptr, _i64, _ptr, _i64, _i64, _i64),
    "arborlm_rotary": (ctypes.c_int, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr),
    "arborlm_decode_attention": (
        ctypes.c_int, ctypes.c_int, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _f32, _i64, _f32,
        _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr,
    ),
    "arborlm_store_kv_int8": (ctypes.c_int, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr),
    "arborlm_amx_ready": (),
    "arborlm_linear_bf16": (_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64),
    "arborlm_extend_attention": (
        ctypes.c_int, ctypes.c_int, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
        _i64, _i64, _f32, _i64, _f32, _ptr, _i64,
    ),
    "arborlm_extend_attention_bf16": (
        _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _f32, _i64, _f32,
        _ptr, _i64,
    ),
}
_RESTYPES = {"arborlm_amx_ready": ctypes.c_int}
# The AMX linear layer: K is consumed 32 bf16 at a time (AMX_STEP_K), output columns 32 at a time.
AMX_BLOCK_N = 32
# Rows up to which the AMX kernel beats oneDNN here (a whole step: 0.6x the time at 1
# row, 0.78x at 8, 0.85x at 54, 1.07x at 378, 1.2-1.4x at 800-1600); longer inputs
# (prefills) take oneDNN's GEMM.
AMX_MAX_ROWS = 64


class KernelBuildError(RuntimeError):
    """The native CPU kernels could not be compiled or loaded (the message says why)."""


def _cpu_signature() -> str:
    """The CPU's model and flags: `-march=native` code is only valid on the same kind of CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles (its flags list `amx_bf16`); a fact of the machine,
    read once."""
    return " amx_bf16" in _cpu_signature()


def cpu_has_avx512f() -> bool:
    """Whether this CPU has AVX-512F, so that the `-march=native` builds compile their
    AVX-512 loops (without it they run the scalar ones)."""
    return " avx512f" in _cpu_signature()


def library_path(
    cache_dir: Path, compiler: str, sources: tuple[Path, ...] | None = None, stem: str = "cpu_kernels"
) -> Path:
    """Where the library built from the current sources (default `SOURCE` and `HEADERS`;
    headers included), flags and CPU lives."""
    key = hashlib.sha256()
    parts = [src.read_bytes() for src in sources or (SOURCE, *HEADERS)]
    for part in (*parts, " ".join(CXX_FLAGS).encode(), compiler.encode(), _cpu_signature().encode()):
        key.update(part)
    return cache_dir / "kernels" / f"{stem}-{key.hexdigest()[:16]}.so"


def build_library(cache_dir: Path, sources: tuple[Path, ...] | None = None, stem: str = "cpu_kernels") -> Path:
    """Compile the `.cpp` files of `sources` (default `csrc/cpu_kernels.cpp`) into one
    library `cache_dir/kernels/<stem>-<key>.so` unless already there; the other files
    (headers) count in the key only.

    Raises
    ------
    KernelBuildError
        When no C++ compiler is found or compiling fails.
    """
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError("no C++ compiler (g++ or $CXX) on PATH")
    sources = sources or (SOURCE, *HEADERS)
    target = library_path(cache_dir, compiler, sources, stem)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cpp_files = [str(src) for src in sources if src.suffix == ".cpp"]
        done = subprocess.run([compiler, *CXX_FLAGS, *cpp_files, "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KernelBuildError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"{compiler} could not run: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def open_library(path: Path, abi_function: str, abi_version: int,
                 signatures: Mapping[str, tuple[list[Any], Any]]) -> ctypes.CDLL:
    """Load the built library at `path`, check its ABI and set its functions' signatures.

    abi_function: the exported function returning the library's ABI version (an int);
    signatures: function name -> (argtypes, restype) in ctypes types.

    Raises
    ------
    KernelBuildError
        When it cannot be loaded or is of another ABI version than `abi_version`.
    """
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    found = getattr(lib, abi_function)()
    if found != abi_version:
        raise KernelBuildError(f"{path} has ABI {found}, expected {abi_version}")
    for name, (argtypes, restype) in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    return lib


def load_library(cache_dir: Path) -> ctypes.CDLL:
    """Build (if needed) and load the library, with its functions' signatures set.

    Raises
    ------
    KernelBuildError
        When it cannot be built, loaded, or is of another ABI version.
    """
    signatures = {name: (argtypes, _RESTYPES.get(name)) for name, argtypes in _SIGNATURES.items()}
    return open_library(build_library(cache_dir), "arborlm_abi_version", ABI_VERSION, signatures)


def load_or_none(load: Callable[[Path], ctypes.CDLL], unavailable: str,
                 level: int = logging.WARNING) -> ctypes.CDLL | None:
    """``load(ENVS.cache_dir)``, or None where the library cannot be built, with one log line
    ``"<unavailable>: <why>"`` (what runs instead). Each kernel module's `native_library`
    calls it once per process (`functools.cache`)."""
    try:
        return load(ENVS.cache_dir)
    except KernelBuildError as e:
        logger.log(level, "%s: %s", unavailable, e)
        return None


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The loaded library, built once per process; None (logged once) when it cannot be built."""
    return load_or_none(load_library, "native CPU kernels unavailable, using torch ops")


@dataclass
class RotaryStep:
    """The rotary inputs of one step, shared by every layer.

    positions: (num_tokens,) int64. cos_table, sin_table: (max_positions, head_dim)
    in the model dtype, `sin_table` carrying `rotate_half`'s sign (see
    `runtime/layers/rotary_embedding.py`). `cos_sin()` gathers the tables at the positions,
    two `(num_tokens, 1, head_dim)` tensors, once per step (the torch path only; the
    native kernel reads the tables in place).
    """

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    _gathered: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gathered is None:
            self._gathered = (self.cos_table[self.positions].unsqueeze(1), self.sin_table[self.positions].unsqueeze(1))
        return self._gathered


@dataclass(frozen=True)
class AmxWeight:
    """A bf16 weight (out_features, in_features) packed for `arborlm_linear_bf16`.

    data: bf16, (ceil(out/32), in/32, 2, 16, 16, 2): per 32-column block and 32-wide
    step of K, two AMX B tiles of 16 K-pairs x 16 columns in VNNI order (columns
    past out_features are zero).
    """

    data: torch.Tensor
    out_features: int
    in_features: int
    onednn: object | None = None  # `LayerOps.pack_linear`'s copy, for inputs of more rows


def pack_amx_weight(weight: torch.Tensor) -> AmxWeight:
    """Pack a CPU bf16 weight (out, in) for the AMX kernel; `in` must be a multiple of 32.

    Raises
    ------
    ValueError
        For another dtype, device or shape.
    """
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or not weight.is_cpu or weight.shape[1] % AMX_STEP_K:
        raise ValueError(
            f"the AMX linear needs a CPU bf16 (out, in) weight with in % {AMX_STEP_K} == 0, "
            f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    out_features, in_features = weight.shape
    padded = -(-out_features // AMX_BLOCK_N) * AMX_BLOCK_N
    w = weight.new_zeros((padded, in_features))
    w[:out_features] = weight
    # (block, tile, column, k step, pair, 2) -> (block, k step, tile, pair, column, 2)
    data = w.view(padded // AMX_BLOCK_N, 2, 16, in_features // AMX_STEP_K, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return AmxWeight(data.contiguous(), out_features, in_features)


class LayerOps:
    """The decoder layer's elementwise groups and linear layers in plain torch ops (any
    device, any dtype)."""

    native = False

    def pack_linear(self, weight: torch.Tensor) -> object | None:
        """A prepacked copy of a loaded weight (out, in) for `linear`, or None where packing
        gains nothing (float32, not the CPU; see `kernels/cpu_linear.py`)."""
        return cpu_linear.pack_weight(weight) if cpu_linear.can_pack(weight) else None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: object | None
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for x (tokens, in); `packed` from `pack_linear(weight)`."""
        if packed is not None:
            return cpu_linear.packed_linear(x, packed, bias)
        return F.linear(x, weight, bias)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hugging Face `LlamaRMSNorm`; with `residual`, vLLM's `fused_add_rms_norm`.

        x: (tokens, hidden). Without `residual` returns `rms_norm(x) * weight`. With it,
        returns `(rms_norm(x + residual) * weight, x + residual)`; the native version
        writes the sum into `residual` in place.
        """
        if residual is None:
            return F.rms_norm(x, weight.shape, weight, eps)
        residual = x + residual
        return F.rms_norm(residual, weight.shape, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(tokens, 2 * inter) -> (tokens, inter): `silu(gate) * up`."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_(self, x: torch.Tensor, rotary: RotaryStep) -> torch.Tensor:
        """Rotate x (tokens, heads, head_dim) by each token's position: Hugging Face's
        `x * cos + rotate_half(x) * sin`. Returns the rotated tensor (the native version
        rotates x in place and returns it)."""
        cos, sin = rotary.cos_sin()
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


class NativeLayerOps(NativeAttentionOps, LayerOps):
    """`LayerOps` through the C++ kernels; tensors they do not cover (not CPU, not
    float32/bfloat16, strided rows) take the torch path. The attention kernels come
    from `NativeAttentionOps` (`cpu_attention.py`)."""

    native = True

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.amx = bool(lib.arborlm_amx_ready())
        # Without AMX, decode-sized bf16 linears take the AVX-512 BF16 kernel where it builds.
        self.avx512_lib = None if self.amx else linear_avx512.native_library()

    def pack_linear(self, weight):
        ok = (
            self.amx and weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_cpu
            and weight.shape[1] % AMX_STEP_K == 0
        )
        if not ok:
            if self.avx512_lib is not None and linear_avx512.can_pack(weight):
                return linear_avx512.pack_weight(weight, super().pack_linear(weight))
            return super().pack_linear(weight)
        return dataclasses.replace(pack_amx_weight(weight), onednn=super().pack_linear(weight))

    def linear(self, x, weight, bias, packed):
        if isinstance(packed, linear_avx512.Avx512Weight):
            if linear_avx512.fits(x, packed, bias):
                return linear_avx512.linear(self.avx512_lib, x, packed, bias)
            return super().linear(x, weight, bias, packed.onednn)
        if not isinstance(packed, AmxWeight):
            return super().linear(x, weight, bias, packed)
        ok = (
            x.dim() == 2 and x.shape[0] <= AMX_MAX_ROWS and x.dtype is torch.bfloat16 and _rows_ok(x)
            and x.shape[1] == packed.in_features
            and (bias is None or (bias.dtype is torch.bfloat16 and bias.is_contiguous() and bias.is_cpu))
        )
        if not ok:
            return super().linear(x, weight, bias, packed.onednn)
        rows = x.shape[0]
        out = torch.empty((rows, packed.out_features), dtype=torch.bfloat16)
        self.lib.arborlm_linear_bf16(
            x.data_ptr(), x.stride(0), rows, packed.in_features, packed.data.data_ptr(), packed.out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), packed.out_features,
        )
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        # Called twice per layer: the checks use the cheapest tensor attributes.
        dtype, shape = x.dtype, x.shape
        ok = (
            len(shape) == 2 and _rows_ok(x) and weight.dtype is dtype and weight.is_contiguous()
            and weight.shape == shape[1:]
        )
        if residual is not None:
            ok = ok and residual.dtype is dtype and residual.shape == shape and _rows_ok(residual)
        if not ok:
            return super().rms_norm(x, weight, eps, residual)
        rows, dim = shape
        out = torch.empty(shape, dtype=dtype)
        if residual is None:
            res_ptr, res_stride = None, 0
        else:
            res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
        self.lib.arborlm_rms_norm(
            _DTYPE_CODES[dtype], x.data_ptr(), x.stride(0), res_ptr, res_stride,
            weight.data_ptr(), out.data_ptr(), dim, rows, dim, eps,
        )
        return out if residual is None else (out, residual)

    def silu_and_mul(self, gate_up):
        if gate_up.dim() != 2 or not _rows_ok(gate_up):
            return super().silu_and_mul(gate_up)
        rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, dim), dtype=gate_up.dtype)
        self.lib.arborlm_silu_and_mul(
            _DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), dim, rows, dim
        )
        return out

    def rotary_(self, x, rotary):
        ok = (
            x.dim() == 3 and _rows_ok(x) and x.stride(1) == x.shape[2]
            and rotary.cos_table.dtype == x.dtype and rotary.cos_table.is_contiguous()
            and rotary.sin_table.is_contiguous() and rotary.positions.dtype == torch.int64
            and rotary.positions.is_contiguous()
        )
        if not ok:
            return super().rotary_(x, rotary)
        tokens, heads, head_dim = x.shape
        self.lib.arborlm_rotary(
            _DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), tokens, heads, head_dim,
            rotary.positions.data_ptr(), rotary.cos_table.data_ptr(), rotary.sin_table.data_ptr(),
        )
        return x


def layer_ops(device: torch.device | str, native: bool = True) -> LayerOps:
    """The layer ops for `device`: the native kernels on the CPU when `native` and
    they build here, else torch ops."""
    if native and torch.device(device).type == "cpu":
        lib = native_library()
        if lib is not None:
            return NativeLayerOps(lib)
    return LayerOps()
