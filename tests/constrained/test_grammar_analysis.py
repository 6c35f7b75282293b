"""Grammars that can never finish are refused before xgrammar's forced-text search can run forever.

Anything that drives an xgrammar matcher on such a grammar runs in a subprocess
with a memory cap and a timeout: a regression fails there instead of hanging or
killing the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import xgrammar as xgr

from arborlm.constrained import xgrammar_backend
from arborlm.constrained.base import GrammarError, GrammarKey
from arborlm.constrained.grammar_analysis import (
    UnknownGrammarSyntax,
    char_class_is_empty,
    unproductive_reachable_rules,
)
from arborlm.constrained.json_schema import prepare_json_schema
from arborlm.constrained.xgrammar_backend import XGrammarBackend, build_grammar, can_always_finish
from tests.shared_data import jsonschemabench_dir

VOCAB_SIZE = 49152
REPO = Path(__file__).resolve().parents[2]

SELF_ARRAY = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
NULL_OR_SELF_ARRAY = {"anyOf": [{"type": "null"}, SELF_ARRAY]}
SELF_OBJECT = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


# ---- the analysis on printed grammars ------------------------------------------

# (printed grammar, unproductive reachable rules)
PRINTED = [
    ('root ::= (("a" root))\n', ["root"]),
    ('root ::= (("(" root ")") | ("x"))\n', []),
    ('root ::= ((a))\na ::= ((b "x"))\nb ::= ((a))\n', ["root", "a", "b"]),
    ('root ::= (("x") | (a))\na ::= (("y" a))\n', ["a"]),  # finishes, but a matcher inside `a` never could
    ('root ::= (("x"))\nunused ::= ((unused))\n', []),  # unreachable
    ('root ::= ((a{0, -1} "]"))\na ::= (("," a))\n', ["a"]),
    ('root ::= ((a{1, 3}))\na ::= (("," a))\n', ["root", "a"]),
    ('root ::= ((a{0, 3}))\na ::= (("b"))\n', []),
    ('root ::= ("" | ("-" root))\n', []),
    ('root ::= ((a* b? c+))\na ::= ((a))\nb ::= ((b))\nc ::= (("c"))\n', ["a", "b"]),
    ('root ::= ((a+))\na ::= ((a))\n', ["root", "a"]),
    ('root ::= (([a-z]* "\\"]" [^\\0-\\x1f\\"\\\\\\r\\n]))\n', []),
    ('root ::= (("a"* []))\n', ["root"]),  # an empty character class matches nothing
    ('root ::= (([]* "a"))\n', []),
    ('root ::= ((r [^\\0-\\U0010ffff]))\nr ::= (("a"))\n', ["root"]),
    ('root ::= (("s" sub))\nsub ::= (("\\"") | ([^\\"] sub)) (=([ \\n]* [,}\\]:]))\n', []),
    ('root ::= (("x")) (=(la))\nla ::= (("y" la))\n', ["la"]),  # lookahead rules are checked too
    ('root ::= TagDispatch(\n  ("<f", g),\n  loop_after_dispatch=true,\n  excludes=()\n)\ng ::= (("x"))\n', []),
    ('root ::= TagDispatch(\n  ("<f", g),\n  loop_after_dispatch=false,\n  excludes=("</x>", "y")\n)\n'
     'g ::= (("x" g))\n', ["g"]),
    ('root ::= ((u))\nu ::= Regex("^[0-9a-f]{8}$", json_string=true)\n', []),
]


@pytest.mark.parametrize(("text", "unproductive"), PRINTED, ids=[t.split("\n")[0][:40] for t, _ in PRINTED])
def test_unproductive_reachable_rules(text, unproductive):
    assert unproductive_reachable_rules(text) == unproductive


@pytest.mark.parametrize(
    "text",
    [
        'root ::= ((Token(1, 2)))\n',  # token-level expressions
        'root[max_tokens=3] ::= (("a"))\n',  # rule attributes
        'root ::= ((a))\n',  # undefined rule
        'start ::= (("a"))\n',  # no root
        'root ::= (("a")) | \n',
        'root ::= (("a")\n',
        'root ::= (("a" ~ "b"))\n',
        'root ::= (([\\q]))\n',  # an escape the printer never writes
        'root ::= (("a"))\nroot ::= (("b"))\n',
    ],
)
def test_unknown_syntax_is_reported_not_guessed(text):
    with pytest.raises(UnknownGrammarSyntax):
        unproductive_reachable_rules(text)


@pytest.mark.parametrize(
    ("token", "empty"),
    [
        ("[]", True),
        ("[a]", False),
        ("[^a]", False),
        ("[^\\0-\\U0010ffff]", True),
        ("[^\\0-\\x7f\\x80-\\uffff\\U00010000-\\U0010ffff]", True),
        ("[^\\0-\\x7f\\x81-\\U0010ffff]", False),  # \x80 is left
        ("[^\\-\\]]", False),
        ("[^\\0-\\x1f\\\"\\\\\\r\\n]", False),
    ],
)
def test_char_class_is_empty(token, empty):
    assert char_class_is_empty(token) is empty


def test_empty_classes_from_regex_and_ebnf_are_found():
    for grammar in (xgr.Grammar.from_regex(r"a*[^\s\S]"), xgr.Grammar.from_ebnf('root ::= "a"* [^\\0-\\U0010FFFF]')):
        assert unproductive_reachable_rules(str(grammar)) == ["root"]


# ---- the backend's compile path -----------------------------------------------


def _tag(schema: dict) -> str:
    return json.dumps({"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f"]})


NEVER_ENDING = [
    GrammarKey("ebnf", 'root ::= "a" root'),
    GrammarKey("ebnf", 'root ::= "x" | a\na ::= "y" a'),
    GrammarKey("ebnf", 'root ::= "a"* []'),
    GrammarKey("json_schema", json.dumps(SELF_ARRAY)),
    GrammarKey("json_schema", prepare_json_schema(SELF_ARRAY).text),
    GrammarKey("json_schema", prepare_json_schema(SELF_OBJECT).text),
    GrammarKey("regex", r"a*[^\s\S]"),
    GrammarKey("structural_tag", _tag(SELF_ARRAY)),
]

FINISHING = [
    GrammarKey("ebnf", 'root ::= "(" root ")" | "x"'),
    GrammarKey("ebnf", 'root ::= "yes" | "no" | "maybe " num\nnum ::= [0-9]+'),
    GrammarKey("json_schema", json.dumps(NULL_OR_SELF_ARRAY)),
    GrammarKey("json_schema", prepare_json_schema(NULL_OR_SELF_ARRAY).text),
    GrammarKey("json_schema", "$$ANY$$"),
    GrammarKey("json_object", ""),
    GrammarKey("regex", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    GrammarKey("regex", r"(ab)+c*"),
    GrammarKey("structural_tag", _tag({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
]


@pytest.mark.parametrize("key", NEVER_ENDING, ids=[f"{k.kind}-{k.text[:30]}" for k in NEVER_ENDING])
def test_grammar_that_can_never_finish_is_refused_quickly(key):
    start = time.monotonic()
    with pytest.raises(GrammarError, match="can never finish.*derives? no finite string; the output could never end") as err:
        can_always_finish(key, build_grammar(key))
    assert err.value.param == key.param
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("key", FINISHING, ids=[f"{k.kind}-{k.text[:30]}" for k in FINISHING])
def test_grammar_that_can_finish_is_kept_with_jump_forward(key):
    assert can_always_finish(key, build_grammar(key)) is True


def test_error_names_the_rule():
    key = GrammarKey("ebnf", 'root ::= "a" root')
    with pytest.raises(GrammarError) as err:
        can_always_finish(key, build_grammar(key))
    assert "rule 'root' derives no finite string; the output could never end" in str(err.value)


@pytest.fixture(scope="module")
def backend(tokenizer, eos):
    return XGrammarBackend(tokenizer, VOCAB_SIZE, [eos], max_threads=2)


def test_compile_refuses_never_ending_grammar(backend):
    with pytest.raises(GrammarError, match="can never finish"):
        backend.compile(GrammarKey("ebnf", 'root ::= "a" root'))


def test_unreadable_grammar_compiles_with_jump_forward_off(backend, monkeypatch):
    def unreadable(text):
        raise UnknownGrammarSyntax("a construct from a later xgrammar")

    key = GrammarKey("json_schema", json.dumps({"type": "object", "properties": {"long_key": {"type": "integer"}},
                                                "required": ["long_key"]}))
    assert backend.compile(key).new_matcher().find_jump_forward_string() == '{"long_key": '
    monkeypatch.setattr(xgrammar_backend, "unproductive_reachable_rules", unreadable)
    compiled = backend.compile(key)
    assert compiled.jump_forward is False
    assert compiled.new_matcher().find_jump_forward_string() == ""


_DRIVER = textwrap.dedent(
    """
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway search fails fast
    from transformers import AutoTokenizer
    from arborlm.constrained.base import GrammarError, GrammarKey
    from arborlm.constrained.jump_forward import jump_forward_tokens
    from arborlm.constrained.xgrammar_backend import XGrammarBackend
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    backend = XGrammarBackend(tokenizer, 49152, [tokenizer.eos_token_id], max_threads=1)
    for kind, text, output in json.loads(sys.argv[2]):
        try:
            matcher = backend.compile(GrammarKey(kind, text)).new_matcher()
        except GrammarError:
            print("refused", flush=True)
            continue
        ids = tokenizer.encode(output, add_special_tokens=False)
        for token_id in ids:
            assert matcher.accept_token(token_id), (output, token_id)
            matcher.find_jump_forward_string()
        forced = jump_forward_tokens(matcher, tokenizer, ids, 64)
        print("jumped", len(forced), flush=True)
    """
)


def test_jump_forward_terminates_on_recursive_schemas(smollm_dir):
    """Driven in a subprocess: a regression would search forever (or until memory runs out)."""
    cases = [
        ("json_schema", json.dumps(NULL_OR_SELF_ARRAY), "[[null, [[null]"),
        ("json_schema", prepare_json_schema(NULL_OR_SELF_ARRAY).text, "[["),
        ("ebnf", 'root ::= "(" root ")" | "x"', "((("),
        ("json_schema", json.dumps(SELF_ARRAY), "[["),
        ("ebnf", 'root ::= "a" root', "a"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(smollm_dir), json.dumps(cases)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcomes = [line.split()[0] for line in proc.stdout.splitlines()]
    assert outcomes == ["jumped"] * 3 + ["refused"] * 2, proc.stdout


# ---- JSONSchemaBench: every schema is analysed, none refused, in milliseconds ----

DATA = jsonschemabench_dir()


@pytest.mark.skipif(DATA is None, reason="the shared JSONSchemaBench data is not there")
def test_benchmark_schemas_are_analysed_and_kept():
    slowest, analysed = 0.0, 0
    for path in sorted(DATA.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        for record in records:
            try:
                key = GrammarKey("json_schema", prepare_json_schema(record["schema"], lenient=True).text)
                grammar = build_grammar(key)
            except GrammarError:
                continue  # refused before the analysis: not this test's business
            start = time.process_time()
            assert can_always_finish(key, grammar) is True, record.get("id")
            slowest = max(slowest, time.process_time() - start)
            analysed += 1
    assert analysed > 300
    # The largest printed grammar (~600k characters) takes ~0.2 s of CPU; its compile takes seconds.
    assert slowest < 2.0
