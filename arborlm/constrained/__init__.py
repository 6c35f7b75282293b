"""Grammar-constrained decoding: outputs valid by construction, for JSON schema, regex, EBNF
and structural tags (tool calls).

Front (before a request is queued): `grammar_spec` turns the sampling fields
into the request's `GrammarKey` and refuses what cannot be enforced (a 400);
`json_schema/` prepares a JSON schema as the backend's `SchemaPolicy` asks
and validates every finished output against the user's schema.

Scheduler: `grammar_manager` compiles keys off the event loop (in
`compile_worker` processes or on threads) and caches the compiled grammars;
each constrained request drives a `GrammarMatcher` whose bitmask row
`base.apply_vocab_mask` applies to the logits; `jump_forward` appends the
tokens a grammar forces.

Backends behind one interface (`base.GrammarBackend`): `xgrammar_backend`
(the default), `llguidance_backend` (its grammar texts in `llguidance_grammar`)
and `outlines_backend`; `auto_backend` compiles each key on the backend the front chose
for it (``grammar_backend="auto"``: xgrammar, else llguidance); `structural_tags` reads the legacy structural-tag form
for both backends that take tags; `registry` holds their names (the one
list the config checks, importing neither torch nor a grammar library) and
imports a backend's class on first use. `grammar_analysis` finds rules of an
EBNF grammar that can never finish.

Nothing here imports `arborlm.runtime`, `arborlm.frontend_lang` or
`arborlm.entrypoints`.
"""
