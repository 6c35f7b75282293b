"""User patterns are matched within a budget and with the GIL released (issue 16, item 1).

`RegexBudget` searches with the ``regex`` module; the ``jsonschema`` keywords that match
patterns are swapped for budgeted ones (`budgeted_validator_class`), in schema preparation
(enum filtering, property names) and in output validation. Before, `re` backtracked for
seconds on these schemas, holding the GIL: a ticking thread stopped for as long.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest
from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators

from arborlm.constrained.json_schema import prepare_json_schema, validate_json_output
from arborlm.constrained.json_schema.budgeted_validator import (
    budgeted_validator_class,
    without_dialects,
)
from arborlm.constrained.json_schema.regex_budget import PatternTimeout, RegexBudget
from arborlm.constrained.keys import GrammarError

# Largest pause of a ticking thread allowed while a pattern is matched (the GIL is released):
# room for a busy CI machine's scheduling; with `re` the pause lasted the whole match, seconds.
MAX_TICK_GAP_S = 0.25
EVIL_SCHEMAS = [
    # the issue's schema: `re` takes seconds, twice as long per added "a"
    ({"type": "string", "pattern": "^(a+)+$", "enum": ["a" * 26 + "!"]}, "^(a+)+$"),
    ({"type": "string", "pattern": "^(a|aa)+$", "enum": ["a" * 40 + "!"]}, "^(a|aa)+$"),
    ({"type": "object", "properties": {"a" * 40 + "!": {"type": "string"}},
      "patternProperties": {"^(a|aa)+$": {"type": "integer"}}}, "^(a|aa)+$"),
    ({"type": "object", "required": ["a" * 40 + "!"],
      "patternProperties": {"^(a|aa)+$": {"type": "integer"}, "!": {"type": "string"}}}, "^(a|aa)+$"),
]


class Ticker:
    """A thread that wakes every millisecond; `max_gap_s` is its longest pause."""

    def __init__(self):
        self.max_gap_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        last = time.perf_counter()
        while not self._stop.wait(0.001):
            now = time.perf_counter()
            self.max_gap_s = max(self.max_gap_s, now - last)
            last = now


@pytest.mark.parametrize("pattern, text", [
    ("abc", "xxabcxx"), ("^abc$", "abc\n"), ("^a", "ba"), (r"\d+", "x12"), ("(?i)A", "a"),
    ("[^a]", "aaa"), (r"\bfoo\b", "a foo b"), ("a{2,3}", "a"), ("", ""), ("é+", "café"),
    (r"^\S+(?:\s+\S+)*$", "one two"), ("(a)(?:b)\\1", "aba"),
])
def test_search_agrees_with_re(pattern, text):
    assert RegexBudget(1.0).search(pattern, text) == (re.search(pattern, text) is not None)


def test_only_matching_time_counts():
    """Other work of the job (the first schema imports xgrammar: seconds) does not spend the budget."""
    budget = RegexBudget(0.05)
    time.sleep(0.1)
    assert budget.search("a", "a")
    assert 0 < budget.spent_s < 0.05


def test_the_first_schema_of_a_process_is_not_refused():
    code = ("from arborlm.constrained.json_schema import prepare_json_schema\n"
            "schema = {'type': 'object', 'properties': {'ab': {'type': 'string', 'pattern': '^a'}},"
            " 'patternProperties': {'^a': {'type': 'string', 'pattern': '^a'}}, 'required': ['ab', 'ac']}\n"
            "print(prepare_json_schema(schema, regex_budget_s=0.2).text)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_search_stops_when_the_budget_is_spent_with_the_gil_released():
    budget = RegexBudget(0.2)
    with Ticker() as ticker:
        start = time.perf_counter()
        with pytest.raises(PatternTimeout, match=re.escape("'(a|aa)+$'")):
            budget.search("(a|aa)+$", "a" * 40 + "!")
        elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert ticker.max_gap_s < MAX_TICK_GAP_S
    with pytest.raises(PatternTimeout):  # the budget is spent: later searches fail at once
        budget.search("a", "a")


@pytest.mark.parametrize("schema, pattern", EVIL_SCHEMAS)
def test_preparing_a_backtracking_schema_is_bounded(schema, pattern):
    with Ticker() as ticker:
        start = time.perf_counter()
        with pytest.raises(GrammarError) as info:
            prepare_json_schema(schema)
        elapsed = time.perf_counter() - start
    assert info.value.param == "json_schema" and pattern in info.value.message, info.value.message
    assert elapsed < 1.5, elapsed
    assert ticker.max_gap_s < MAX_TICK_GAP_S, ticker.max_gap_s


def test_validating_an_output_against_a_backtracking_pattern_is_bounded():
    prepared = prepare_json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(a|aa)+$"}}})
    start = time.perf_counter()
    problem = validate_json_output(prepared, json.dumps({"a": "a" * 40 + "!"}), regex_budget_s=0.05)
    assert time.perf_counter() - start < 0.5
    assert problem is not None and "could not be validated" in problem and "(a|aa)+$" in problem, problem
    assert validate_json_output(prepared, json.dumps({"a": "aaa"})) is None
    assert "does not match" in validate_json_output(prepared, json.dumps({"a": "b"}))


# (schema, instance) pairs on every keyword the budgeted validator replaces.
AGREEMENT = [
    ({"pattern": "^a"}, "ab"), ({"pattern": "^a"}, "ba"), ({"pattern": "^a"}, 5),
    ({"patternProperties": {"^x": {"type": "integer"}}}, {"xa": 1, "y": "s"}),
    ({"patternProperties": {"^x": {"type": "integer"}}}, {"xa": "no"}),
    ({"properties": {"a": {}}, "patternProperties": {"^x": {}}, "additionalProperties": False}, {"a": 1, "xb": 2}),
    ({"properties": {"a": {}}, "patternProperties": {"^x": {}}, "additionalProperties": False}, {"a": 1, "zz": 2}),
    ({"properties": {"a": {}}, "additionalProperties": False}, {"a": 1, "b": 2, "c": 3}),
    ({"additionalProperties": {"type": "string"}}, {"a": 1}),
    ({"patternProperties": {"^x": {}}, "unevaluatedProperties": False}, {"xa": 1, "b": 2}),
    ({"allOf": [{"patternProperties": {"^x": {}}}], "unevaluatedProperties": False}, {"xa": 1}),
    ({"allOf": [{"patternProperties": {"^x": {}}}], "unevaluatedProperties": False}, {"xa": 1, "q": 0}),
    ({"$defs": {"p": {"properties": {"a": {}}}}, "$ref": "#/$defs/p", "unevaluatedProperties": {"type": "string"}},
     {"a": 1, "b": 2}),
    ({"if": {"required": ["t"]}, "then": {"properties": {"u": {}}}, "else": {"patternProperties": {"^v": {}}},
      "unevaluatedProperties": False}, {"t": 1, "u": 2}),
    ({"if": {"required": ["t"]}, "then": {"properties": {"u": {}}}, "else": {"patternProperties": {"^v": {}}},
      "unevaluatedProperties": False}, {"va": 1, "u": 2}),
    ({"dependentSchemas": {"d": {"properties": {"e": {}}}}, "properties": {"d": {}},
      "unevaluatedProperties": False}, {"d": 1, "e": 2}),
    ({"anyOf": [{"additionalProperties": True}], "unevaluatedProperties": False}, {"z": 1}),
]


@pytest.mark.parametrize("cls", [js_validators.Draft202012Validator, js_validators.Draft201909Validator,
                                 js_validators.Draft7Validator, js_validators.Draft4Validator])
@pytest.mark.parametrize("schema, instance", AGREEMENT)
def test_budgeted_validator_agrees_with_jsonschema(cls, schema, instance):
    stock = js_exceptions.best_match(cls(schema).iter_errors(instance))
    budgeted = js_exceptions.best_match(budgeted_validator_class(cls, RegexBudget(1.0))(schema).iter_errors(instance))
    assert (stock is None) == (budgeted is None)
    if stock is not None:
        assert (budgeted.message, list(budgeted.absolute_path)) == (stock.message, list(stock.absolute_path))


def test_without_dialects_keeps_properties_and_values_called_schema():
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "properties": {"$schema": {"type": "string"},
                             "n": {"$schema": "https://json-schema.org/draft/2020-12/schema", "pattern": "x"}},
              "enum": [{"$schema": 1}]}
    out = without_dialects(schema, js_validators.Draft202012Validator)
    assert out == {"properties": {"$schema": {"type": "string"}, "n": {"pattern": "x"}}, "enum": [{"$schema": 1}]}


def test_a_nested_dialect_does_not_escape_the_budget():
    """A subschema's ``$schema`` would switch jsonschema to its stock (unbudgeted) validator."""
    schema = {"type": "object", "properties": {"a": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "string", "pattern": "(a|aa)+$"}}}
    prepared = prepare_json_schema(schema, lenient=True)
    start = time.perf_counter()
    problem = validate_json_output(prepared, json.dumps({"a": "a" * 40 + "!"}), regex_budget_s=0.05)
    assert time.perf_counter() - start < 0.5
    assert problem is not None and "could not be validated" in problem, problem
