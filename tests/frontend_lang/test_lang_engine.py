"""Every primitive of the language on the tiny model's Engine: select against independently computed
log probabilities, dtype, fork and run_batch prefix sharing measured from the cache counters, streaming."""

from __future__ import annotations

import asyncio
import re

import pytest

import arborlm as sgl
from arborlm.frontend_lang.global_config import global_config

LONG_SYSTEM = " ".join(f"Rule {i}: answer briefly and cite the manual section {i}." for i in range(40))


def token_logprobs(engine, ids: list[int], start: int) -> list[float]:
    """log p(ids[p] | ids[:p]) for p >= start, from one uncached engine request over token ids."""
    meta = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=start)["meta_info"]
    return [lp for lp, _, _ in meta["input_token_logprobs"] if lp is not None]


def independent_scores(engine, text: str, choices: list[str], method) -> list[float]:
    """Each choice's score computed directly: the tokens where `text + choice` departs from `text`."""
    tok = engine.tokenizer
    base = tok(text).input_ids
    scores = []
    for choice in choices:
        full = tok(text + choice).input_ids
        k = next((i for i, (a, b) in enumerate(zip(base, full)) if a != b), len(base))
        cond = token_logprobs(engine, full, k)
        if method is sgl.unconditional_likelihood_normalized:
            uncond = [0.0] + token_logprobs(engine, full[k:], 1)
            scores.append(sum(c - u for c, u in zip(cond, uncond, strict=True)) / len(cond))
        else:
            scores.append(sum(cond) / len(cond))
    return scores


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.unconditional_likelihood_normalized])
def test_select_picks_the_highest_normalised_logprob(engine, method):
    choices = ["apple", " banana split", "cherry pie with cream", "42"]

    @sgl.function
    def pick(s):
        s += sgl.user("Which one do you like?")
        s += sgl.assistant("I like " + sgl.select("fruit", choices=choices, choices_method=method))

    state = pick.run(backend=engine)
    meta = state.get_meta_info("fruit")
    prompt = state.text()[: state.text().rindex(state["fruit"])]
    expected = independent_scores(engine, prompt, choices, method)
    key = ("normalized_unconditional_prompt_logprobs" if method is sgl.unconditional_likelihood_normalized
           else "normalized_prompt_logprobs")
    assert meta[key] == pytest.approx(expected, abs=1e-3)
    assert state["fruit"] == choices[max(range(len(choices)), key=expected.__getitem__)]
    assert meta["cached_tokens"] > 0  # the choices were scored behind the cached program text


def test_greedy_token_selection_and_gen_choices(engine):
    @sgl.function
    def pick(s):
        s += "Colour: " + sgl.gen("c", choices=["red", "green", "blue"], choices_method=sgl.greedy_token_selection)
        s += "\nAgain: " + sgl.gen("d", choices=["red", "green", "blue"])

    state = pick.run(backend=engine)
    matrix = state.get_meta_info("c")["greedy_logprob_matrix"]
    first = [row[0] for row in matrix]
    assert state["c"] in ("red", "green", "blue") and first[["red", "green", "blue"].index(state["c"])] == max(first)
    assert state["d"] in ("red", "green", "blue")
    assert state.text().endswith(state["d"])


def test_dtype_gen_int_gen_string_and_var_scope(engine):
    @sgl.function
    def typed(s):
        with s.var_scope("line"):
            s += "n=" + sgl.gen_int("n", temperature=1.0, seed=3, max_tokens=8)
        s += "\nf=" + sgl.gen("f", dtype=float, temperature=1.0, seed=4, max_tokens=12)
        s += "\nb=" + sgl.gen("b", dtype=bool, temperature=1.0, seed=5)
        s += "\ns=" + sgl.gen_string("s", temperature=1.0, seed=6, max_tokens=16)

    state = typed.run(backend=engine)
    assert re.fullmatch(r"[-+]?\d+", state["n"]) or state.get_meta_info("n")["finish_reason"]["type"] == "length"
    assert state["line"] == "n=" + state["n"]
    assert state["b"] in ("True", "False")
    assert state["s"].startswith('"')


def test_fork_branches_start_from_a_cache_hit_and_join(engine):
    @sgl.function
    def branches(s):
        s += sgl.system(LONG_SYSTEM)
        s += sgl.user("Give three different one-word answers.")
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += sgl.assistant(f"Answer {i}: " + sgl.gen("word", max_tokens=4, temperature=1.0, seed=i))
        forks.join()

    sgl.flush_cache(engine)
    state = branches.run(backend=engine)
    parent_tokens = len(engine.tokenizer(state.text()).input_ids)
    assert len(state["word"]) == 3
    for meta in state.get_meta_info("word"):
        assert meta["cached_tokens"] >= parent_tokens - 2  # the parent's text came from the prefill


def test_run_batch_of_32_computes_the_shared_prefix_once(engine):
    @sgl.function
    def ask(s, question):
        s += sgl.system(LONG_SYSTEM)
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=2, ignore_eos=True))

    questions = [{"question": f"What does rule {i} say?"} for i in range(32)]
    prefix = ask.trace(backend=engine).prefix
    prefix_tokens = len(engine.tokenizer(prefix).input_ids)
    assert prefix_tokens > 450
    assert sgl.flush_cache(engine)
    before = sgl.get_server_info(engine)
    states = ask.run_batch(questions, backend=engine, temperature=0)
    after = sgl.get_server_info(engine)
    computed = (after["num_prompt_tokens"] - before["num_prompt_tokens"]) - (
        after["num_cached_tokens"] - before["num_cached_tokens"])
    metas = [s.get_meta_info("answer") for s in states]
    own = sum(m["prompt_tokens"] for m in metas) - 32 * prefix_tokens  # tokens after the shared prefix
    assert all(m["cached_tokens"] >= prefix_tokens - 1 for m in metas)
    assert computed <= prefix_tokens + own + 32 * 2  # the prefix once, plus each item's own tokens
    assert [s.text().count(f"rule {i} say") for i, s in enumerate(states)] == [1] * 32


def test_streaming_text_iter_and_async_iter(engine):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=12, temperature=0, ignore_eos=True)

    state = story.run(backend=engine, stream=True)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == state["story"]
    assert "".join(story.run(backend=engine, stream=True).text_iter()) == "Once upon a time" + state["story"]

    async def collect():
        again = story.run(backend=engine, stream=True)
        return [item async for item in again.text_async_iter("story", return_meta_data=True)]

    items = asyncio.run(collect())
    assert "".join(p for p, _ in items) == state["story"]
    assert items[-1][1]["completion_tokens"] == 12


def test_server_info_flush_and_nested_programs(engine):
    @sgl.function
    def inner(s, topic):
        s += sgl.user(f"Tell me about {topic}.")
        s += sgl.assistant(sgl.gen("fact", max_tokens=3))

    @sgl.function
    def outer(s):
        inner(s, "caches")
        inner(s, "trees")

    previous = sgl.get_default_backend()
    sgl.set_default_backend(engine)
    try:
        state = outer.run(temperature=0)
        assert [m["role"] for m in state.messages()] == ["user", "assistant"] * 2
        assert state.messages()[3]["content"] == state["fact"]
        info = sgl.get_server_info()
        assert info["num_prompt_tokens"] > 0 and sgl.flush_cache() is True
    finally:
        global_config.default_backend = previous
