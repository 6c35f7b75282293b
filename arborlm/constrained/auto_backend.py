"""``grammar_backend="auto"``: each request's grammar compiled on the backend the front chose for it.

The front (`grammar_spec.grammar_spec_from_params`) tries the backends of
`AUTO_BACKEND_ORDER` in turn on a request's constraint, each with its own
schema policy and ``check``, and writes the first that accepts it into the key
(`GrammarKey.backend`); a constraint every backend refuses is a 400 there. The
scheduler's `GrammarManager` holds one `AutoGrammarBackend`, which compiles
each key on the backend named in it, so the answer the front gave (accepted,
and by whom) is the one the scheduler acts on.

Backends can share a batch: every backend writes the same bitmask layout
(`base`: int32, ceil(vocab / 32) words per row, bit ``j % 32`` of word
``j // 32``), and the model worker asks each request's own matcher to fill its
row, accept its token, roll back and find its forced text.
"""

from __future__ import annotations

import threading
from typing import Any

from arborlm.constrained.base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKey
from arborlm.constrained.json_schema import XGRAMMAR_POLICY
from arborlm.constrained.registry import AUTO_BACKEND_ORDER, backend_class


class AutoGrammarBackend(GrammarBackend):
    """Compiles each key on the backend its ``backend`` field names (xgrammar when empty).

    Parameters
    ----------
    tokenizer, vocab_size, eos_token_ids:
        As for every backend (`GrammarBackend`). The first backend of
        `AUTO_BACKEND_ORDER` is built here, as a server on it alone builds it,
        so its first compile does not pay for reading the vocabulary within
        `grammar_compile_timeout`; the others are built when their first key is
        compiled, so a server whose requests all go to xgrammar never builds
        llguidance's tokenizer.

    Raises
    ------
    ValueError
        No EOS id (the backends' constructors raise theirs when first built).
    """

    name = "auto"
    kinds = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
    # A key that names no backend (a tool call's argument schema, a constraint after reasoning)
    # is the first backend's, prepared with its policy.
    schema_policy = XGRAMMAR_POLICY
    compile_in_worker_by_default = False  # as both backends: their compiles are not worth shipping

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        if not eos_token_ids:
            raise ValueError("the auto grammar backend needs at least one EOS token id")
        self._args = (tokenizer, vocab_size, list(eos_token_ids))
        self._backends: dict[str, GrammarBackend] = {}
        # Compiles run on the grammar manager's slot threads: one builds a backend, the others wait.
        self._building = threading.Lock()
        self.backend(AUTO_BACKEND_ORDER[0])

    def backend(self, name: str) -> GrammarBackend:
        """The backend ``name`` of `AUTO_BACKEND_ORDER`, built on first use (each reads the vocabulary once).

        Raises
        ------
        ValueError
            As that backend's constructor.
        """
        with self._building:
            if name not in self._backends:
                self._backends[name] = backend_class(name)(*self._args)
            return self._backends[name]

    @classmethod
    def check(cls, key: GrammarKey) -> None:
        """The check of the backend ``key`` names (the first of `AUTO_BACKEND_ORDER` when none).

        Raises
        ------
        GrammarError
            As that backend's ``check``; or ``key.backend`` is not one that "auto" chooses from.
        """
        backend_class(_backend_name(key)).check(key)

    @classmethod
    def _check_syntax(cls, key: GrammarKey) -> None:
        backend_class(_backend_name(key))._check_syntax(key)

    def compile(self, key: GrammarKey) -> CompiledGrammar:
        """``key`` compiled on its backend.

        Raises
        ------
        GrammarError
            As that backend's ``compile``, or ``key.backend`` is not one of `AUTO_BACKEND_ORDER`.
        """
        return self.backend(_backend_name(key)).compile(key)

    def compile_serialized(self, key: GrammarKey) -> Any:
        """Its backend's `compile_serialized` payload (None: compile again in the serving process)."""
        return self.backend(_backend_name(key)).compile_serialized(key)

    def load_compiled(self, key: GrammarKey, payload: Any) -> CompiledGrammar:
        """Its backend's grammar from a `compile_serialized` payload."""
        return self.backend(_backend_name(key)).load_compiled(key, payload)


def _backend_name(key: GrammarKey) -> str:
    """The backend that compiles ``key`` under "auto".

    Raises
    ------
    GrammarError
        ``key.backend`` names a backend "auto" does not choose from.
    """
    name = key.backend or AUTO_BACKEND_ORDER[0]
    if name not in AUTO_BACKEND_ORDER:
        raise GrammarError(f"grammar_backend auto compiles on {', '.join(AUTO_BACKEND_ORDER)}, not {name!r}",
                           key.param)
    return name
