"""The quantized linear kernels (`kernels/quant_ops.py`) against ggml's own dequantizer.

Weights are random: quantized with `gguf.quants.quantize` (the Python port of ggml's
quantizers) for Q8_0 / Q4_0 / Q4_1, random block bytes with finite fp16 scales for the
K-quants (the package has no K-quant quantizer; every bit pattern is a valid block),
then packed with `pack_ggml_blocks`. Oracles:

- `gguf.quants.dequantize`: our packing must give back exactly its values, the
  embedding rows too, and the prefill path (more than `int8_max_rows(dtype)` rows, the
  weight dequantized then one GEMM) its matmul within float rounding;
- `quant_reference.int8_linear` (ggml's per-block int8 rounding of the activations
  spelled out in float64): the decode kernel within float32 rounding;
- the float matmul over the dequantized weight: the decode kernel within the noise
  of int8 activations (`int8_noise`).

The C++ library is built three times per module: as `quant_ops` builds it, with
AVX-512 off (the AVX2 loops) and with AVX2 off too (the scalar loops). Widths are whole blocks (32;
256 for K-quants, ggml's rule); output widths and row counts are odd where the layout
has tiles of 16 rows, and 65 rows cross into the prefill path.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from arborlm.kernels import cpu_ops, quant_ops, quant_reference  # noqa: E402
from arborlm.kernels.quant_layout import QUANT_FORMATS, cat_rows, pack_ggml_blocks, unpack_rows  # noqa: E402
from arborlm.kernels.quant_ops import NativeQuantOps, QuantOps, int8_max_rows  # noqa: E402

T = gguf.GGMLQuantizationType
GGML_TYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
K_QUANTS = ("q4_k", "q5_k", "q6_k")
# Byte offsets of the fp16 scales in a K-quant block (random bytes elsewhere).
K_SCALE_BYTES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
# native: what this CPU takes; no-avx512: the AVX2 loops (on a CPU with AVX2); scalar: neither.
BUILDS = {"native": (), "no-avx512": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-avx2")}
# (out_features, blocks of the format per row): tiles of 16 rows cut at odd places.
SHAPES = [(1, 1), (7, 3), (33, 18), (40, 48)]
CASES = [(fmt, (n, blocks * (256 if fmt in K_QUANTS else 32))) for fmt in GGML_TYPES for n, blocks in SHAPES
         if fmt not in K_QUANTS or blocks <= 6]
ROWS = [1, 7, 64, 65]
INT8_NOISE = 0.05  # `int8_noise` allowed


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
        assert ops.simd in ("avx2", "scalar")
    if request.param == "scalar":
        assert ops.simd == "scalar"
    return ops


def ggml_weight(fmt: str, out_features: int, in_features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random ggml blocks: (bytes (out, row bytes) uint8, gguf's dequantized float32 values)."""
    rng = np.random.default_rng(seed)
    if fmt in K_QUANTS:
        block, size = gguf.GGML_QUANT_SIZES[GGML_TYPES[fmt]]
        raw = rng.integers(0, 256, (out_features, in_features // block, size), dtype=np.uint8)
        for at in K_SCALE_BYTES[fmt]:
            scales = rng.uniform(0.002, 0.02, raw.shape[:2]).astype(np.float16)
            raw[:, :, at:at + 2] = scales[..., None].view(np.uint8)
        raw = raw.reshape(out_features, -1)
    else:
        w = rng.standard_normal((out_features, in_features)).astype(np.float32)
        raw = gguf.quants.quantize(w, GGML_TYPES[fmt])
    return raw, gguf.quants.dequantize(raw, GGML_TYPES[fmt]).astype(np.float32)


def width(fmt: str, blocks_of_256: int = 3) -> int:
    """An in_features every format takes (a whole number of K-quant blocks)."""
    return 256 * blocks_of_256


def packed(fmt: str, out_features: int, in_features: int, seed: int = 0):
    """(our packed weight, gguf's dequantized values as a float32 tensor)."""
    raw, values = ggml_weight(fmt, out_features, in_features, seed)
    return pack_ggml_blocks(fmt, torch.from_numpy(raw), in_features), torch.from_numpy(values)


def inputs(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def int8_noise(got: torch.Tensor, x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None = None) -> float:
    """The largest error against the float matmul, in units of |x_m| |w_n| / sqrt(in): the
    size of one output of random data, which a wrong kernel misses by about 1; int8
    activations (steps of max|x| / 127 per block of 32) by about 0.006."""
    x, w = x.double(), values.double()
    want = x @ w.T + (0 if bias is None else bias.double())
    unit = torch.outer(x.norm(dim=1), w.norm(dim=1)) / x.shape[1] ** 0.5
    return float(((got.double() - want).abs() / unit.clamp_min(1e-30)).max())


@pytest.mark.parametrize(("fmt", "shape"), CASES)
def test_packing_keeps_ggml_values(fmt, shape):
    weight, values = packed(fmt, *shape)
    assert torch.equal(quant_reference.dequantize(weight), values)
    rows = torch.tensor([shape[0] - 1, 0, shape[0] // 2])
    assert torch.equal(quant_reference.dequantize(weight, rows=rows), values[rows])
    raw, _ = ggml_weight(fmt, *shape)
    assert weight.nbytes <= 1.03 * raw.nbytes * (-(-shape[0] // 16) * 16) / shape[0]  # about the tile padding only


@pytest.mark.parametrize(("fmt", "shape"), CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_native_linear_float32(native_ops, fmt, shape, rows):
    weight, values = packed(fmt, *shape)
    x = inputs(rows, shape[1])
    got = native_ops.linear(x, [weight])
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    oracle = x.double() @ values.double().T
    if rows <= int8_max_rows(torch.float32):
        emulated = quant_reference.int8_linear(x, weight)
        scale = emulated.abs().max().clamp_min(1e-30)
        assert float((got.double() - emulated).abs().max() / scale) < 1e-5
        assert int8_noise(got, x, values) < INT8_NOISE
    else:  # the prefill path: float32 matmul over the exact dequantized weight
        assert rel_err(got, oracle) < 1e-5


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
def test_native_linear_rows_do_not_depend_on_each_other(native_ops, fmt):
    """Each row's output is the same bits alone, in a batch of 300 rows (a prefill through
    the int8 kernel) and in any slice of it: a prompt gives the same K/V prefilled in
    chunks, in a batch or alone."""
    weight, _ = packed(fmt, 33, width(fmt))
    x = inputs(300, width(fmt))
    full = native_ops.linear(x, [weight])
    for lo, hi in ((0, 1), (7, 8), (8, 9), (150, 151), (299, 300), (100, 200), (3, 67)):
        assert torch.equal(native_ops.linear(x[lo:hi], [weight]), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("out_features", [16, 32, 45])
def test_native_linear_wide_passes_keep_each_rows_bits(native_ops, fmt, out_features):
    """Calls of 10 rows or more run their passes (16, 8 and the rest) over two weight tiles
    at once on AVX-512 VNNI (`kPairFromRows`), one tile where a single tile is left (1, 2
    and 3 tiles here, the last one partial at 45): every row's output is the bits of that
    row run alone, and of calls cut anywhere around the passes, paired or not."""
    weight, _ = packed(fmt, out_features, width(fmt))
    x = inputs(40, width(fmt))
    full = native_ops.linear(x, [weight])
    for row in (0, 15, 16, 31, 32, 39):
        assert torch.equal(native_ops.linear(x[row:row + 1], [weight]), full[row:row + 1]), row
    for lo, hi in ((0, 9), (0, 10), (3, 15), (0, 16), (0, 17), (0, 32), (8, 40), (1, 33)):
        assert torch.equal(native_ops.linear(x[lo:hi], [weight]), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
def test_native_linear_float32_past_the_int8_bound(native_ops, fmt):
    """More rows than `int8_max_rows(float32)` (a prefill batch past it): the weight
    dequantized, then one float32 GEMM, within float rounding of the exact matmul."""
    weight, values = packed(fmt, 7, width(fmt))
    x = inputs(int8_max_rows(torch.float32) + 1, width(fmt))
    assert rel_err(native_ops.linear(x, [weight]), x.double() @ values.double().T) < 1e-5


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("rows", [1, 7, 65])
def test_native_linear_bf16_with_bias(native_ops, fmt, rows):
    weight, values = packed(fmt, 33, width(fmt))
    x = inputs(rows, width(fmt)).to(torch.bfloat16)
    bias = torch.randn(33, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = native_ops.linear(x, [weight], bias)
    assert got.dtype == torch.bfloat16
    if rows <= int8_max_rows(torch.bfloat16):  # float32 sums, one rounding to bf16
        want = (quant_reference.int8_linear(x, weight, bias)).float()
        assert torch.allclose(got.float(), want, rtol=1 / 128, atol=1e-2)
    if rows <= int8_max_rows(torch.bfloat16):
        assert int8_noise(got, x, values, bias) < INT8_NOISE + 2 ** -8  # and one bf16 rounding


def test_native_linear_shards_of_mixed_formats(native_ops):
    """A fused projection whose shards came in different formats: one call, columns in order."""
    shards = [("q4_1", 17), ("q8_0", 32), ("q6_k", 16), ("q4_0", 5), ("q5_k", 3)]
    parts = [packed(fmt, n, width(fmt), seed=i) for i, (fmt, n) in enumerate(shards)]
    bias = torch.randn(73, generator=torch.Generator().manual_seed(3))
    for rows in (3, 65):
        x = inputs(rows, width("q4_k"))
        got = native_ops.linear(x, [w for w, _ in parts], bias)
        want = torch.cat([native_ops.linear(x, [w]) for w, _ in parts], dim=1) + bias
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # one GEMM against one per part


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("heights", [(7, 20), (32, 7)])  # repacked rows; whole tiles concatenated
def test_cat_rows_stacks_shards(fmt, heights):
    (a, va), (b, vb) = packed(fmt, heights[0], width(fmt, 1), seed=0), packed(fmt, heights[1], width(fmt, 1), seed=1)
    both = cat_rows([a, b])
    assert both.out_features == sum(heights)
    assert torch.equal(quant_reference.dequantize(both), torch.cat([va, vb]))
    assert torch.equal(unpack_rows(both).quants, torch.cat([unpack_rows(a).quants, unpack_rows(b).quants]))


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows(native_ops, fmt, dtype):
    weight, values = packed(fmt, 50, width(fmt))
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
    weight, values = packed(fmt, 33, width(fmt))
    x = inputs(rows, width(fmt))
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
        ("q4_k", torch.zeros((4, 144), dtype=torch.uint8), 128, "multiple of 256"),
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
        f = QUANT_FORMATS[fmt]
        assert gguf.GGML_QUANT_SIZES[qtype] == (f.ggml_block_values, f.ggml_block_bytes)


@pytest.mark.parametrize("fmt", list(GGML_TYPES))
def test_largest_products_do_not_saturate(native_ops, fmt):
    """Every quant at its format's extreme and activations at +-127 of matching signs: each
    pair of products is the largest the int16 sums of the AVX2 loops see (`chunks_per_i16`);
    the kernel still equals the int8 oracle."""
    in_features = width(fmt, 2)
    if fmt == "q8_0":  # quants +-127 (and -128 in a hand-made block), signs alternating per block
        w = np.ones((16, in_features), dtype=np.float32)
        w[:, 32:64] = -1
        raw = gguf.quants.quantize(w, T.Q8_0).reshape(16, -1, 34)
        raw[0, 0, 2:] = np.uint8(0x80)  # -128: |w| is 128 for the sign trick
        raw = raw.reshape(16, -1)
    else:
        block, size = gguf.GGML_QUANT_SIZES[GGML_TYPES[fmt]]
        raw = np.full((16, in_features // block, size), 0xFF, dtype=np.uint8)  # every quant bit set
        for at in {**K_SCALE_BYTES, "q4_0": (0,), "q4_1": (0, 2)}[fmt]:  # the block's fp16 scales
            raw[:, :, at:at + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
        raw = raw.reshape(16, -1)
    weight = pack_ggml_blocks(fmt, torch.from_numpy(raw), in_features)
    x = torch.full((3, in_features), 2.0)
    x[1] = -2.0
    x[2, 32:64] = -2.0
    want = quant_reference.int8_linear(x, weight)
    got = native_ops.linear(x, native_ops.prepare([weight]))
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quants_are_ggml_q8_0_bit_for_bit(native_ops, dtype):
    """The int8 activations the kernel computes, read back through an identity Q8_0 weight
    (scale 1, quant 1 on the diagonal: output n is quant n times its block's scale, one
    float32 rounding) against `quant_reference.quantize_activations`, exactly. Rows hold
    ties (values k + 0.5 in a block whose max is 127: round half to even), an all-zero
    block, a block of one large value among tiny ones, and random blocks."""
    in_features = 128
    raw = np.zeros((in_features, in_features // 32, 34), dtype=np.uint8)
    raw[:, :, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    for n in range(in_features):
        raw[n, n // 32, 2 + n % 32] = 1
    weight = native_ops.prepare([pack_ggml_blocks("q8_0", torch.from_numpy(raw.reshape(in_features, -1)), in_features)])
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(4)) * 3
    x[0, :32] = torch.arange(32) - 15.5  # ties once scaled by 127 / 127
    x[0, 31] = 127.0
    x[1, 32:64] = 0.0
    x[2, 64:96] = 1e-3
    x[2, 70] = -250.0
    x = x.to(dtype)
    act = quant_reference.quantize_activations(x)
    want = (act.quants.float() * act.scales.unsqueeze(-1)).reshape(x.shape[0], -1)
    got = native_ops.linear(x, weight) if dtype == torch.float32 else native_ops.linear(x, weight).float()
    want = want if dtype == torch.float32 else want.to(torch.bfloat16).float()
    assert torch.equal(got, want)
