"""Which JSON schemas outlines-core 0.2.14 can enforce, and lenient relaxation of the rest.

outlines-core silently drops some keywords (bounds, ``uniqueItems``, ``not``...)
and writes free-form values for schemas without a shape; `check_for_outlines` refuses
those with a `GrammarError` naming keyword and pointer, so arborlm never
under-constrains without saying so. In lenient mode `relax_for_outlines`
(`drop_partial_keywords`) removes what outlines-core enforces only in part,
and `SchemaChecker` lets depth-limited free-form objects and arrays through.

Where they run: `relax_for_outlines` is the ``relax`` of the outlines
`SchemaPolicy`, called by `prepare_json_schema` in the front; `check_for_outlines`
runs when `OutlinesBackend` checks a key (front) and compiles it (compile
worker). Both read the schema as `lower` wrote it.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from arborlm.constrained.json_schema.nodes import Relaxed
from arborlm.constrained.keys import GrammarError

# Top-level key of a schema `relax_for_outlines` relaxed (removed before outlines-core reads it).
LENIENT_MARK = "x-arborlm-lenient"

# Keywords outlines-core 0.2.14 drops without an error: the output could break them.
_IGNORED_KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "uniqueItems", "contains", "minContains", "maxContains",
    "minProperties", "maxProperties", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies",
    "not", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems",
})  # fmt: skip
# Keywords whose value is one subschema, a list of them, or a name -> subschema map
# (items is unused beside prefixItems, additionalProperties beside properties).
_SUBSCHEMA_KEYWORDS = ("items", "additionalProperties")
_SUBSCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAP_KEYWORDS = ("properties",)
_UNUSED_BESIDE = {"items": "prefixItems", "additionalProperties": "properties"}
# Keywords that give a schema its shape; without one outlines-core writes a free-form JSON value.
_SHAPE_KEYWORDS = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref")
# Free-form values lenient mode lets outlines-core write at its fixed depth (seconds to compile;
# "any JSON value" takes minutes: 140 s for ``{}`` on SmolLM2's vocabulary, so it stays refused).
_DEPTH_LIMITED_FREE_FORMS = ("an object without properties", "an array without items")
_LENIENT_ADVICE = ("Set json_schema_lenient to let the grammar enforce less (the finished output is still "
                   "validated against the whole schema), or use the xgrammar backend")
_IDENTIFIER = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]*$")


def check_for_outlines(schema: dict, lenient: bool = False) -> None:
    """Refuse what outlines-core would enforce only in part.

    A recursive ``$ref`` (outlines unrolls it to a fixed depth); a free-form
    JSON value (any type, an object without properties, an array without
    items: outlines writes a nested regex cut at a fixed depth whose DFA takes
    seconds to minutes to build, 100 s for ``{}`` on one core); a keyword of
    `_IGNORED_KEYWORDS`; ``allOf`` with more than one subschema (outlines
    concatenates them); a string with more than one of pattern / format /
    length (outlines keeps one); ``required`` names missing from
    ``properties``; ``prefixItems`` with ``minItems``/``maxItems``. Local
    ``$ref``s (``#``, ``#/json/pointer``, the root ``$id`` + pointer) are
    followed; others are left to outlines-core, which rejects them.
    ``lenient``: recursion and objects without properties or arrays without
    items pass (`relax_for_outlines` marked the schema with `LENIENT_MARK`).

    Raises
    ------
    GrammarError
        Naming the keyword or ``$ref`` and its JSON path, ``param`` = ``"json_schema"``.
    """
    SchemaChecker(schema, lenient).visit(schema, "$", ("",), "")


def relax_for_outlines(schema: dict) -> Relaxed:
    """Lenient mode: ``schema`` with what outlines-core would enforce only in part relaxed.

    Dropped: the keywords outlines-core ignores (`_IGNORED_KEYWORDS`: bounds,
    ``uniqueItems``, ``not``, ...), the string rules beside the one it
    applies (a pattern is kept over lengths, lengths over a format), and
    ``minItems``/``maxItems`` beside ``prefixItems``. Let through, at
    outlines-core's fixed depth: recursive ``$ref``s and objects without
    properties or arrays without items (the schema is marked with
    `LENIENT_MARK`, which `OutlinesBackend.compile` reads).

    Parameters
    ----------
    schema:
        The schema as `lower` wrote it, a fresh value: it is changed in place.

    Returns
    -------
    Relaxed
        The marked schema, and each thing relaxed as ``"keyword at /json/pointer"``
        (with the reason for what is let through); nothing when nothing needed relaxing.

    Raises
    ------
    GrammarError
        What stays refused even when lenient (see `check_for_outlines`): any JSON
        value, several ``allOf`` subschemas, a ``required`` name missing from
        ``properties``.
    """
    relaxed: list[str] = []
    drop_partial_keywords(schema, "", relaxed)
    checker = SchemaChecker(schema, lenient=True)
    checker.visit(schema, "$", ("",), "")
    relaxed += checker.relaxed
    if not relaxed:
        return Relaxed(schema)
    return Relaxed({**schema, LENIENT_MARK: True}, tuple(relaxed))


class SchemaChecker:
    """Depth-first walk of a schema and the ``$ref`` targets it reaches (`check_for_outlines`)."""

    def __init__(self, root: dict, lenient: bool = False):
        self.root = root
        self.root_id = root.get("$id") if isinstance(root.get("$id"), str) else None
        self.checked: set[str] = {""}  # JSON pointers already walked without finding recursion
        self.lenient = lenient
        self.relaxed: list[str] = []  # lenient: what was let through, as "what at /json/pointer (why)"

    def visit(self, node: Any, path: str, ref_stack: tuple[str, ...], at: str) -> None:
        """Check ``node``, found at ``path`` ($-notation, for messages) and JSON pointer ``at``."""
        if not isinstance(node, dict):
            return
        self._check_keywords(node, path, at)
        ref = node.get("$ref")
        pointer = self._pointer(ref) if isinstance(ref, str) else None
        if pointer is not None:
            if pointer in ref_stack:
                if not self.lenient:
                    raise GrammarError(
                        f'recursive $ref "{ref}" at {path}.$ref: outlines-core unrolls recursion to a fixed '
                        f"depth, so the schema cannot be enforced. {_LENIENT_ADVICE}",
                        "json_schema",
                    )
                self.relaxed.append(f"$ref at {at}/$ref (recursion unrolled to a fixed depth)")
            elif pointer not in self.checked:
                self.visit(self._resolve(pointer), _pointer_path(pointer), (*ref_stack, pointer), pointer)
                self.checked.add(pointer)
        for keyword, value in node.items():
            if _UNUSED_BESIDE.get(keyword) in node:
                continue
            child_at = f"{at}/{_escape_pointer(keyword)}"
            if keyword in _SUBSCHEMA_KEYWORDS:
                self.visit(value, _child_path(path, keyword), ref_stack, child_at)
            elif keyword in _SUBSCHEMA_LIST_KEYWORDS and isinstance(value, list):
                for i, item in enumerate(value):
                    self.visit(item, f"{_child_path(path, keyword)}[{i}]", ref_stack, f"{child_at}/{i}")
            elif keyword in _SUBSCHEMA_MAP_KEYWORDS and isinstance(value, dict):
                for name, item in value.items():
                    self.visit(item, _child_path(_child_path(path, keyword), name), ref_stack,
                               f"{child_at}/{_escape_pointer(name)}")

    def _check_keywords(self, node: dict, path: str, at: str) -> None:
        free_form = _free_form(node)
        depth_limited = self.lenient and free_form in _DEPTH_LIMITED_FREE_FORMS
        if depth_limited:
            self.relaxed.append(f"type at {at or '/'} ({free_form}, nested to a fixed depth)")
        problem = _keyword_problem(node, allow_free_form=depth_limited)
        if problem:
            advice = _LENIENT_ADVICE if not self.lenient and _relaxable(node) else "use the xgrammar backend"
            raise GrammarError(f"{problem} (at {path}); {advice}", "json_schema")

    def _pointer(self, ref: str) -> str | None:
        """The JSON pointer of a local ``$ref`` ("" for the root), None for others."""
        base, sep, fragment = ref.partition("#")
        if not sep or (base and base != self.root_id) or (fragment and not fragment.startswith("/")):
            return None
        return urllib.parse.unquote(fragment)

    def _resolve(self, pointer: str) -> Any:
        node: Any = self.root
        for part in pointer.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None  # a dangling $ref: outlines-core reports it
        return node


def _keyword_problem(node: dict, allow_free_form: bool = False) -> str | None:
    """Why outlines-core would enforce the keywords of ``node`` only in part, None when it would not.

    ``allow_free_form``: a free-form value is no problem (lenient mode, depth-limited ones).
    """
    ignored = sorted(_IGNORED_KEYWORDS & node.keys())
    string_rules = [k for k in ("pattern", "format") if k in node]
    string_rules += ["minLength/maxLength"] if "minLength" in node or "maxLength" in node else []
    required = node.get("required") if isinstance(node.get("required"), list) else []
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    missing = [name for name in required if name not in properties]
    if ignored:
        return f'outlines-core ignores "{ignored[0]}", so the output could break it'
    if not allow_free_form and (free_form := _free_form(node)):
        return f"outlines-core cannot bound {free_form} (a regex nested to a fixed depth, slow to compile)"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "outlines-core cannot combine several allOf subschemas"
    if len(string_rules) > 1:
        return f"outlines-core applies only one of {' + '.join(string_rules)}"
    if missing:
        return f'required property "{missing[0]}" is not in properties, so outlines-core would leave it out'
    if "prefixItems" in node and ("minItems" in node or "maxItems" in node):
        return "outlines-core ignores minItems/maxItems beside prefixItems"
    return None


def _relaxable(node: dict) -> bool:
    """True when lenient mode would let ``node`` through (`relax_for_outlines`)."""
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return False
    required = node.get("required") if isinstance(node.get("required"), list) else []
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if any(name not in properties for name in required):
        return False
    return _free_form(node) in (None, *_DEPTH_LIMITED_FREE_FORMS)


def drop_partial_keywords(node: Any, at: str, dropped: list[str]) -> None:
    """Remove, in place and throughout the document, the keywords outlines-core would enforce only
    in part (lenient mode); list each as ``"keyword at /json/pointer"``."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            drop_partial_keywords(item, f"{at}/{i}", dropped)
        return
    if not isinstance(node, dict):
        return
    where = at or "/"
    doomed = sorted(_IGNORED_KEYWORDS & node.keys())
    string_rules = [k for k in ("minLength", "maxLength", "format") if k in node]
    if "pattern" in node:  # outlines-core would apply the lengths and drop the pattern: keep the pattern
        doomed += string_rules
    elif "format" in node and ("minLength" in node or "maxLength" in node):
        doomed.append("format")
    if "prefixItems" in node:
        doomed += [k for k in ("minItems", "maxItems") if k in node]
    for keyword in doomed:
        del node[keyword]
        dropped.append(f"{keyword} at {where}")
    for keyword in (*_SUBSCHEMA_KEYWORDS, *_SUBSCHEMA_LIST_KEYWORDS):
        if keyword in node:
            drop_partial_keywords(node[keyword], f"{at}/{keyword}", dropped)
    for keyword in (*_SUBSCHEMA_MAP_KEYWORDS, "$defs", "definitions"):
        if isinstance(node.get(keyword), dict):
            for name, item in node[keyword].items():
                drop_partial_keywords(item, f"{at}/{keyword}/{_escape_pointer(name)}", dropped)


def _escape_pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _free_form(node: dict) -> str | None:
    """What free-form JSON value ``node`` lets through ("any JSON value", ...), None for a shaped schema."""
    if any(keyword in node for keyword in _SHAPE_KEYWORDS):
        return None
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if not types:
        return "any JSON value"
    if "object" in types and not isinstance(node.get("additionalProperties"), dict):
        return "an object without properties"
    if "array" in types and not isinstance(node.get("items"), dict):
        return "an array without items"
    return None


def _pointer_path(pointer: str) -> str:
    path = "$"
    for part in pointer.split("/")[1:]:
        path = _child_path(path, part.replace("~1", "/").replace("~0", "~"))
    return path


def _child_path(path: str, key: str) -> str:
    """``path.key``, or ``path["key"]`` when the key is not an identifier."""
    return f"{path}.{key}" if _IDENTIFIER.match(key) else f"{path}[{json.dumps(key)}]"
