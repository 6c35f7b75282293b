"""Top logprobs under a grammar mask: only the alternatives that could have been sampled, all finite."""

from __future__ import annotations

import math

import pytest
import torch

from arborlm.runtime.sampling import compute_logprobs, finite_top_pairs

INF = float("inf")


@pytest.mark.parametrize(("values", "ids", "expected"), [
    ([-0.1, -2.0], [4, 9], [(-0.1, 4), (-2.0, 9)]),
    ([-0.0, -INF, -INF], [3, 0, 1], [(-0.0, 3)]),  # two masked alternatives
    ([-INF, -INF], [0, 1], []),
    ([math.nan, -1.0], [0, 1], [(-1.0, 1)]),
])
def test_finite_top_pairs(values, ids, expected):
    assert finite_top_pairs(values, ids) == expected


def test_top_pairs_of_masked_logits():
    logits = torch.full((2, 8), -INF)
    logits[0, [2, 5]] = torch.tensor([1.0, 3.0])
    logits[1] = 0.0
    out = compute_logprobs(logits, torch.tensor([5, 1]), top_logprobs_num=4)
    pairs = out.top_pairs(0, 4)
    assert [t for _, t in pairs] == [5, 2] and all(math.isfinite(v) for v, _ in pairs)
    assert pairs[0][0] == pytest.approx(float(out.logprobs[0]))
    assert len(out.top_pairs(1, 3)) == 3  # a row without a mask keeps k
    assert out.top_pairs(1, 0) == [] and compute_logprobs(logits, torch.tensor([5, 1])).top_pairs(0, 4) == []
