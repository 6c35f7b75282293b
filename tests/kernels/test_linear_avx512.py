"""The AVX-512 BF16 linear kernel of decode steps against its oracles (issue 25).

The torch path (`F.linear` on bf16, i.e. oneDNN) is the oracle: on the default model's shapes
at decode sizes the kernel must give its bits exactly (that is what keeps greedy tokens where
they were), elsewhere within one bf16 rounding of a float64 product.
"""

import pytest
import torch
import torch.nn.functional as F

from arborlm.kernels import cpu_linear, cpu_ops, linear_avx512

lib = linear_avx512.native_library()
pytestmark = pytest.mark.skipif(lib is None, reason="no AVX-512 BF16 kernel on this CPU")

# SmolLM2-135M's linears: qkv, o_proj, gate_up, down, lm_head.
# On AMX CPUs oneDNN's bf16 linear runs on AMX tiles (another summation order) and decode
# takes the AMX kernel, not this one: oneDNN's bits are this kernel's oracle only without AMX.
_native = cpu_ops.native_library()
ONEDNN_ON_AMX = _native is not None and cpu_ops.NativeLayerOps(_native).amx

DEFAULT_MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def _weight(n, k, seed=0):
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


def _rows(rows, k, seed=1):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_pack_layout():
    w = _weight(32, 6)
    data = linear_avx512.pack_weight(w).data
    assert data.shape == (2, 3, 16, 2)
    for b, i, j, t in [(0, 0, 0, 0), (1, 2, 15, 1), (0, 1, 7, 1), (1, 0, 3, 0)]:
        assert data[b, i, j, t] == w[16 * b + j, 2 * i + t]


@pytest.mark.parametrize("shape", [(64, 0), (33, 64), (32, 63)])
def test_pack_refuses_what_the_kernel_cannot_read(shape):
    with pytest.raises(ValueError, match="AVX-512 linear"):
        linear_avx512.pack_weight(torch.zeros(shape, dtype=torch.bfloat16)[:, : shape[1]] if shape[1] else
                                  torch.zeros(shape[0], dtype=torch.bfloat16))
    assert not linear_avx512.can_pack(torch.zeros(32, 64))  # float32


@pytest.mark.parametrize("n,k", DEFAULT_MODEL_SHAPES)
@pytest.mark.skipif(ONEDNN_ON_AMX, reason="AMX CPU: oneDNN's bf16 linear uses AMX tiles, so it is not this kernel's bit-exact "
                   "oracle; decode uses the AMX kernel here (test_amx_linear checks its bits against oneDNN)")
def test_bit_identical_to_onednn_on_the_default_model_at_decode_sizes(n, k):
    w = _weight(n, k)
    packed = linear_avx512.pack_weight(w)
    for rows in range(1, max(linear_avx512.AVX512_MAX_ROWS, 16) + 1):
        x = _rows(rows, k, seed=rows)
        assert torch.equal(linear_avx512.linear(lib, x, packed, None), F.linear(x, w)), (n, k, rows)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 17])
@pytest.mark.parametrize("n,k,with_bias", [(48, 64, True), (112, 130, False), (64, 1100, True)])
def test_within_one_rounding_of_float64(rows, n, k, with_bias):
    """Any shape the kernel takes (tails of 4-row groups and 64-column tiles, K past one
    512 block, a bias, strided rows), any row count when called directly."""
    w = _weight(n, k)
    wide = _rows(rows, k + 8)
    x = wide[:, 3 : 3 + k]  # row stride k + 8
    bias = _weight(1, n, seed=5)[0] if with_bias else None
    out = linear_avx512.linear(lib, x, linear_avx512.pack_weight(w), bias)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # float32 accumulation then one bf16 rounding: within 2^-8 relative plus the sum's error.
    bound = ref.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * k * 2**-23 + 1e-30
    assert ((out.double() - ref).abs() <= bound).all()
    if not ONEDNN_ON_AMX:
        assert (out != F.linear(x, w, bias)).float().mean() < 0.01  # oneDNN's bits almost everywhere


def test_native_layer_ops_route_decode_rows_to_the_kernel():
    native = cpu_ops.native_library()
    if native is None:
        pytest.skip("native CPU kernels unavailable")
    ops = cpu_ops.NativeLayerOps(native)
    if ops.amx:
        pytest.skip("AMX CPUs take the AMX kernel")
    w = _weight(576, 576)
    packed = ops.pack_linear(w)
    assert isinstance(packed, linear_avx512.Avx512Weight)
    small, large = _rows(linear_avx512.AVX512_MAX_ROWS, 576), _rows(linear_avx512.AVX512_MAX_ROWS + 1, 576)
    assert torch.equal(ops.linear(small, w, None, packed), linear_avx512.linear(lib, small, packed, None))
    assert torch.equal(ops.linear(large, w, None, packed), cpu_linear.packed_linear(large, packed.onednn, None))
    assert not isinstance(ops.pack_linear(w.float()), linear_avx512.Avx512Weight)
    assert not isinstance(ops.pack_linear(torch.zeros(40, 64, dtype=torch.bfloat16)), linear_avx512.Avx512Weight)
