"""Issue 16's reports on the default model: what a pushed model writes under a constraint.

Each request pushes SmolLM2 with a ``logit_bias`` of +100 towards what the
constraint forbids or what used to run to ``max_new_tokens``; each must end
with output the constraint accepts.
"""

from __future__ import annotations

import json
import re

import pytest

import arborlm

pytestmark = pytest.mark.smollm

ENDOFTEXT = 0  # <|endoftext|>; the chat EOS is <|im_end|>
POPULATION = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}


@pytest.fixture(scope="module")
def smol(smollm_dir):
    engine = arborlm.Engine(model=str(smollm_dir), max_total_tokens=8192, log_level="warning")
    yield engine
    engine.shutdown()


def chat(engine, request: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": request}])


def token_id(engine, text: str) -> int:
    (only,) = engine.tokenizer.encode(text, add_special_tokens=False)
    return only


def test_endoftext_bias_cannot_fill_a_string(smol):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    params = {"json_schema": schema, "temperature": 0, "max_new_tokens": 48, "logit_bias": {str(ENDOFTEXT): 100}}
    out = smol.generate(chat(smol, "Name a city as JSON."), params)
    assert ENDOFTEXT not in out["output_ids"]
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert isinstance(json.loads(out["text"])["city"], str)


def test_pushed_digits_end_with_a_parsable_object(smol):
    out = smol.generate(chat(smol, "What is the population of Paris? Answer in JSON."),
                        {"json_schema": POPULATION, "temperature": 0, "max_new_tokens": 64,
                         "logit_bias": {str(token_id(smol, "1")): 100}})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    population = json.loads(out["text"])["population"]
    assert len(str(abs(population))) <= 19


def test_dot_writes_no_newline(smol):
    out = smol.generate(chat(smol, "Write a poem of three lines."),
                        {"regex": "^(|.*)$", "temperature": 0, "max_new_tokens": 24,
                         "logit_bias": {str(token_id(smol, "\n")): 100}})
    assert "\n" not in out["text"]
    assert re.fullmatch("^(|.*)$", out["text"])
