"""What each grammar backend needs done to a user's JSON schema: its `SchemaPolicy`.

A backend class names its policy (`GrammarBackend.schema_policy`);
`grammar_spec_from_params` passes it to `prepare_json_schema` in the front,
before a request is queued. The policy says which form of the schema the
backend compiles (`SchemaForm`) and how lenient mode relaxes the backend's
own refusals (``relax``); what the backend then still cannot enforce, its
``check`` refuses when the key is checked and compiled.

- xgrammar (`XGRAMMAR_POLICY`): the xgrammar form. xgrammar enforces a
  subset of JSON Schema and silently ignores the rest, so the schema is
  normalised (`normalise`) and lowered to that subset (`lower`), and what is
  left unenforced is refused, or dropped when lenient.
- outlines-core (`OUTLINES_POLICY`): the xgrammar form too, then in lenient
  mode `relax_for_outlines`; `check_for_outlines` refuses the rest. Its checks are
  written against the lowered form and rely on it (``allOf`` merged, ``$ref``
  targets hoisted into the root ``$defs``, draft forms and false subschemas
  gone, enums filtered, patterns full-match, ``required`` names listed in
  ``properties``), and the tests pin outlines-core's behaviour on it. So the
  lowering's xgrammar-only rewrites (``(...)?`` as ``(...){0,1}``, the
  separator-first repeat, patterns xgrammar cannot compile refused,
  ``multipleOf`` spans, int64 clamps) still run for it: a lowering of its
  own would change which schemas it accepts and the grammars it compiles.
- llguidance (`LLGUIDANCE_POLICY`) enforces JSON Schema itself, keyword by
  keyword, and refuses what it does not implement, naming it; it takes
  `SchemaForm.AS_WRITTEN`: the schema is only parsed and checked against its
  dialect, its ``rewrite`` (`llguidance_rewrite`: formats llguidance does
  not know left out, ``format`` being an annotation) runs, and the rest is
  compiled as the user wrote it. Lenient mode turns on llguidance's own
  ``lenient`` option (the key's ``lenient``); its ``relax`` only names what
  that ignores. The final validation
  (`validate_json_output`) still judges every output against the whole schema.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from arborlm.constrained.json_schema.llguidance import llguidance_rewrite, relax_for_llguidance
from arborlm.constrained.json_schema.nodes import Relaxed
from arborlm.constrained.json_schema.outlines import relax_for_outlines


class SchemaForm(enum.Enum):
    """The form of a JSON schema a backend compiles."""

    # Parsed and checked against its dialect only; the text is the user's schema (property order kept).
    AS_WRITTEN = "as written"
    # Normalised to 2020-12 and lowered to what xgrammar 0.2.9 enforces (`normalise`, `lower`);
    # what that form cannot enforce is refused, or dropped when lenient.
    XGRAMMAR = "xgrammar"


@dataclass(frozen=True)
class SchemaPolicy:
    """How one grammar backend takes a user's JSON schema (read by `prepare_json_schema`).

    Parameters
    ----------
    backend:
        The backend's name (``GrammarBackend.name``).
    form:
        The form of the schema the backend compiles.
    relax:
        Lenient mode only: relaxes what the backend itself would refuse. It
        receives the prepared schema as a fresh value (parsed from its text),
        which it may change, and returns the schema to compile with what it
        left out or let through; it raises `GrammarError` for what stays
        refused. None: the backend relaxes nothing.
    rewrite:
        `SchemaForm.AS_WRITTEN` only: applied to the parsed schema (which it may
        change) before it is compiled; it must keep every output it allows
        valid against the user's schema. None: the text is the user's.
    """

    backend: str
    form: SchemaForm
    relax: Callable[[dict], Relaxed] | None = None
    rewrite: Callable[[object], object] | None = None


XGRAMMAR_POLICY = SchemaPolicy("xgrammar", SchemaForm.XGRAMMAR)
OUTLINES_POLICY = SchemaPolicy("outlines", SchemaForm.XGRAMMAR, relax=relax_for_outlines)
LLGUIDANCE_POLICY = SchemaPolicy("llguidance", SchemaForm.AS_WRITTEN, relax=relax_for_llguidance,
                                 rewrite=llguidance_rewrite)
