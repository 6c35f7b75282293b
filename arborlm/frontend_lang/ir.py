"""The DSL's expressions: what `s += ...` accepts.

A program appends expressions to its `ProgramState`: plain text, `gen` and
`select` calls, role blocks, variable scopes and concatenations of these
(`"Q: " + gen("a")`). The interpreter (`interpreter.py`) gives them meaning and
the tracer (`tracer.py`) records them without a model; here they are only data.

Names follow SGLang's ``sglang/lang/ir.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from arborlm.frontend_lang.backend.base_backend import UnsupportedByBackendError

ROLES = ("system", "user", "assistant")

# SGLang's public regexes for typed literals (``sglang/lang/ir.py``), with its values: programs
# import them for `gen(regex=...)`. The int and float ones end in optional spaces or newlines,
# which is why SGLang's programs pair them with ``stop=[" ", "\n"]``. `gen(dtype=...)` uses
# tighter ones of its own (`literals.DTYPE_REGEX`).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


class SglExpr:
    """Base of every expression; `+` concatenates."""

    def __add__(self, other: Any) -> SglExprList:
        return SglExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> SglExprList:
        return SglExprList([to_expr(other), self])


@dataclass
class SglConstantText(SglExpr):
    value: str


@dataclass
class SglExprList(SglExpr):
    exprs: list[SglExpr]

    def __add__(self, other: Any) -> SglExprList:
        return SglExprList([*self.exprs, to_expr(other)])


@dataclass
class SglGen(SglExpr):
    """A generation call whose text is stored under `name`.

    sampling: the `SamplingParams` fields given to `gen` (None fields omitted),
    e.g. {"max_new_tokens": 64, "stop": ["\\n"], "temperature": 0}.
    logprobs: `return_logprob`, `logprob_start_len`, `top_logprobs_num` when given.
    reasoning_parser: set by `separate_reasoning`: the variable holds the answer and
        `<name>_reasoning_content` the thinking (the program's text keeps both).
    stop_regex: patterns that end the generation where one first matches the generated
        text (the match is kept, as SGLang's runtime keeps it); the interpreter enforces them.
    dtype: int, float, bool or str for a typed gen (its regex is in `sampling`): the interpreter
        completes a literal cut short (`literals.complete_literal`).
    """

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    stop_regex: list[str] | None = None
    dtype: type | None = None

    @property
    def reasoning_name(self) -> str:
        """The variable of the reasoning split off by `separate_reasoning` (SGLang's name for it)."""
        return f"{self.name}_reasoning_content"


@dataclass
class SglSelect(SglExpr):
    """Pick one of `choices` by scoring each continuation's log probability.

    choices_method: a `ChoicesSamplingMethod` (`choices.py`).
    """

    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Any


@dataclass
class SglRoleBegin(SglExpr):
    role: str


@dataclass
class SglRoleEnd(SglExpr):
    role: str


@dataclass
class SglVarScopeBegin(SglExpr):
    name: str


@dataclass
class SglVarScopeEnd(SglExpr):
    name: str


class SglImage(SglExpr):
    """SGLang's image node (what `sgl.image` makes). Refused: arborlm serves text-only models.

    Raises
    ------
    UnsupportedByBackendError: always, on construction (param "image").
    """

    def __init__(self, *args: Any, **kwargs: Any):
        raise UnsupportedByBackendError("SglImage: arborlm serves text-only models, so programs cannot send images",
                                        "image")


class SglVideo(SglExpr):
    """SGLang's video node (what `sgl.video` makes). Refused: arborlm serves text-only models.

    Raises
    ------
    UnsupportedByBackendError: always, on construction (param "video").
    """

    def __init__(self, *args: Any, **kwargs: Any):
        raise UnsupportedByBackendError("SglVideo: arborlm serves text-only models, so programs cannot send videos",
                                        "video")


# SGLang's ir names for classes that live higher up here (importing them would be circular):
# `SglFunction` is `function.SglFunction`; `SglArgument` and `SglVariable` are both the tracer's
# placeholder, which stands for a program argument and for a generated variable read while tracing.
_LAZY_ALIASES = {
    "SglFunction": ("arborlm.frontend_lang.function", "SglFunction"),
    "SglArgument": ("arborlm.frontend_lang.tracer", "SglArgument"),
    "SglVariable": ("arborlm.frontend_lang.tracer", "SglArgument"),
}


def __getattr__(name: str) -> Any:
    """PEP 562: SGLang's ir names defined in other modules (`_LAZY_ALIASES`)."""
    if name in _LAZY_ALIASES:
        import importlib

        module, attr = _LAZY_ALIASES[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def to_expr(value: Any) -> SglExpr:
    """Text or an expression as an expression.

    Raises
    ------
    TypeError: for anything else (the message names the type).
    """
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    raise TypeError(f"cannot append a {type(value).__name__} to a program; use str or gen()/select()/roles")


def role_block(role: str, expr: Any = None) -> SglExpr:
    """`system(...)`, `user(...)`, `assistant(...)`: the content wrapped in the role's markers."""
    inner = [] if expr is None else [to_expr(expr)]
    return SglExprList([SglRoleBegin(role), *inner, SglRoleEnd(role)])


def flatten(expr: SglExpr) -> list[SglExpr]:
    """The leaves of an expression, in order (lists unpacked)."""
    if isinstance(expr, SglExprList):
        return [leaf for e in expr.exprs for leaf in flatten(e)]
    return [expr]
