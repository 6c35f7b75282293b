"""oneDNN's prepacked bf16 linear (`cpu_linear.packed_linear`): each row's output does not
depend on the other rows of the call (what makes greedy answers batch-invariant)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arborlm.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)),
                                reason="oneDNN has no bf16 linear on this CPU: nothing is packed")

# A decode step's shapes of the default model (qkv, down, lm_head) and a 151936-token lm_head:
# oneDNN's emulated bf16 takes its one-row kernel from about 8192 x 576 up.
SHAPES = [(960, 576), (576, 1536), (49152, 576), (151936, 128)]


def _weight_and_rows(shape: tuple[int, int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = torch.randn(shape, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
    return w, x


@pytest.mark.parametrize("emulated", [True, False])
def test_one_row_equals_the_same_row_in_a_batch_where_bf16_is_emulated(emulated):
    for shape in SHAPES:
        w, x = _weight_and_rows(shape, 5)
        packed = cpu_linear.pack_weight(w)
        bias = torch.randn(shape[0]).to(torch.bfloat16)
        one = cpu_linear.packed_linear(x[:1], packed, bias, emulated_bf16=emulated)
        assert one.shape == (1, shape[0]) and one.is_contiguous()
        pair = cpu_linear.packed_linear(x[:1].expand(2, -1).contiguous(), packed, bias, emulated_bf16=emulated)
        if emulated:
            assert torch.equal(one, pair[:1]), shape
        # Within bf16 rounding of the float32 product either way.
        ref = F.linear(x[:1].float(), w.float(), bias.float())
        torch.testing.assert_close(one.float(), ref, rtol=2e-2, atol=2e-1)


@pytest.mark.skipif(cpu_linear.cpu_has_native_bf16(),
                    reason="bf16 is native here; where AMX kernels run, prefill rows round unlike decode rows "
                           "(a known limit, docs/serving.md); this pins the emulated path")
def test_rows_are_batch_invariant_where_bf16_is_emulated():
    for shape in SHAPES:
        w, x = _weight_and_rows(shape, 17)
        packed = cpu_linear.pack_weight(w)
        full = cpu_linear.packed_linear(x, packed, None)
        for rows in range(1, 17):
            assert torch.equal(cpu_linear.packed_linear(x[:rows], packed, None), full[:rows]), (shape, rows)


def test_native_bf16_reads_the_cpu_flags_once():
    assert cpu_linear.cpu_has_native_bf16() in (True, False)
    assert cpu_linear.cpu_has_native_bf16.cache_info().currsize == 1
