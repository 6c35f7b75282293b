"""Jump-forward: the per-call bounds of `jump_forward_tokens`, and jumps under KV pressure in the scheduler."""

from __future__ import annotations

import json

import jsonschema
import pytest

from arborlm.constrained.base import GrammarMatcher
from arborlm.constrained.jump_forward import MAX_CHARS_PER_TOKEN, jump_forward_tokens
from arborlm.runtime.config import ServerArgs
from tests.constrained.test_constrained_scheduler import constrained_req
from tests.runtime.scheduler_helpers import create_scheduler, run_to_completion


def test_jump_forward_is_on_by_default():
    assert ServerArgs().to_dict()["disable_jump_forward"] is False


class EndlessMatcher(GrammarMatcher):
    """Forces a very long text and accepts anything; counts the calls."""

    def __init__(self, forced: str):
        self.forced = forced
        self.searches = 0
        self.accepted = 0

    def fill_vocab_mask(self, vocab_mask, row):
        pass

    def accept_token(self, token_id):
        self.accepted += 1
        return True

    def rollback(self, num_tokens):
        self.accepted -= num_tokens

    def is_terminated(self):
        return False

    def find_jump_forward_string(self):
        self.searches += 1
        return self.forced


@pytest.mark.parametrize("max_tokens", [0, 1, 5, 40])
def test_jump_never_exceeds_the_budget_and_searches_once(tokenizer, max_tokens):
    matcher = EndlessMatcher(" alpha beta" * 200_000)
    output_ids = tokenizer.encode('{"x', add_special_tokens=False)
    tokenized = []
    real_encode = tokenizer.encode

    class CountingTokenizer:
        def decode(self, *args, **kwargs):
            return tokenizer.decode(*args, **kwargs)

        def encode(self, text, **kwargs):
            tokenized.append(len(text))
            return real_encode(text, **kwargs)

    forced = jump_forward_tokens(matcher, CountingTokenizer(), output_ids, max_tokens)
    assert len(forced) == matcher.accepted <= max_tokens
    if max_tokens:
        assert len(forced) == max_tokens  # short tokens: the budget is what stops it
        assert matcher.searches == 1
        assert tokenized and max(tokenized) <= (max_tokens + 1) * MAX_CHARS_PER_TOKEN + 16
    else:
        assert matcher.searches == 0


LONG_KEYS = [f"the_{word}_field_of_this_rather_verbose_record" for word in ("first", "second", "third", "fourth")]
# KV slots: about two requests' prompts and outputs.
SMALL_POOL = 220
LONG_KEY_SCHEMA = {
    "type": "object",
    "properties": {key: {"type": "boolean"} for key in LONG_KEYS},
    "required": LONG_KEYS,
}


def test_jump_forward_under_kv_pressure_retracts_instead_of_aborting(tiny_llama_dir, tiny_tokenizer):
    """Forced keys of ~15 tokens each, eight requests, a pool that holds about two of them.

    The step that runs the jumps used to need more slots than retraction left free
    ("out of KV slots", the whole batch aborted); now every request finishes.
    """
    s = create_scheduler(tiny_llama_dir, tiny_tokenizer, max_total_tokens=SMALL_POOL, disable_jump_forward=False,
                         init_new_token_ratio=0.05, min_new_token_ratio=0.0, new_token_ratio_decay=0.0)
    free_at_start = s.allocator.available_size()
    prompts = [[1, 20 + i, 30 + i, 40 + i] * 3 for i in range(8)]
    reqs = [constrained_req(f"r{i}", seed=i, prompt=p, json_schema=LONG_KEY_SCHEMA, max_new_tokens=120)
            for i, p in enumerate(prompts)]
    result = run_to_completion(s, reqs)  # check_invariants after every step; pools idle at the end
    for rid, tokens in result.tokens.items():
        assert result.finish[rid]["type"] == "stop", (rid, result.finish[rid])
        jsonschema.validate(json.loads(s.tokenizer.decode(tokens, skip_special_tokens=True)), LONG_KEY_SCHEMA)
    assert len(result.finish) == len(reqs)
    assert s.stats["num_jump_forward_tokens"] > 0
    assert s.stats["num_retractions"] > 0
    s.tree_cache.reset()
    assert s.allocator.available_size() == free_at_start
    s.grammar_manager.shutdown()

