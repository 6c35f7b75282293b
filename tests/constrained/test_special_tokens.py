"""Under a grammar only text can be sampled, and nothing ends a request before the grammar does.

SmolLM2's id 0 is ``<|endoftext|>`` (its chat EOS is ``<|im_end|>``, id 2);
xgrammar read it as 13 characters of text, so with ``logit_bias {"0": 100}``
a JSON string filled with tokens the detokenizer drops until ``max_tokens``.
Through the scheduler: test_constraint_semantics.py.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.constrained.base import GrammarKey, allocate_vocab_mask, apply_vocab_mask
from arborlm.constrained.outlines_backend import OutlinesBackend
from arborlm.constrained.vocab import special_token_ids
from arborlm.constrained.xgrammar_backend import XGrammarBackend
from arborlm.runtime.sampling import Sampler, SamplingBatchInfo
from arborlm.sampling_params import SamplingParams

VOCAB_SIZE = 49152 + 64  # logits wider than the tokenizer, as for padded embeddings
ENDOFTEXT = 0
STRING = GrammarKey("json_schema", '{"type": "string"}')
BACKENDS = ("xgrammar", "outlines")


@pytest.fixture(scope="module")
def backends(tokenizer, eos):
    # Two EOS ids, as when the generation config lists one beside the tokenizer's.
    eos_ids = [eos, ENDOFTEXT]
    return {
        "xgrammar": XGrammarBackend(tokenizer, VOCAB_SIZE, eos_ids),
        "outlines": OutlinesBackend(tokenizer, VOCAB_SIZE, eos_ids),
    }


@pytest.fixture(scope="module")
def single_eos_backends(tokenizer, eos):
    return {"xgrammar": XGrammarBackend(tokenizer, VOCAB_SIZE, [eos]),
            "outlines": OutlinesBackend(tokenizer, VOCAB_SIZE, [eos])}


def allowed_ids(matcher) -> set[int]:
    mask = allocate_vocab_mask(1, VOCAB_SIZE)
    matcher.fill_vocab_mask(mask, 0)
    bits = (mask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


def drive(matcher, token_ids):
    for token_id in token_ids:
        assert matcher.accept_token(token_id), token_id


def test_special_token_ids_of_smollm(tokenizer):
    ids = special_token_ids(tokenizer, 49152)
    assert {0, 1, 2} <= ids and set(range(17)) == ids  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
    assert special_token_ids(tokenizer, 2) == {0, 1}


@pytest.mark.parametrize("name", BACKENDS)
def test_no_special_token_is_text(single_eos_backends, tokenizer, eos, name):
    matcher = single_eos_backends[name].compile(STRING).new_matcher()
    drive(matcher, tokenizer.encode('"ab', add_special_tokens=False))
    allowed = allowed_ids(matcher)
    assert not allowed & special_token_ids(tokenizer, VOCAB_SIZE)
    assert max(allowed) < len(tokenizer)  # nor a padding column
    drive(matcher, tokenizer.encode('"', add_special_tokens=False))
    assert allowed_ids(matcher) == {eos}


@pytest.mark.parametrize("name", BACKENDS)
def test_every_eos_id_ends_the_grammar_and_only_where_it_may(backends, tokenizer, eos, name):
    compiled = backends[name].compile(STRING)
    matcher = compiled.new_matcher()
    drive(matcher, tokenizer.encode('"ab', add_special_tokens=False))
    assert not allowed_ids(matcher) & {eos, ENDOFTEXT}
    drive(matcher, tokenizer.encode('"', add_special_tokens=False))
    assert allowed_ids(matcher) == {eos, ENDOFTEXT}
    assert matcher.accept_token(ENDOFTEXT) and matcher.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_request_stop_ids_wait_for_the_grammar_end(single_eos_backends, tokenizer, eos, name):
    """A request's stop ids, special or text, are held back until the grammar may end, and then end it."""
    comma = tokenizer.convert_tokens_to_ids(",")
    matcher = single_eos_backends[name].compile(STRING).new_matcher([ENDOFTEXT, comma, eos])
    drive(matcher, tokenizer.encode('"a', add_special_tokens=False))
    assert not allowed_ids(matcher) & {ENDOFTEXT, comma, eos}
    assert not matcher.accept_token(comma) and not matcher.accept_token(ENDOFTEXT)
    drive(matcher, tokenizer.encode('"', add_special_tokens=False))
    assert allowed_ids(matcher) == {ENDOFTEXT, comma, eos}
    assert matcher.accept_token(comma) and matcher.is_terminated()
    assert allowed_ids(matcher) == {eos}
    matcher.rollback(1)  # the stop id counts as one accepted token
    assert not matcher.is_terminated() and matcher.accept_token(eos)


def test_grammar_mask_wins_over_logit_bias(tokenizer):
    """The mask comes first (-inf); +100 on -inf stays -inf, and penalties keep it there."""
    vocab = 64
    logits = torch.zeros(2, vocab)
    mask = allocate_vocab_mask(2, vocab)
    mask[:, 0] = 1 << 5  # row's only allowed token in the first word: 5
    mask[:, 1] = 0
    apply_vocab_mask(logits, mask)
    params = [SamplingParams(temperature=0.0, logit_bias={"0": 100.0}, presence_penalty=-2.0).normalized(),
              SamplingParams(temperature=1.0, logit_bias={"0": 100.0, "7": 100.0}, repetition_penalty=2.0).normalized()]
    info = SamplingBatchInfo.from_params(params, [0, 1], vocab)
    out = Sampler()(logits, info, output_ids_list=[[0, 7], [0, 7]], top_logprobs_num=3)
    assert out.next_token_ids.tolist() == [5, 5]
    assert out.invalid_rows == ()
    assert torch.isneginf(out.top_logprobs.top_values[:, 1:]).all()  # the masked alternatives
