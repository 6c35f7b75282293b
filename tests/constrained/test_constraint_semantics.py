"""Constrained output is what the constraint says, through the scheduler on the tiny random Llama.

Each test pushes the model, with a ``logit_bias`` of +100, towards what the
constraint forbids or what used to make it run to ``max_new_tokens``: a
special token inside a JSON string, a newline under ``.``, a digit for ever.
"""

from __future__ import annotations

import json
import re

import pytest

from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.number_bounds import MAX_INTEGER_DIGITS
from arborlm.constrained.vocab import special_token_ids
from arborlm.runtime.io_struct import TokenizedGenerateReqInput
from arborlm.sampling_params import SamplingParams
from tests.runtime.scheduler_helpers import create_scheduler, run_to_completion

BACKENDS = ("xgrammar", "outlines")
PROMPT = [1, 504, 3458, 314, 253, 1789, 28, 2]  # any ids: the model is random
ENDOFTEXT = 0  # SmolLM2's <|endoftext|>; its EOS is <|im_end|>, 2
POPULATION = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}


@pytest.fixture(scope="module")
def scheds(tiny_llama_dir, tiny_tokenizer):
    made = {}

    def get(backend: str):
        if backend not in made:
            made[backend] = create_scheduler(tiny_llama_dir, tiny_tokenizer, grammar_backend=backend)
        return made[backend]

    yield get
    for sched in made.values():
        sched.grammar_manager.shutdown()


def run_one(sched, backend: str, **sampling):
    """Run one constrained request; (its tokens, its finish reason, its text)."""
    sampling.setdefault("temperature", 0.0)
    params = SamplingParams(**sampling)
    params.verify(49152)
    params = params.normalized()
    req = TokenizedGenerateReqInput(rid="r", input_ids=list(PROMPT), sampling_params=params, seed=0,
                                    grammar=grammar_spec_from_params(params, backend))
    result = run_to_completion(sched, [req])
    tokens = result.tokens["r"]
    return tokens, result.finish["r"], sched.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logit_bias_cannot_push_a_special_token_into_a_string(scheds, backend):
    sched = scheds(backend)
    tokens, _, text = run_one(sched, backend, json_schema='{"type": "string"}', logit_bias={str(ENDOFTEXT): 100.0},
                              max_new_tokens=12)
    content = tokens[:-1] if tokens[-1] in sched.model_info.eos_token_ids else tokens
    assert not set(content) & special_token_ids(sched.tokenizer, 49152), tokens
    assert text.startswith('"') and len(text) > 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_dot_writes_no_newline_however_pushed(scheds, backend):
    sched = scheds(backend)
    newline = sched.tokenizer.encode("\n", add_special_tokens=False)[0]
    tokens, finish, text = run_one(sched, backend, regex="^(|.*)$", logit_bias={str(newline): 100.0},
                                   max_new_tokens=8)
    assert "\n" not in text and newline not in tokens
    if finish["type"] == "stop":
        assert re.fullmatch("^(|.*)$", text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pushed_digits_end_with_a_valid_object(scheds, backend):
    """Greedy on a forced "1": 19 digits, then the grammar closes the object, well before max_new_tokens."""
    sched = scheds(backend)
    one = sched.tokenizer.encode("1", add_special_tokens=False)[0]
    tokens, finish, text = run_one(sched, backend, json_schema=json.dumps(POPULATION), logit_bias={str(one): 100.0},
                                   max_new_tokens=64)
    assert finish["type"] == "stop" and finish["matched"] in sched.model_info.eos_token_ids, (finish, text)
    value = json.loads(text)
    assert abs(value["population"]) == int("1" * MAX_INTEGER_DIGITS)  # the random model may put a sign first
