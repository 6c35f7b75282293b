"""Pythonic tool calls (SGLang's ``pythonic``, Llama 3.2 / Llama 4 style): a Python list of calls::

    [get_weather(city="Paris", days=3), raise_alert(level="high")]

Arguments are keyword arguments whose values are Python literals; the client
gets them as JSON like every other format. The grammar makes them valid for
the function's schema: each property's value follows xgrammar's grammar of
that property's schema, with JSON's ``true`` / ``false`` / ``null`` spelled
``True`` / ``False`` / ``None``, and the keywords come in the schema's order,
the required ones always, the others optionally (as xgrammar orders JSON
properties). Keywords the grammar cannot express at the top level
(``minProperties``, ``patternProperties``, ...) are left to validation of the
finished call, as for any format. Property names must be Python identifiers.

In `auto`, a list opens only as ``[NAME(`` for an offered NAME (SGLang's
triggers), so a bracket in content stays content. The arguments of a call are
sent as one delta when its ``)`` arrives: they are converted as a whole.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from arborlm.constrained.keys import GrammarError
from arborlm.entrypoints.openai.tool_parsers.base import (
    Event,
    FunctionSpec,
    ToolCallFormat,
    ToolCallParser,
)
from arborlm.entrypoints.openai.tool_parsers.json_calls import JsonCallParser, JsonCallSyntax

LIST_BEGIN, LIST_END, CALL_SEPARATOR = "[", "]", ", "
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Tokens of xgrammar's EBNF text: string literals and character classes are kept; names are rules.
_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][A-Za-z0-9_]*|\s+|.', re.DOTALL)
_PYTHON_LITERALS = {'"true"': '"True"', '"false"': '"False"', '"null"': '"None"'}
# JSON's escapes less ``\/``, which Python reads as a backslash and a slash.
_ESCAPES = {r'[\"\\/bfnrt]': r'[\"\\bfnrt]'}


def _syntax(names: Sequence[str]) -> JsonCallSyntax:
    return JsonCallSyntax(
        triggers=tuple(f"{LIST_BEGIN}{name}(" for name in names) or (f"{LIST_BEGIN}\0",),
        open=r"\[",
        header=r"\s*(?P<name>[A-Za-z0-9_-]+)\(",
        close=r"\)",
        next_call=r"\s*,",
        close_group=r"\s*\]",
    )


@dataclass(frozen=True)
class PythonicFormat(ToolCallFormat):
    """Python lists of calls (see the module docstring)."""

    name: ClassVar[str] = "pythonic"
    instructions: ClassVar[str] = (
        "To call functions, answer only with a Python list of calls with keyword arguments: "
        "[func_name1(param_name1=value1, param_name2=value2), func_name2(param=value)]"
    )

    def structural_tag(self, functions: Sequence[FunctionSpec], choice: str, parallel: bool,
                       named: str | None = None) -> dict[str, Any]:
        """See `ToolCallFormat.structural_tag`.

        Raises
        ------
        GrammarError: a property name that is not a Python identifier.
        """
        kwargs = {f.name: {"type": "grammar", "grammar": kwargs_ebnf(f)} for f in functions}
        if choice == "named":
            return {"type": "tag", "begin": f"{LIST_BEGIN}{named}(", "content": kwargs[named], "end": f"){LIST_END}"}
        calls = [{"type": "tag", "begin": f"{name}(", "content": content, "end": ")"}
                 for name, content in kwargs.items()]
        items = {"type": "tags_with_separator", "tags": calls, "separator": CALL_SEPARATOR, "at_least_one": True,
                 "stop_after_first": not parallel}
        if choice == "required":
            return {"type": "tag", "begin": LIST_BEGIN, "content": items, "end": LIST_END}
        more = [{"type": "optional", "content": {"type": "sequence", "elements": [
            {"type": "const_string", "value": CALL_SEPARATOR}, items]}}] if parallel else []
        lists = [{"type": "tag", "begin": f"{LIST_BEGIN}{name}(", "end": LIST_END, "content": {
            "type": "sequence", "elements": [content, {"type": "const_string", "value": ")"}, *more]}}
            for name, content in kwargs.items()]
        return {"type": "triggered_tags", "triggers": [f"{LIST_BEGIN}{n}(" for n in kwargs], "tags": lists,
                "stop_after_first": True}

    def new_parser(self, names: Sequence[str]) -> ToolCallParser:
        """See `ToolCallFormat.new_parser`: the triggers are ``[NAME(`` for the offered names."""
        return PythonicCallParser(_syntax(names))

    def history_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        """The calls as one Python list."""
        items = [f"{name}({', '.join(f'{k}={python_literal(v)}' for k, v in (arguments or {}).items())})"
                 for name, arguments in calls]
        return LIST_BEGIN + CALL_SEPARATOR.join(items) + LIST_END

    def renders_natively(self, template: str) -> bool:
        """True for templates that ask for pythonic calls (`[func_name1(params_name1=...`, as vLLM's
        Llama 3.2 / Llama 4 pythonic templates word it)."""
        return "tools" in template and "[func_name1(" in template


# ---- the grammar of one call's keyword arguments -------------------------------------------


def kwargs_ebnf(function: FunctionSpec) -> str:
    """An EBNF grammar (root ``root``) of `function`'s keyword arguments, values as Python literals.

    Raises
    ------
    GrammarError: a property name that is not a Python identifier.
    """
    schema = function.schema
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    lines = ["root ::= start_0"]
    for i, (key, sub) in enumerate(properties.items()):
        if not _IDENTIFIER.fullmatch(key):
            raise GrammarError(f"the pythonic tool-call format writes arguments as Python keywords; the property "
                               f"name {key!r} of {function.name} is not a Python identifier", "parameters")
        skip = "" if key in required else f" | start_{i + 1}"
        lines.append(f'start_{i} ::= "{key}=" p{i}_root part_{i + 1}{skip}')
        skip = "" if key in required else f" | part_{i + 1}"
        lines.append(f'part_{i} ::= "{CALL_SEPARATOR}{key}=" p{i}_root part_{i + 1}{skip}')
        lines.append(_value_rules(sub, defs, f"p{i}_"))
    n = len(properties)
    lines += [f'start_{n} ::= ""', f'part_{n} ::= ""']
    return "\n".join(lines)


def _value_rules(schema: Any, defs: dict[str, Any], prefix: str) -> str:
    """xgrammar's EBNF of `schema` (a property's), its rules renamed with `prefix` and its
    JSON literals spelled as Python's."""
    import xgrammar as xgr

    whole = {**schema, **defs} if isinstance(schema, dict) else schema
    text = str(xgr.Grammar.from_json_schema(json.dumps(whole), any_whitespace=False, separators=(", ", ": "),
                                             strict_mode=True))
    out = []
    for token in _EBNF_TOKEN.findall(text):
        if _IDENTIFIER.fullmatch(token):
            out.append(prefix + token)
        else:
            out.append(_PYTHON_LITERALS.get(token, _ESCAPES.get(token, token)))
    return "".join(out)


def python_literal(value: Any) -> str:
    """`value` (JSON data) as a Python literal in the grammar's spelling."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(k, ensure_ascii=False)}: {python_literal(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return json.dumps(value, ensure_ascii=False)


# ---- the parser ------------------------------------------------------------------------------


class PythonCallScanner:
    """Finds the ``)`` that ends a call's keyword arguments (strings, escapes, brackets)."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote: str | None = None
        self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the arguments (the ending ``)`` does not)."""
        for i, ch in enumerate(text):
            if self.quote is not None:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == self.quote:
                    self.quote = None
            elif ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                if ch == ")" and self.depth == 0:
                    self.done = True
                    return i
                self.depth -= 1
        return len(text)


class PythonicCallParser(JsonCallParser):
    """`JsonCallParser` whose arguments are Python keyword arguments, sent as JSON once whole.

    A call cut before its ``)`` has no arguments and is not complete, streamed or not.
    """

    def _start_call(self, events: list[Event], match) -> bool:
        super()._start_call(events, match)
        self._scanner, self._kwargs = PythonCallScanner(), ""
        return True

    def _step_args(self, events: list[Event], final: bool) -> bool:
        taken = self._scanner.feed(self._buffer)
        self._kwargs += self._buffer[:taken]
        self._buffer = self._buffer[taken:]
        if not self._scanner.done:
            return False
        self._emit_arguments(events, kwargs_to_json(self._kwargs))
        self._mode = self._CLOSE
        return True

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._mode == self._ARGS:
            self.calls[-1].complete = False
            self._buffer, self._mode = "", self._TEXT
            return events
        return events + super().finish()


def kwargs_to_json(text: str) -> str:
    """Python keyword arguments (``a=1, b="x"``) as a JSON object's text; the text itself when
    it is not keyword arguments of literals (validation then reports it as not JSON)."""
    try:
        with warnings.catch_warnings():  # an invalid escape is read as Python reads it
            warnings.simplefilter("ignore", SyntaxWarning)
            call = ast.parse(f"f({text})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            return text
        values = {k.arg: _literal(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, RecursionError):
        return text
    return json.dumps(values, ensure_ascii=False)


def _literal(node: ast.AST) -> Any:
    """A literal's value; JSON's ``true`` / ``false`` / ``null`` are read as Python's."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("a ** in a dict is not a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        # JSON's escaped surrogate pairs (\ud83d\ude00) are two code points to Python: join them
        return node.value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return ast.literal_eval(node)
