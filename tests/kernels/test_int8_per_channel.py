"""Weight-only int8 per output channel (`quantization="int8"`): the quantizer, its Q8_0 packing
and the kernels that serve it.

The quantizer is torchao's `Int8WeightOnlyConfig` scheme (symmetric, scale = row absmax / 127);
packed as Q8_0 tiles whose every block holds the row's scale, the packed weight dequantizes to
exactly q * scale, and the C++ decode kernel equals the int8 emulation of `quant_reference`
within float32 rounding and the float matmul within int8 activation noise.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.kernels import quant_ops, quant_reference
from arborlm.kernels.quant_layout import pack_int8_per_channel, quantize_per_channel_int8


def weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)  # rows of different ranges
    w[1] = 0  # an all-zero row
    return w


@pytest.mark.parametrize("shape", [(17, 64), (48, 96), (5, 32)])
def test_quantizer_is_symmetric_per_channel(shape):
    w = weight(*shape)
    q, scale = quantize_per_channel_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (shape[0],)
    assert int(q.abs().max()) <= 127 and int(q[1].abs().max()) == 0
    expected = (w.abs().amax(dim=1) / 127).to(torch.float16)
    torch.testing.assert_close(scale[expected > 0], expected[expected > 0], atol=0, rtol=0)
    error = (w - q.float() * scale.float().unsqueeze(1)).abs()
    assert bool((error <= scale.float().unsqueeze(1) / 2 * (1 + 1e-3) + 1e-7).all())


@pytest.mark.parametrize("shape", [(17, 64), (48, 96)])
def test_packed_weight_dequantizes_to_q_times_scale(shape):
    w = weight(*shape)
    q, scale = quantize_per_channel_int8(w)
    packed = pack_int8_per_channel(w)
    assert packed.fmt == "q8_0" and (packed.out_features, packed.in_features) == shape
    exact = q.float() * scale.float().unsqueeze(1)
    torch.testing.assert_close(quant_reference.dequantize(packed), exact, atol=0, rtol=0)


@pytest.mark.parametrize("shape", [(4, 48), (4,), (0, 32)])
def test_unpackable_shapes_are_refused(shape):
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int8_per_channel(torch.ones(shape))


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 4097])
def test_native_kernel_serves_int8_weights(rows):
    ops = quant_ops.quant_ops("cpu")
    if not ops.native:
        pytest.skip("the quantized C++ kernels do not build here")
    w = weight(40, 96, seed=rows)
    packed = ops.prepare((pack_int8_per_channel(w),))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(40)
    got = ops.linear(x, packed, bias)
    exact = torch.nn.functional.linear(x, quant_reference.dequantize(packed[0]), bias)
    if rows <= quant_ops.int8_max_rows(x.dtype):  # int8 activations: the emulation to rounding, the matmul to noise
        emulated = quant_reference.int8_linear(x, packed[0], bias).float()
        torch.testing.assert_close(got, emulated, atol=1e-4, rtol=1e-4)
        assert float((got - exact).norm() / exact.norm()) < 0.02
    else:  # prefill-sized: dequantized GEMM
        torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-4)
