"""Public functions of the DSL, with SGLang's names and signatures.

`import arborlm as sgl` then `@sgl.function`, `sgl.gen`, `sgl.system/user/assistant`,
`sgl.set_default_backend` work as in SGLang's frontend for these primitives.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.frontend_lang.backend.base_backend import BaseBackend
from arborlm.frontend_lang.interpreter import ProgramState
from arborlm.frontend_lang.ir import SglExpr, SglGen, role_block


class _DefaultBackend:
    """Holds the backend set by `set_default_backend` (SGLang's API needs one per process)."""

    backend: BaseBackend | None = None


def as_backend(backend: Any) -> BaseBackend:
    """A backend from a backend or an `Engine`.

    Raises
    ------
    TypeError: for anything else.
    """
    if isinstance(backend, BaseBackend):
        return backend
    from arborlm.runtime.engine import Engine

    if isinstance(backend, Engine):
        from arborlm.frontend_lang.backend.engine_backend import EngineBackend

        return EngineBackend(backend)
    raise TypeError(f"expected a backend or an arborlm.Engine, got {type(backend).__name__}")


def set_default_backend(backend: Any) -> None:
    """Use `backend` (a backend or an `Engine`) for programs run without `backend=`."""
    _DefaultBackend.backend = as_backend(backend)


def get_default_backend() -> BaseBackend | None:
    return _DefaultBackend.backend


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    min_tokens: int | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    choices: list[str] | None = None,
) -> SglGen:
    """Generate text at this point of the program and store it under `name`.

    `max_tokens` maps to `max_new_tokens` and `min_tokens` to `min_new_tokens`;
    unset fields take the program's defaults, then `SamplingParams`' defaults.

    At most one constraint: `regex`; `json_schema` as a dict, its JSON text or
    a pydantic model class; `choices`, a list of strings the output must equal
    one of (compiled to a regex alternation).

    Raises
    ------
    InvalidRequestError: more than one constraint, or empty / non-string choices.
    """
    given = [n for n, v in (("regex", regex), ("json_schema", json_schema), ("choices", choices)) if v is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"give at most one of regex, json_schema and choices, got {given}", given[1])
    if choices is not None:
        regex = choices_regex(choices)
    sampling = {
        "max_new_tokens": max_tokens,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "repetition_penalty": repetition_penalty,
        "ignore_eos": ignore_eos,
        "min_new_tokens": min_tokens,
        "seed": seed,
        "regex": regex,
        "json_schema": schema_of(json_schema),
    }
    return SglGen(name, {k: v for k, v in sampling.items() if v is not None})


def choices_regex(choices: list[str]) -> str:
    """A regex that full-matches exactly one of ``choices`` (escaped literally).

    Raises
    ------
    InvalidRequestError: ``choices`` empty or not all strings.
    """
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError("choices must be a non-empty list of strings", "choices")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def schema_of(json_schema: Any) -> Any:
    """A pydantic model class becomes its JSON schema; anything else passes through."""
    if isinstance(json_schema, type) and hasattr(json_schema, "model_json_schema"):
        return json_schema.model_json_schema()
    return json_schema


def system(expr: Any = None) -> SglExpr:
    return role_block("system", expr)


def user(expr: Any = None) -> SglExpr:
    return role_block("user", expr)


def assistant(expr: Any = None) -> SglExpr:
    return role_block("assistant", expr)


# `gen`'s SGLang names for program-wide sampling defaults in `run(...)`.
_RUN_SAMPLING_ALIASES = {"max_new_tokens": "max_new_tokens", "max_tokens": "max_new_tokens"}


class SglFunction:
    """A prompt program: a Python function whose first argument is the `ProgramState`."""

    def __init__(self, func, bind_arguments: dict[str, Any] | None = None):
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@function {func.__name__} must take the program state as its first argument")
        self.arg_names = params[1:]
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy with some arguments fixed."""
        return SglFunction(self.func, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run the program once and return its state.

        Keyword arguments that are not the program's parameters are sampling
        defaults for every `gen` (`temperature=0`, `max_new_tokens=64`).

        Raises
        ------
        ValueError: no backend given and none set as default.
        """
        backend = as_backend(backend) if backend is not None else get_default_backend()
        if backend is None:
            raise ValueError("no backend: pass backend=... or call set_default_backend(...)")
        program_kwargs = {k: v for k, v in kwargs.items() if k in self.arg_names}
        sampling = {_RUN_SAMPLING_ALIASES.get(k, k): v for k, v in kwargs.items() if k not in self.arg_names}
        state = ProgramState(backend, sampling)
        self.func(state, *args, **{**self.bind_arguments, **program_kwargs})
        return state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Inside another program: `f(s, ...)` runs `f` on the same state (nested call)."""
        return self.func(*args, **{**self.bind_arguments, **kwargs})


def function(func=None, **_options: Any):
    """Decorator that turns `def prog(s, ...)` into a runnable `SglFunction`."""
    if func is None:
        return lambda f: SglFunction(f)
    return SglFunction(func)
