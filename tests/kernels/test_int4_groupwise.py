"""Weight-only int4, a scale and zero point per group (`quantization="int4"`): the quantizer,
its Q4_1 packing and the kernels that serve it.

The quantizer's output is held to its definition (q in [0, 15], q * scale + minimum within half
a step of each value, the range each group's min / max); the
packed weight dequantizes to exactly q * scale + minimum for group 32 and 128; the C++ decode
kernel equals `quant_reference.int8_linear`'s emulation to float rounding and the float matmul
over the dequantized weight to int8-activation noise, for 1, 8 and 33 rows and odd output
heights; prefill-sized inputs equal the dequantized GEMM.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.kernels import quant_ops, quant_reference
from arborlm.kernels.quant_layout import pack_int4_groupwise, quantize_groupwise_int4


def weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)  # rows of different ranges
    w[1] = 0.25  # a constant row
    w[2, 5] = 8.0  # an outlier
    return w


def groupwise(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in / group) per-group values spread to (out, in)."""
    return values.float().repeat_interleave(group_size, dim=1)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("shape", [(17, 128), (3, 256)])
def test_quantizer_rounds_each_group_to_16_levels(shape, group_size):
    w = weight(*shape)
    q, scale, minimum = quantize_groupwise_int4(w, group_size)
    groups = shape[1] // group_size
    assert q.dtype == torch.uint8 and q.shape == shape and int(q.max()) <= 15
    assert scale.dtype == minimum.dtype == torch.float16 and scale.shape == minimum.shape == (shape[0], groups)
    s, m = groupwise(scale, group_size), groupwise(minimum, group_size)
    rebuilt = q.float() * s + m
    inside = (w >= m - 1e-6) & (w <= m + 15 * s + 1e-6)  # values the range did not clip
    assert bool(((rebuilt - w).abs()[inside] <= s[inside] / 2 * (1 + 1e-3) + 1e-6).all())
    torch.testing.assert_close(rebuilt[1], torch.full((shape[1],), 0.25), atol=1e-3, rtol=0)  # a constant row
    # the range is each group's min / max: its extremes are exact up to fp16 rounding
    groups_w = w.reshape(shape[0], groups, -1)
    torch.testing.assert_close(minimum.float(), groups_w.amin(-1), atol=1e-3, rtol=1e-3)
    spread = groups_w.amax(-1) > groups_w.amin(-1)  # a constant group has scale 1
    top = minimum.float() + 15 * scale.float()
    torch.testing.assert_close(top[spread], groups_w.amax(-1)[spread], atol=2e-2, rtol=2e-3)


@pytest.mark.parametrize("group_size", [32, 128])
def test_packed_weight_dequantizes_to_q_times_scale_plus_minimum(group_size):
    w = weight(37, 256)
    q, scale, minimum = quantize_groupwise_int4(w, group_size)
    packed = pack_int4_groupwise(w, group_size)
    assert packed.fmt == "q4_1" and (packed.out_features, packed.in_features) == (37, 256)
    exact = q.float() * groupwise(scale, group_size) + groupwise(minimum, group_size)
    torch.testing.assert_close(quant_reference.dequantize(packed), exact, atol=0, rtol=0)
    assert float((exact - w).norm() / w.norm()) < 0.12  # 4 bits: about 8 % relative error on Gaussian rows


@pytest.mark.parametrize(("shape", "group_size"), [((4, 96), 128), ((4, 48), 32), ((4,), 32), ((0, 32), 32)])
def test_unpackable_shapes_are_refused(shape, group_size):
    with pytest.raises(ValueError, match="multiple of group_size"):
        pack_int4_groupwise(torch.ones(shape), group_size)


def test_unknown_group_size_is_refused():
    with pytest.raises(ValueError, match="group_size"):
        quantize_groupwise_int4(torch.ones(4, 64), 64)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("rows", [1, 8, 33, 65, 4097])
def test_native_kernel_serves_int4_weights(rows, group_size):
    ops = quant_ops.quant_ops("cpu")
    if not ops.native:
        pytest.skip("the quantized C++ kernels do not build here")
    w = weight(45, 256, seed=rows)  # 45 rows: a partial tile
    packed = ops.prepare((pack_int4_groupwise(w, group_size),))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(45)
    got = ops.linear(x, packed, bias)
    oracle = quant_ops.QuantOps().linear(x, packed, bias)  # the torch path: dequantize, matmul
    if rows <= quant_ops.int8_max_rows(x.dtype):  # int8 activations: the emulation to rounding, the matmul to noise
        emulated = quant_reference.int8_linear(x, packed[0], bias).float()
        torch.testing.assert_close(got, emulated, atol=1e-4, rtol=1e-4)
        assert float((got - oracle).norm() / oracle.norm()) < 0.02
    else:  # prefill-sized: dequantized GEMM
        torch.testing.assert_close(got, oracle, atol=1e-4, rtol=1e-4)


def test_native_kernel_takes_bf16_activations():
    ops = quant_ops.quant_ops("cpu")
    if not ops.native:
        pytest.skip("the quantized C++ kernels do not build here")
    packed = ops.prepare((pack_int4_groupwise(weight(40, 128)),))
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = ops.linear(x, packed)
    assert got.dtype == torch.bfloat16
    emulated = quant_reference.int8_linear(x, packed[0]).float()
    torch.testing.assert_close(got.float(), emulated, atol=2e-2, rtol=1e-2)
