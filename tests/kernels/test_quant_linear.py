"""The quantized linear kernels (`kernels/quant_ops.py`) against ggml's own dequantizer.

Weights are random, quantized with `gguf.quants.quantize` (the reference Python
port of ggml's quantizers) and packed with `pack_ggml_blocks`. Oracles:

- `gguf.quants.dequantize`: our packing must give back exactly its values, the
  embedding rows too, and the prefill path (more than `INT8_MAX_ROWS` rows, the
  weight dequantized then one GEMM) its matmul within float rounding;
- `quant_reference.int8_linear` (ggml's per-block int8 rounding of the activations
  spelled out in float64): the decode kernel within float32 rounding;
- the float matmul over the dequantized weight: the decode kernel within the noise
  of int8 activations (about 0.5% of the output's norm; 2% allowed).

The C++ library is built twice per module, as `quant_ops` builds it and with
AVX-512 off (the scalar loops), as `test_cpu_ops` does. Widths are whole blocks of
32 (ggml's rule); output widths and row counts are odd where the layout has tiles
of 16 rows, and 65 rows cross into the prefill path.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from arborlm.kernels import cpu_ops, quant_ops, quant_reference  # noqa: E402
from arborlm.kernels.quant_layout import QUANT_FORMATS, cat_rows, pack_ggml_blocks, unpack_rows  # noqa: E402
from arborlm.kernels.quant_ops import INT8_MAX_ROWS, NativeQuantOps, QuantOps  # noqa: E402

GGML_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
}
BUILDS = {"native": (), "no-avx512": ("-mno-avx512f",)}
# (out_features, in_features): tiles of 16 rows cut at odd places; 1, 3, 18 and 48 blocks per row.
SHAPES = [(1, 32), (7, 96), (33, 576), (40, 1536)]
ROWS = [1, 7, 64, 65]
INT8_NOISE = 0.02  # relative Frobenius error allowed against the float matmul


@pytest.fixture(scope="module", params=list(BUILDS))
def native_ops(request, compiler, tmp_path_factory) -> NativeQuantOps:
    """The native ops over a library built once per module for each entry of `BUILDS`."""
    if BUILDS[request.param] and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the {request.param} build passes x86-only flags; this machine is {platform.machine()}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_ops, "CXX_FLAGS", cpu_ops.CXX_FLAGS + BUILDS[request.param])
        lib = quant_ops.load_library(tmp_path_factory.mktemp(f"quant-{request.param}"))
    ops = NativeQuantOps(lib)
    if request.param == "no-avx512":
        assert not ops.simd
    return ops


def ggml_weight(fmt: str, out_features: int, in_features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random weights quantized by gguf: (ggml bytes (out, row bytes) uint8, their dequantized float32)."""
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    raw = gguf.quants.quantize(w, GGML_TYPES[fmt])
    return raw, gguf.quants.dequantize(raw, GGML_TYPES[fmt]).astype(np.float32)


def packed(fmt: str, out_features: int, in_features: int, seed: int = 0):
    """(our packed weight, gguf's dequantized values as a float32 tensor)."""
    raw, values = ggml_weight(fmt, out_features, in_features, seed)
    return pack_ggml_blocks(fmt, torch.from_numpy(raw), in_features), torch.from_numpy(values)


def inputs(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_packing_keeps_ggml_values(fmt, shape):
    weight, values = packed(fmt, *shape)
    assert torch.equal(quant_reference.dequantize(weight), values)
    rows = torch.tensor([shape[0] - 1, 0, shape[0] // 2])
    assert torch.equal(quant_reference.dequantize(weight, rows=rows), values[rows])
    raw, _ = ggml_weight(fmt, *shape)
    assert weight.nbytes <= raw.nbytes * (-(-shape[0] // 16) * 16) / shape[0]  # only the tile padding added


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_native_linear_float32(native_ops, fmt, shape, rows):
    weight, values = packed(fmt, *shape)
    x = inputs(rows, shape[1])
    got = native_ops.linear(x, [weight])
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    oracle = x.double() @ values.double().T
    if rows <= INT8_MAX_ROWS:
        emulated = quant_reference.int8_linear(x, weight)
        scale = emulated.abs().max().clamp_min(1e-30)
        assert float((got.double() - emulated).abs().max() / scale) < 1e-5
        assert rel_err(got, oracle) < INT8_NOISE
    else:  # the prefill path: float32 matmul over the exact dequantized weight
        assert rel_err(got, oracle) < 1e-5


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("rows", [1, 7, 65])
def test_native_linear_bf16_with_bias(native_ops, fmt, rows):
    weight, values = packed(fmt, 33, 576)
    x = inputs(rows, 576).to(torch.bfloat16)
    bias = torch.randn(33, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = native_ops.linear(x, [weight], bias)
    assert got.dtype == torch.bfloat16
    if rows <= INT8_MAX_ROWS:  # float32 sums, one rounding to bf16
        want = (quant_reference.int8_linear(x, weight, bias)).float()
        assert torch.allclose(got.float(), want, rtol=1 / 128, atol=1e-2)
    oracle = x.double() @ values.double().T + bias.double()
    assert rel_err(got, oracle) < INT8_NOISE


def test_native_linear_shards_of_mixed_formats(native_ops):
    """A fused projection whose shards came in different formats: one call, columns in order."""
    parts = [packed(fmt, n, 576, seed=i) for i, (fmt, n) in enumerate([("q4_1", 17), ("q8_0", 32), ("q4_0", 5)])]
    bias = torch.randn(54, generator=torch.Generator().manual_seed(3))
    for rows in (3, 65):
        x = inputs(rows, 576)
        got = native_ops.linear(x, [w for w, _ in parts], bias)
        want = torch.cat([native_ops.linear(x, [w]) for w, _ in parts], dim=1) + bias
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("heights", [(7, 20), (32, 7)])  # repacked rows; whole tiles concatenated
def test_cat_rows_stacks_shards(fmt, heights):
    (a, va), (b, vb) = packed(fmt, heights[0], 96, seed=0), packed(fmt, heights[1], 96, seed=1)
    both = cat_rows([a, b])
    assert both.out_features == sum(heights)
    assert torch.equal(quant_reference.dequantize(both), torch.cat([va, vb]))
    assert torch.equal(unpack_rows(both).quants, torch.cat([unpack_rows(a).quants, unpack_rows(b).quants]))


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows(native_ops, fmt, dtype):
    weight, values = packed(fmt, 50, 576)
    ids = torch.tensor([49, 0, 16, 15, 16, 33])
    for ops in (native_ops, QuantOps()):
        got = ops.embedding(weight, ids, dtype)
        assert got.dtype == dtype and torch.equal(got, values[ids].to(dtype))
        with pytest.raises(IndexError):
            ops.embedding(weight, torch.tensor([50]), dtype)
        with pytest.raises(IndexError):
            ops.embedding(weight, torch.tensor([-1]), dtype)


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("rows", [1, 65])
def test_torch_path_is_the_dequantized_matmul(fmt, rows):
    weight, values = packed(fmt, 33, 576)
    x = inputs(rows, 576)
    bias = torch.randn(33, generator=torch.Generator().manual_seed(4))
    got = QuantOps().linear(x, [weight], bias)
    assert torch.allclose(got, x @ values.T + bias, rtol=1e-5, atol=1e-4)


def test_native_ops_hand_strided_inputs_to_torch(native_ops):
    """A transposed input (columns not contiguous) takes the torch path, same result."""
    weight, values = packed("q4_1", 16, 64)
    x = inputs(64, 3).T  # (3, 64), stride (1, 3)
    assert torch.allclose(native_ops.linear(x, [weight]), x @ values.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("fmt", "raw", "in_features", "message"),
    [
        ("q4_1", torch.zeros((4, 20), dtype=torch.uint8), 33, "multiple of 32"),
        ("q4_1", torch.zeros((4, 21), dtype=torch.uint8), 32, r"\(rows, 20\) uint8"),
        ("q8_0", torch.zeros((4, 34), dtype=torch.int8), 32, "uint8"),
        ("q5_1", torch.zeros((4, 24), dtype=torch.uint8), 32, "unknown quantized format"),
    ],
)
def test_pack_refuses_malformed_data(fmt, raw, in_features, message):
    with pytest.raises(ValueError, match=message):
        pack_ggml_blocks(fmt, raw, in_features)


def test_formats_table_matches_gguf():
    for fmt, qtype in GGML_TYPES.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert (block, size) == (32, QUANT_FORMATS[fmt].ggml_block_bytes)
