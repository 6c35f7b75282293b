"""`sampling.row_max`, the sampler's greedy pass, against ``torch.max(dim=-1)``."""

from __future__ import annotations

import pytest
import torch

from arborlm.runtime.sampling import ROW_MAX_CHUNK, invalid_logit_rows, row_max


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("cols", [7, ROW_MAX_CHUNK, 49152, 49152 + 77, 3 * ROW_MAX_CHUNK - 1])
def test_equals_torch_max_with_ties_at_the_first_index(rows, cols):
    gen = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=gen)
    # Ties: inside one chunk, across chunks, and between the chunks and the tail.
    x[0, 2] = x[0, cols - 1] = 50.0
    if rows > 1:
        x[1, cols // 2] = x[1, cols - 1] = x[1, 0] = 60.0
    if rows > 2:
        x[2] = 3.0  # a constant row: index 0
    values, indices = row_max(x)
    want = x.max(dim=-1)
    assert torch.equal(values, want.values)
    assert torch.equal(indices, want.indices)
    assert indices.dtype == torch.int64


def test_non_finite_rows_are_found_as_before():
    x = torch.randn(4, 3000)
    x[1, 2500] = float("nan")  # in the tail
    x[2] = float("-inf")  # every token masked
    x[3, 10] = float("inf")
    values, indices = row_max(x)
    assert torch.isnan(values[1]) and values[2] == float("-inf") and values[3] == float("inf")
    assert indices[3] == 10 and indices[0] == x[0].argmax()
    assert invalid_logit_rows(x, values) == (1, 2, 3)
    assert invalid_logit_rows(x) == (1, 2, 3)


def test_takes_a_row_slice_of_a_wider_tensor():
    wide = torch.randn(5, 2 * 4096)
    x = wide[:, :4096 + 5]  # rows not contiguous
    assert torch.equal(row_max(x)[1], x.max(dim=-1).indices)
