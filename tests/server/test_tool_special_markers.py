"""Tool-call markers that are special tokens, in `tool_choice="auto"` (`tool_markers.py`).

The tokenizer is SmolLM2's with `[TOOL_CALLS]` and `<|python_tag|>` added as special tokens,
as Mistral v0.3's and Llama 3.x's tokenizers hold them. The scripted model (`scripted_model.py`)
writes the marker token right after the prompt, as a real model of the family does. A grammar
never writes a special token as text, so without the continuation the model could not call
(the token is masked) or the call would be lost (the detokenizer drops the token's text); with
it the marker stops the free text and the calls after it are a forced generation. The answer
must be a call that validates, with no marker in the content, the same streamed and not, and
its usage must count every generated token once.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from arborlm.entrypoints.openai.tool_markers import marker_ids
from arborlm.entrypoints.openai.tool_parsers.llama3 import Llama3Format
from arborlm.entrypoints.openai.tool_parsers.mistral import MistralFormat
from tests.server.conftest import API_KEY, start_server, stop_server, wait_idle
from tests.server.scripted_model import (
    chain,
    scripted_tokenizer,
    token_pieces,
    write_scripted_model,
)
from tests.server.test_tool_families import MESSAGES, SCHEMAS, TOOLS

SPECIAL_MARKERS = ["[TOOL_CALLS]", "<|python_tag|>"]
# family -> (built-in template, the special marker the model writes); one server (they start
# slowly), Llama 3's grammar and parsing after its marker are checked without one below.
FAMILIES = {"mistral": ("mistral", "[TOOL_CALLS]")}


def special_base(folder, smollm_dir):
    """A tokenizer folder: SmolLM2's, the two markers added as special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_MARKERS})
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_bytes((smollm_dir / "config.json").read_bytes())
    return folder


@pytest.fixture(scope="module")
def base_dir(smollm_dir, tmp_path_factory):
    return special_base(tmp_path_factory.mktemp("special_base"), smollm_dir)


def test_markers_found_only_as_special_tokens(base_dir, smollm_dir):
    from arborlm.entrypoints.openai.tool_calls import ToolPlan

    special, plain = scripted_tokenizer(base_dir), scripted_tokenizer(smollm_dir)
    plan = ToolPlan((), "auto", None, True, MistralFormat())
    (token_id,) = marker_ids(plan, special)
    assert special.convert_ids_to_tokens(token_id) == "[TOOL_CALLS]"
    assert marker_ids(plan, plain) == {}  # spelled in pieces: the grammar's text trigger catches it
    assert marker_ids(ToolPlan((), "required", None, True, MistralFormat()), special) == {}  # forced: text
    assert list(marker_ids(ToolPlan((), "auto", None, True, Llama3Format()), special).values()) == ["<|python_tag|>"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def marker_server(request, base_dir, tmp_path_factory):
    from arborlm.chat_template import load_chat_template

    template, marker = FAMILIES[request.param]
    tokenizer = scripted_tokenizer(base_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                           chat_template=load_chat_template(template))
    folder = tmp_path_factory.mktemp(f"special_{request.param}")
    write_scripted_model(folder, base_dir, chain(token_pieces(tokenizer, prompt)[-1], marker))
    srv = start_server(folder, folder / "server.log", "--chat-template", template)
    yield request.param, srv, marker
    stop_server(srv)


@pytest.fixture
def client(marker_server):
    _, srv, _ = marker_server
    yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with srv.client() as http:
        info = wait_idle(http)
        assert info["free_req_rows"] == info["total_req_rows"]
        assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


KWARGS = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=80)


def _streamed(client, **kwargs):
    content, calls, reason, usage = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:
                calls[delta.index] = [delta.function.name, ""]
            else:
                calls[delta.index][1] += delta.function.arguments
        reason = choice.finish_reason or reason
    return content, [tuple(c) for c in calls.values()], reason, usage


@pytest.mark.parametrize("parallel", [False, True])
def test_auto_call_after_a_special_marker(marker_server, client, parallel):
    _, _, marker = marker_server
    out = client.chat.completions.create(parallel_tool_calls=parallel, **KWARGS)
    choice = out.choices[0]
    # several calls may run into max_tokens; the cut one is not returned
    assert choice.finish_reason == "tool_calls" or (parallel and choice.finish_reason == "length"), choice
    assert not choice.message.content and choice.message.tool_calls
    assert len(choice.message.tool_calls) == 1 or parallel
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, reason, usage = _streamed(client, parallel_tool_calls=parallel, **KWARGS)
    assert (content, reason) == (choice.message.content or "", choice.finish_reason)
    returned = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls[: len(returned)] == returned  # a call cut by max_tokens was streamed in part, not returned
    assert usage.prompt_tokens == out.usage.prompt_tokens
    assert usage.completion_tokens == out.usage.completion_tokens


def test_completion_tokens_count_the_marker_and_the_calls(marker_server, client, base_dir):
    """The marker and the call's tokens, each once: what the call's text re-tokenizes to, about."""
    _, _, marker = marker_server
    out = client.chat.completions.create(parallel_tool_calls=False, **KWARGS)
    call = out.choices[0].message.tool_calls[0]
    assert out.usage.completion_tokens > 1 + len(call.function.arguments) // 8
    assert out.usage.completion_tokens < 80


def test_a_marker_in_stop_token_ids_only_stops(marker_server, client, base_dir):
    _, _, marker = marker_server
    token_id = scripted_tokenizer(base_dir).convert_tokens_to_ids(marker)
    out = client.chat.completions.create(extra_body={"stop_token_ids": [token_id]}, **KWARGS)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None and not choice.message.content
    assert out.usage.completion_tokens == 1


def test_max_tokens_one_cuts_after_the_marker(client):
    out = client.chat.completions.create(**{**KWARGS, "max_tokens": 1})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert out.usage.completion_tokens == 1


@pytest.mark.parametrize("fmt", [MistralFormat(), Llama3Format(python_tag=True)], ids=["mistral", "llama3"])
def test_grammar_lets_the_marker_stop_then_forces_the_calls(fmt, base_dir):
    """With the backend the server uses: the auto grammar lets the special marker through as a
    stop where the free text may end; after it, only calls; the marker's text and the calls'
    parse to the call."""
    import torch

    from arborlm.constrained.json_schema import prepare_json_schema
    from arborlm.constrained.keys import GrammarKey
    from arborlm.constrained.xgrammar_backend import XGrammarBackend
    from arborlm.entrypoints.openai.tool_calls import Tool, ToolPlan
    from arborlm.entrypoints.openai.tool_markers import MarkerContinuation
    from arborlm.entrypoints.openai.tool_parsers.base import parse_whole

    tokenizer = scripted_tokenizer(base_dir)
    tools = tuple(Tool(t["function"]["name"], t, prepare_json_schema(t["function"]["parameters"])) for t in TOOLS)
    plan = ToolPlan(tools, "auto", None, False, fmt)
    cont = MarkerContinuation.of(plan, tokenizer)
    (marker_id, marker), = cont.markers.items()
    backend = XGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    mask = torch.zeros((1, (len(tokenizer) + 31) // 32), dtype=torch.int32)

    def allowed(matcher, token_id):
        matcher.fill_vocab_mask(mask, 0)
        return bool((mask[0, token_id // 32] >> (token_id % 32)) & 1)

    auto = backend.compile(GrammarKey("structural_tag", json.dumps(plan.structural_tag())))
    assert allowed(auto.new_matcher(stop_token_ids=list(cont.markers)), marker_id)
    assert not allowed(auto.new_matcher(), marker_id)  # without the stop: masked, as any special token
    after = backend.compile(GrammarKey("structural_tag", json.dumps(cont.grammar))).new_matcher()
    call = fmt.history_text([("get_weather", {"city": "Paris", "days": 3})]).removeprefix(marker)
    for token_id in tokenizer.encode(call, add_special_tokens=False):
        assert after.accept_token(token_id), call
    assert allowed(after, tokenizer.eos_token_id)
    assert not after.accept_token(tokenizer.encode(" Hello", add_special_tokens=False)[0])  # only calls
    parsed = parse_whole(fmt, marker + call, plan.names)
    assert parsed.content is None and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]


def test_two_choices_with_logprobs_join_both_steps(client):
    """n=2: each choice goes on after its marker; the logprobs of both steps join, one per token."""
    out = client.chat.completions.create(n=2, logprobs=True, parallel_tool_calls=False, **KWARGS)
    assert [c.finish_reason for c in out.choices] == ["tool_calls", "tool_calls"]
    tokens = [len(c.logprobs.content) for c in out.choices]
    assert sum(tokens) == out.usage.completion_tokens and min(tokens) > 2
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
