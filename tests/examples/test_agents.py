"""Smoke tests of the agents in examples/agents/ on the default model, one Engine for the module.

They check structure, not wisdom: tool calls parse and match their schemas, loops end,
batches answer every item from a cached shared prefix, select scores every branch,
records validate, and later chat turns are served from the earlier turns' cache.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import pytest

import arborlm as sgl

pytestmark = pytest.mark.smollm

AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"


def load_example(name: str):
    """Import examples/agents/NAME.py as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_agents_{name}", AGENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smol():
    engine = sgl.Engine(log_level="warning")
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(smol):
    """The module's engine; afterwards no request is left running and the pools are consistent."""
    yield smol
    info = smol.get_server_info(check_invariants=True)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


def test_react_agent_tool_calls_follow_their_schemas(engine):
    react = load_example("react_agent")
    episodes = react.main(engine, questions=["Use the calculator: what is 6 * 7?"], max_steps=2,
                          thought_tokens=16)
    (episode,) = episodes
    assert 1 <= len(episode.steps) <= 2
    for i, step in enumerate(episode.steps):
        assert step.tool in react.TOOL_SCHEMAS
        jsonschema.validate(json.loads(step.arguments_text), react.TOOL_SCHEMAS[step.tool])
        assert step.arguments is not None
        is_last = i == len(episode.steps) - 1
        assert (step.tool == "final_answer") == (step.observation is None)
        assert step.tool != "final_answer" or is_last  # the loop stops at the final answer
    if episode.stopped_by == "final_answer":
        assert episode.steps[-1].tool == "final_answer" and episode.answer
    else:
        assert episode.stopped_by == "step_limit" and len(episode.steps) == 2 and episode.answer is None


@pytest.mark.parametrize(("expression", "value"), [("17 * 23 + 4", 395), ("(1 + 2) / 4", 0.75), ("-3 // 2", -2),
                                                   ("7 % 4", 3)])
def test_calculator_evaluates_arithmetic(expression, value):
    assert load_example("react_agent").calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 8", "abs(-1)", "x + 1", "'a' * 3", "[1][0]"])
def test_calculator_refuses_everything_else(expression):
    with pytest.raises(ValueError):
        load_example("react_agent").calculate(expression)


def test_lookup_finds_the_document_by_its_words():
    react = load_example("react_agent")
    assert react.lookup("how tall is mount everest") == react.DOCUMENTS["Mount Everest"]
    assert react.lookup("zzz") == "No document matches that query."


def test_rag_batch_answers_every_question_behind_the_cached_system_prompt(engine):
    rag = load_example("rag_shared_prompt")
    questions = rag.QUESTIONS[:3]
    run = rag.main(engine, questions=questions, answer_tokens=12)
    assert [a.question for a in run.answers] == questions
    system_len = len(engine.tokenizer.encode(
        engine.apply_chat_template([{"role": "system", "content": rag.SYSTEM_PROMPT}], add_generation_prompt=False),
        add_special_tokens=False))
    assert system_len > 300
    for a in run.answers:
        assert isinstance(a.answer, str) and len(a.passage_ids) == 3
        assert a.cached_tokens >= system_len  # the shared prompt came from the cache
    assert run.cache_hit_rate > 0.5


def test_bm25_ranks_the_matching_passage_first():
    rag = load_example("rag_shared_prompt")
    retriever = rag.BM25(rag.load_corpus())
    assert retriever.top("Can I fly a drone?", 1)[0]["id"] == "drones"
    assert retriever.top("Is a permit needed to camp overnight?", 1)[0]["id"] == "permits"


def test_tree_of_thought_selects_one_of_its_branches(engine):
    tot = load_example("tree_of_thought")
    (level,) = tot.main(engine, num_branches=2, depth=1, thought_tokens=12, expansion_tokens=12)
    assert len(level.candidates) == 2 and len(level.scores) == 2
    assert 0 <= level.best < 2 and level.scores[level.best] == max(level.scores)
    assert level.expansion
    assert min(level.branch_cached_tokens) > 50  # every branch started from the parent's cached text


def test_json_extraction_objects_validate_with_pydantic(engine):
    extraction = load_example("json_extraction")
    results = extraction.main(engine, texts=extraction.TEXTS[:3])
    assert len(results) == 3
    for r in results:
        assert r.error is None and r.finish_reason["type"] == "stop"
        assert isinstance(r.contact, extraction.Contact)
        assert extraction.Contact.model_validate_json(r.raw) == r.contact


def test_multi_turn_chat_reuses_the_earlier_turns(engine):
    chat = load_example("multi_turn_chat")
    turns = chat.main(engine, user_turns=chat.USER_TURNS[:3], reply_tokens=12)
    assert len(turns) == 3
    for previous, turn in zip(turns, turns[1:]):
        assert turn.prompt_tokens > previous.prompt_tokens + previous.completion_tokens
        assert turn.cached_tokens >= previous.prompt_tokens

