"""`logit_bias` entries are capped (`MAX_LOGIT_BIAS_ENTRIES`): the sampler adds each one per row
and step in a Python loop, so an unbounded map made every decode step of the batch slow."""

from __future__ import annotations

import pytest

from arborlm.errors import InvalidRequestError
from arborlm.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams

VOCAB = 49152


def test_logit_bias_up_to_the_cap_is_accepted():
    SamplingParams(logit_bias={str(i): -1 for i in range(MAX_LOGIT_BIAS_ENTRIES)}).verify(VOCAB)


@pytest.mark.parametrize("size", [MAX_LOGIT_BIAS_ENTRIES + 1, VOCAB])
def test_logit_bias_over_the_cap_is_a_400_naming_the_field(size):
    params = SamplingParams(logit_bias={str(i): -1 for i in range(size)})
    with pytest.raises(InvalidRequestError) as excinfo:
        params.verify(VOCAB)
    assert excinfo.value.param == "logit_bias"
    assert str(MAX_LOGIT_BIAS_ENTRIES) in str(excinfo.value) and str(size) in str(excinfo.value)
