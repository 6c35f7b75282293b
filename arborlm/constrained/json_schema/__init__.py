"""Turn a user's JSON Schema into what the request's grammar backend compiles, and
check finished outputs against it.

The one door: `prepare_json_schema` (in the front, before a request is queued)
and `validate_json_output` (in the front, on each output the grammar ended).
`prepare_json_schema` parses and checks the schema, rewrites it into the form
the backend's `SchemaPolicy` asks for, and refuses (a 400-style
`GrammarError`, ``param="json_schema"``) every keyword that form would
silently leave unenforced, naming the keyword and its JSON pointer. With
``lenient=True`` (the ``json_schema_lenient`` sampling field) such keywords
are left out of the grammar instead and listed in `PreparedSchema.dropped`.
`validate_json_output` checks a finished output against the user's original
schema with ``jsonschema``, so whatever the grammar lets through, arborlm
never returns JSON the schema rejects.

Pipeline (`prepare`)
--------------------
1. Parse (`parse`): the JSON text, and the dialect it is read (and its
   outputs validated) under.
2. Rewrite what no backend enforces into equivalent schemas of what they do
   (`conditionals`, with `complement`: ``if``/``then``/``else``, bounded ``contains``,
   single-resource ``$dynamicRef``), then as the policy's `SchemaForm` says. ``AS_WRITTEN``: the backend
   compiles the user's schema after the policy's ``rewrite`` if any
   (llguidance: `llguidance`). ``XGRAMMAR``: normalise (`normalise`,
   phase A; conjunction in `merge`), an equivalent 2020-12 schema of a few
   simple shapes with every ``$ref`` in the root ``$defs``; then lower
   (`lower`, phase B) to what xgrammar 0.2.9 enforces, recording what it
   would ignore.
3. Refuse what the rewrite recorded, or when lenient drop and list it.
4. Lenient mode: the backend's ``relax`` (outlines-core: `outlines`) relaxes
   what the backend itself would refuse. The backend's ``check`` refuses the
   rest when the key is checked.

`policy` says which backend gets what; `nodes` is the shared vocabulary
(`Schema`, `Problem`, bounds, pointers), `patterns` the regex rewrites,
`values` JSON equality of values and a disjointness proof, `validate` the
output check.

Decisions
---------
- ``oneOf``: accepted and compiled as ``anyOf``, which is what grammar
  engines enforce; exclusivity is left to the final validation. Refusing a
  ``oneOf`` whose branches might overlap would cost coverage (it is in 13% of
  the JSONSchemaBench sample, mostly with disjoint branches) for a case the
  validation catches. Branches shown pairwise disjoint (different JSON types,
  disjoint ``enum``s, or objects with a required ``const`` / ``enum``
  discriminator) are written as ``anyOf``, the same language, so xgrammar
  does not warn that it falls back to ``anyOf``.
- ``format``: validation runs without a format checker, as JSON Schema
  2020-12 and ``jsonschema`` do by default (``format`` is an annotation).
  xgrammar enforces the formats it knows, which only narrows the strings it
  emits, so every output it allows is valid either way.
- Duplicate object keys: a grammar cannot forbid them (additional and
  pattern keys may repeat); the final validation rejects an output with a
  duplicate key, NaN or Infinity.
- Refused (or, when lenient, dropped and listed): what the backend's form
  cannot enforce, named with its JSON pointer; the lists are in `normalise`
  (phase A) and `lower` (phase B), and outlines-core's own in `outlines`.
  A ``$ref`` that cannot be resolved inside the document, a cycle of bare
  references, and a schema that accepts no value are errors even when
  lenient.

Sources: the JSON Schema 2020-12 core and validation specifications
(json-schema.org) and earlier drafts, ``jsonschema`` 4.x and ``referencing``
(Python), xgrammar's ``Grammar.from_json_schema`` documentation and the
measurements in `lower`, and Geng et al., "Generating Structured Outputs from
Language Models: Benchmark and Studies" (JSONSchemaBench, arXiv:2501.10868) for
the coverage measure.
"""

from arborlm.constrained.json_schema.nodes import Relaxed
from arborlm.constrained.json_schema.outlines import LENIENT_MARK, check_for_outlines
from arborlm.constrained.json_schema.parse import MAX_SCHEMA_CHARS
from arborlm.constrained.json_schema.policy import (
    LLGUIDANCE_POLICY,
    OUTLINES_POLICY,
    XGRAMMAR_POLICY,
    SchemaForm,
    SchemaPolicy,
)
from arborlm.constrained.json_schema.prepare import PreparedSchema, prepare_json_schema
from arborlm.constrained.json_schema.validate import validate_json_output

__all__ = [
    "LENIENT_MARK",
    "LLGUIDANCE_POLICY",
    "MAX_SCHEMA_CHARS",
    "OUTLINES_POLICY",
    "XGRAMMAR_POLICY",
    "PreparedSchema",
    "Relaxed",
    "SchemaForm",
    "SchemaPolicy",
    "check_for_outlines",
    "prepare_json_schema",
    "validate_json_output",
]
