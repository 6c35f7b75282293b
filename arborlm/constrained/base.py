"""The interface every grammar backend implements.

A request asks for at most one constraint, a `GrammarKey` (kind + text; it and
`GrammarError` are defined in the torch-free `keys`, which the front imports). A
`GrammarBackend` compiles a key once into a `CompiledGrammar` (cached by the
`GrammarManager` under (backend name, kind, text)); each request then gets its
own `GrammarMatcher` from it. Per decode step the scheduler asks every
constrained request's matcher to fill its row of one batch bitmask, applies the
bitmask to the logits, samples, and hands the sampled token back with
`accept_token`.

Bitmask layout (xgrammar's, which outlines-core shares): int32 tensor of shape
(batch, ceil(vocab_size / 32)); bit ``j % 32`` of word ``j // 32`` is 1 when
token ``j`` is allowed.

Design after SGLang's ``sglang/srt/constrained/base_grammar_backend.py``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from arborlm.constrained.keys import ANY_JSON, GRAMMAR_KINDS, GrammarError, GrammarKey

if TYPE_CHECKING:
    from arborlm.constrained.json_schema import SchemaPolicy

# The torch-free types live in `keys` (the front imports them from there); named here too.
__all__ = [
    "ANY_JSON",
    "GRAMMAR_KINDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarKey",
    "GrammarMatcher",
    "allocate_vocab_mask",
    "apply_vocab_mask",
]


class GrammarMatcher(abc.ABC):
    """Per-request matcher state over one compiled grammar.

    Not thread-safe; lives in the scheduler thread.
    """

    @abc.abstractmethod
    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens of the current state into ``vocab_mask[row]``.

        vocab_mask: (batch, ceil(vocab_size / 32)) int32 on the CPU.
        """

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar rejects it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar has ended (a stop token was accepted, or nothing can follow)."""

    @abc.abstractmethod
    def find_jump_forward_string(self) -> str:
        """The text every continuation must start with from here ("" when none)."""


class CompiledGrammar(abc.ABC):
    """A grammar compiled against one tokenizer; cheap to make matchers from."""

    @abc.abstractmethod
    def new_matcher(self, stop_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the grammar's start state.

        stop_token_ids: the request's own stop ids. Like the backend's EOS ids
        they are allowed only where the grammar may end (whatever text they
        stand for), and accepting one there ends the grammar as an EOS would.
        """


class GrammarBackend(abc.ABC):
    """Compiles grammars for one tokenizer.

    Parameters (of implementations): the Hugging Face tokenizer, the model's
    vocab size (rows of the logits, which may exceed the tokenizer's) and the
    model's EOS ids (the only tokens allowed once the grammar is complete).

    A backend whose `kinds` include ``json_schema`` sets `schema_policy`: how
    `prepare_json_schema` rewrites a user's schema for it and relaxes it in
    lenient mode; `check` then refuses what the backend still cannot enforce.
    """

    name: str = ""
    kinds: tuple[str, ...] = ()
    schema_policy: ClassVar[SchemaPolicy]

    def __new__(cls, *args, **kwargs):
        # The arguments are kept so that a compile worker process can build the same backend.
        backend = super().__new__(cls)
        backend._constructor_args = (args, kwargs)
        return backend

    @classmethod
    def check(cls, key: GrammarKey) -> None:
        """Parse ``key`` without the tokenizer (cheap; the front calls it before queueing).

        Raises
        ------
        GrammarError
            The kind is not supported by this backend, or the text does not parse.
        """
        if key.kind not in cls.kinds:
            raise GrammarError(
                f"the {cls.name} grammar backend does not support {key.kind}; "
                f"it supports {', '.join(cls.kinds)}",
                key.param,
            )
        cls._check_syntax(key)

    @classmethod
    @abc.abstractmethod
    def _check_syntax(cls, key: GrammarKey) -> None:
        """Raise `GrammarError` when the text does not parse."""

    @abc.abstractmethod
    def compile(self, key: GrammarKey) -> CompiledGrammar:
        """Compile ``key`` (may take seconds; runs in the grammar worker thread).

        Raises
        ------
        GrammarError
            Unsupported kind or a grammar the backend rejects.
        """

    # Compiling in a worker process (optional). The `GrammarManager` compiles in
    # worker processes that it can kill when a compile outlives its timeout, for
    # backends that implement both `compile_serialized` and `load_compiled`;
    # others compile on threads of the serving process, which cannot be stopped.

    # Whether the `GrammarManager` compiles in worker processes by default. A backend whose
    # compiled grammars cost more to ship than to compile (xgrammar's, for large schemas)
    # sets it False: it then compiles once, on a thread.
    compile_in_worker_by_default: bool = True

    def worker_args(self) -> tuple[tuple, dict] | None:
        """(args, kwargs) that build this backend again in a compile worker process.

        None when the backend does not implement `compile_serialized` and
        `load_compiled`. The arguments are those this backend was built with;
        the worker pickles them (a Hugging Face tokenizer pickles).
        """
        if type(self).compile_serialized is GrammarBackend.compile_serialized:
            return None
        return self._constructor_args

    def compile_serialized(self, key: GrammarKey) -> Any:
        """Compile ``key`` (in a compile worker process) into a picklable payload for `load_compiled`.

        Returns
        -------
        The payload, or None when the grammar compiled but would cost more to
        ship than to compile again: the serving process then calls `compile`
        itself (the worker has shown that it finishes).

        Raises
        ------
        GrammarError
            As `compile`.
        """
        raise NotImplementedError

    def load_compiled(self, key: GrammarKey, payload: Any) -> CompiledGrammar:
        """The `CompiledGrammar` of ``key`` from a `compile_serialized` payload (in the serving process)."""
        raise NotImplementedError


def allocate_vocab_mask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """(batch_size, ceil(vocab_size / 32)) int32, all tokens allowed (-1 words)."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set disallowed logits to -inf in place.

    logits: (B, V) float32 on any device; vocab_mask: (B, ceil(V / 32)) int32
    (moved to the logits' device). ``rows``: only these rows of both (default all).
    Uses xgrammar's ``apply_token_bitmask_inplace`` (CPU and CUDA kernels).
    """
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device, non_blocking=True), indices=rows)
