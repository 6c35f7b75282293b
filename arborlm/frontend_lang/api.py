"""Public functions of the DSL, with SGLang's names and signatures.

`import arborlm as sgl` then `@sgl.function`, `sgl.gen`, `sgl.select`,
`sgl.system/user/assistant`, `sgl.separate_reasoning`, `sgl.set_default_backend`,
`sgl.flush_cache`, `sgl.get_server_info`, `sgl.Runtime`, `sgl.global_config` work as in
SGLang's frontend (``sglang/lang/api.py``); `sgl.image` and `sgl.video` refuse, with a
typed error, until arborlm serves multimodal models.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.frontend_lang.backend.base_backend import BaseBackend, UnsupportedByBackendError
from arborlm.frontend_lang.choices import ChoicesSamplingMethod, token_length_normalized
from arborlm.frontend_lang.global_config import global_config
from arborlm.frontend_lang.ir import (
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    role_block,
)
from arborlm.frontend_lang.literals import (
    DTYPE_REGEX,
    DTYPE_STOPS,
    JSON_STRING_REGEX,  # noqa: F401 - re-exported, programs import it here
)
from arborlm.frontend_lang.select import check_choices

_DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str, "string": str}


def as_backend(backend: Any) -> BaseBackend:
    """A backend from a backend, an `Engine` or a `Runtime` (its `endpoint`).

    Raises
    ------
    TypeError: for anything else.
    """
    if isinstance(backend, BaseBackend):
        return backend
    from arborlm.entrypoints.engine import Engine

    if isinstance(backend, Engine):
        from arborlm.frontend_lang.backend.engine_backend import EngineBackend

        cached = getattr(backend, "_frontend_backend", None)
        if cached is None:  # one per engine: deriving the chat template renders it several times
            cached = backend._frontend_backend = EngineBackend(backend)
        return cached
    if isinstance(getattr(backend, "endpoint", None), BaseBackend):  # a Runtime, as SGLang unwraps it
        return backend.endpoint
    raise TypeError(f"expected a backend, an arborlm.Engine or an arborlm.Runtime, got {type(backend).__name__}")


def set_default_backend(backend: Any) -> None:
    """Use `backend` (a backend, an `Engine` or a `Runtime`) for programs run without `backend=`;
    it is `global_config.default_backend` afterwards."""
    global_config.default_backend = as_backend(backend)


def get_default_backend() -> BaseBackend | None:
    """The default backend, or None."""
    backend = global_config.default_backend
    return None if backend is None else as_backend(backend)


def resolve_backend(backend: Any = None) -> BaseBackend:
    """`backend`, else the default one.

    Raises
    ------
    ValueError: no backend given and none set as default.
    """
    if backend is not None:
        return as_backend(backend)
    default = get_default_backend()
    if default is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(...)")
    return default


def flush_cache(backend: Any = None) -> bool:
    """Empty the (default) backend's radix cache; False while requests are in flight, or
    when there is no backend at all (as SGLang's)."""
    backend = backend if backend is not None else get_default_backend()
    return False if backend is None else as_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """The (default) backend's server info (KV slots, running requests, cache hit rate...);
    None when there is no backend at all (as SGLang's)."""
    backend = backend if backend is not None else get_default_backend()
    return None if backend is None else as_backend(backend).get_server_info()


def Runtime(*args: Any, **kwargs: Any):  # noqa: N802 - SGLang's name for it
    """A local `arborlm serve` started from Python (`arborlm/frontend_lang/runtime.py`)."""
    from arborlm.frontend_lang.runtime import Runtime as _Runtime

    return _Runtime(*args, **kwargs)


def _refused_backend(name: str, package: str):
    def refuse(*args: Any, **kwargs: Any) -> BaseBackend:
        raise UnsupportedByBackendError(
            f"sgl.{name}: arborlm has no {name} backend (it would need the {package!r} client and {name}'s own "
            "API); use sgl.OpenAI for any OpenAI-compatible server, or an Engine / RuntimeEndpoint", name)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"SGLang's {name} backend. Refused: raises `UnsupportedByBackendError`."
    return refuse


Anthropic = _refused_backend("Anthropic", "anthropic")
LiteLLM = _refused_backend("LiteLLM", "litellm")
VertexAI = _refused_backend("VertexAI", "vertexai")


def image(expr: Any) -> SglExpr:
    """SGLang's image input. Refused: arborlm serves text-only models.

    Raises
    ------
    UnsupportedByBackendError: always (param "image").
    """
    raise UnsupportedByBackendError(
        "sgl.image(): arborlm serves text-only models, so programs cannot send images", "image")


def video(path: str, num_frames: int) -> SglExpr:
    """SGLang's video input. Refused: arborlm serves text-only models.

    Raises
    ------
    UnsupportedByBackendError: always (param "video").
    """
    raise UnsupportedByBackendError(
        "sgl.video(): arborlm serves text-only models, so programs cannot send videos", "video")


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
) -> SglExpr:
    """Generate text at this point of the program and store it under `name`.

    The parameters are SGLang's, in its order (`repetition_penalty` and `seed`, which
    SGLang's `gen` lacks, come last). `max_tokens` maps to `max_new_tokens` and
    `min_tokens` to `min_new_tokens`; unset fields take the program's defaults, then
    `SamplingParams`' defaults. A typed gen cut by `max_tokens` still yields a whole literal:
    the interpreter closes it (`literals.py`); int and float gens also stop at a space,
    newline, comma... after the number (added to `stop`).

    At most one constraint: `regex`; `json_schema` as a dict, its JSON text or
    a pydantic model class; `dtype` (int, float, bool or str, as a type or its
    name: a regex for that literal, str a JSON string literal; the variable holds the
    text); `choices`, which makes this a `select` (SGLang's meaning: the choices are
    scored, not sampled).

    `stop_regex` (a pattern or a list) ends the generation where a pattern first
    matches the generated text; the text up to the end of the match is kept (the
    interpreter streams the generation and cuts it there). `return_text_in_logprobs`
    fills each logprob triple's token text.

    Raises
    ------
    InvalidRequestError: more than one constraint, empty / non-string choices,
        an invalid regex or stop_regex, an unknown dtype, `n` other than 1.
    """
    given = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("choices", choices),
                            ("dtype", dtype)) if v is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"give at most one of regex, json_schema, dtype and choices, got {given}", given[1])
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if n not in (None, 1):
        raise InvalidRequestError("gen takes n=1; use s.fork(n) for several samples", "n")
    if dtype is not None:
        dtype = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        regex = DTYPE_REGEX.get(dtype)
        if regex is None:
            raise InvalidRequestError(f"dtype must be int, float, bool or str, got {dtype!r}", "dtype")
        if dtype in DTYPE_STOPS:  # where the model may end a number (`literals.py`)
            own = [stop] if isinstance(stop, str) else list(stop or [])
            stop = own + [c for c in DTYPE_STOPS[dtype] if c not in own]
    if regex is not None:
        _compile(regex, "regex")
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
    logprobs = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs}
    return SglGen(name, {k: v for k, v in sampling.items() if v is not None},
                  {k: v for k, v in logprobs.items() if v is not None},
                  stop_regex=_stop_regexes(stop_regex), dtype=dtype)


def _compile(pattern: Any, param: str) -> re.Pattern:
    """`pattern` compiled.

    Raises
    ------
    InvalidRequestError: not a string, or not a valid regex (naming `param`).
    """
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError(f"{param} must be a non-empty string, got {pattern!r}", param)
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InvalidRequestError(f"invalid {param} {pattern!r}: {e}", param) from e


def _stop_regexes(stop_regex: Any) -> list[str] | None:
    """`stop_regex` as a list of valid patterns (None when not given)."""
    if stop_regex is None:
        return None
    patterns = [stop_regex] if isinstance(stop_regex, str) else stop_regex
    if not isinstance(patterns, (list, tuple)) or not patterns:
        raise InvalidRequestError("stop_regex must be a pattern or a non-empty list of patterns", "stop_regex")
    for pattern in patterns:
        _compile(pattern, "stop_regex")
    return list(patterns)


def gen_int(name: str | None = None, **kwargs: Any) -> SglExpr:
    """`gen(name, dtype=int, ...)`: an integer literal."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> SglExpr:
    """`gen(name, dtype=str, ...)`: a double-quoted string literal."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> SglSelect:
    """Append the choice the model finds most likely here and store it under `name`.

    Every choice is scored as a continuation of the program text in one batch
    that shares the program's cached prefix (`select.py`); `choices_method`
    turns the token log probabilities into the decision; its scores go to the
    variable's meta info.

    Raises
    ------
    InvalidRequestError: `choices` empty or not all non-empty strings.
    """
    return SglSelect(name, check_choices(choices), temperature, choices_method)


def schema_of(json_schema: Any) -> Any:
    """A pydantic model class becomes its JSON schema; anything else passes through."""
    if isinstance(json_schema, type) and hasattr(json_schema, "model_json_schema"):
        return json_schema.model_json_schema()
    return json_schema


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> SglExpr:
    """`expr` whose generations split the model's thinking off (SGLang's `separate_reasoning`).

    After ``s += separate_reasoning(gen("answer"), model_type="qwen3")``, ``s["answer"]``
    holds what follows the reasoning and ``s["answer_reasoning_content"]`` the reasoning
    (`entrypoints/openai/reasoning_parser.py`: ``qwen3``, ``deepseek-r1``); the program's
    text keeps both. Works streamed too (the split is made when the generation ends).

    Raises
    ------
    ValueError: `model_type` is not a reasoning parser, or a gen in `expr` has no name.
    TypeError: `expr` holds no gen.
    """
    from arborlm.runtime.config import REASONING_PARSERS

    if model_type not in REASONING_PARSERS:
        raise ValueError(f"model_type must be one of {REASONING_PARSERS}, got {model_type!r}")
    marked = _with_reasoning(expr, model_type)
    if marked is expr:
        raise TypeError("separate_reasoning needs a gen() (or an expression holding one)")
    return marked


def _with_reasoning(expr: Any, model_type: str) -> Any:
    """`expr` with every gen in it marked with `model_type` (a new expression; `expr` is unchanged)."""
    if isinstance(expr, SglGen):
        if expr.name is None:
            raise ValueError("separate_reasoning needs a named gen: the reasoning goes to <name>_reasoning_content")
        return dataclasses.replace(expr, reasoning_parser=model_type)
    if isinstance(expr, SglExprList):
        marked = [_with_reasoning(e, model_type) for e in expr.exprs]
        return expr if all(m is e for m, e in zip(marked, expr.exprs, strict=True)) else SglExprList(marked)
    return expr


def system(expr: Any = None) -> SglExpr:
    return role_block("system", expr)


def user(expr: Any = None) -> SglExpr:
    return role_block("user", expr)


def assistant(expr: Any = None) -> SglExpr:
    return role_block("assistant", expr)


def function(func=None, num_api_spec_tokens: int | None = None):
    """Decorator that turns `def prog(s, ...)` into a runnable `SglFunction`.

    `@function(num_api_spec_tokens=N)` turns on SGLang's API speculative execution:
    one request generates N tokens ahead and the program's next gens (each ending at
    a stop string) are cut from it while the text the program appends in between
    matches (`speculative.py`).

    Raises
    ------
    ValueError: `num_api_spec_tokens` is not a positive integer.
    """
    from arborlm.frontend_lang.function import SglFunction

    if num_api_spec_tokens is not None and (
            not isinstance(num_api_spec_tokens, int) or isinstance(num_api_spec_tokens, bool)
            or num_api_spec_tokens < 1):
        raise ValueError(f"num_api_spec_tokens must be a positive integer, got {num_api_spec_tokens!r}")
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)


def system_begin() -> SglExpr:
    return SglRoleBegin("system")


def system_end() -> SglExpr:
    return SglRoleEnd("system")


def user_begin() -> SglExpr:
    return SglRoleBegin("user")


def user_end() -> SglExpr:
    return SglRoleEnd("user")


def assistant_begin() -> SglExpr:
    return SglRoleBegin("assistant")


def assistant_end() -> SglExpr:
    return SglRoleEnd("assistant")
