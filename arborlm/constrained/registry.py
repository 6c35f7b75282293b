"""The grammar backends arborlm serves: their names, and each one's class on first use.

`GRAMMAR_BACKEND_NAMES` is the one list: the server config checks
``--grammar-backend`` against it, and `backend_class` maps a name to its
`GrammarBackend` subclass. The front asks for a class when it checks a
request's grammar (`grammar_spec_from_params`, the OpenAI tool calls), the
scheduler when it builds its backend (`create_grammar_backend`).

This module imports nothing at module level, so importing the names (the HTTP
process's config does) loads neither torch nor a grammar library; a backend's
module, which imports both, is imported only when its class is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arborlm.constrained.base import GrammarBackend

GRAMMAR_BACKEND_NAMES = ("xgrammar", "outlines", "llguidance", "auto")

# ``grammar_backend="auto"``: the backends tried for each request's constraint, in order; the
# first that accepts it at the front's check compiles it (`auto_backend`). xgrammar first: it
# covers the most of JSONSchemaBench alone (docs/structured_output.md); llguidance takes the
# schemas it refuses (decimal ``multipleOf``, ``uniqueItems`` over enums).
AUTO_BACKEND_ORDER = ("xgrammar", "llguidance")


def resolved_backend(key_backend: str, server_backend: str) -> str:
    """The backend that compiles a key: the one the front chose (``GrammarKey.backend``), else the
    server's, "auto" meaning its first choice."""
    if key_backend:
        return key_backend
    return AUTO_BACKEND_ORDER[0] if server_backend == "auto" else server_backend


def backend_class(name: str) -> type[GrammarBackend]:
    """The `GrammarBackend` subclass called ``name`` (one of `GRAMMAR_BACKEND_NAMES`).

    Imported on first use, so a front that only checks grammars loads one library.

    Raises
    ------
    ValueError
        ``name`` is not a known backend.
    """
    if name == "xgrammar":
        from arborlm.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    if name == "outlines":
        from arborlm.constrained.outlines_backend import OutlinesBackend

        return OutlinesBackend
    if name == "llguidance":
        from arborlm.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend
    if name == "auto":
        from arborlm.constrained.auto_backend import AutoGrammarBackend

        return AutoGrammarBackend
    raise ValueError(f"unknown grammar backend {name!r}; expected one of {GRAMMAR_BACKEND_NAMES}")
