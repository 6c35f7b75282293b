"""arborlm: structured generation and agent serving with a radix-tree KV cache.

The public API mirrors SGLang's (``sglang/__init__.py``), so `import arborlm as sgl`
runs SGLang programs: `function`, `gen`, `gen_int`, `gen_string`, `select`,
`separate_reasoning`, `system`, `user`, `assistant` (and their `_begin`/`_end` markers),
`set_default_backend`, `flush_cache`, `get_server_info`, `global_config`, the choices
methods (`token_length_normalized`, `greedy_token_selection`,
`unconditional_likelihood_normalized`), the backends `Engine`, `Runtime` (a local server
started from Python), `RuntimeEndpoint` (programs against a running server) and `OpenAI`
(any OpenAI-compatible server), and `SamplingParams`. `image`, `video`, `Anthropic`,
`LiteLLM` and `VertexAI` exist and refuse with `UnsupportedByBackendError` (docs/dsl.md).

The names load on first use (PEP 562), so importing a runtime module (the HTTP
server, the scheduler) does not import the DSL, and `import arborlm` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from arborlm.sampling_params import SamplingParams
from arborlm.version import __version__

_API = "arborlm.frontend_lang.api"
# Public name -> the module that defines it.
_LAZY = {
    "Engine": "arborlm.entrypoints.engine",
    "BaseBackend": "arborlm.frontend_lang.backend.base_backend",
    "UnsupportedByBackendError": "arborlm.frontend_lang.backend.base_backend",
    "OpenAI": "arborlm.frontend_lang.backend.openai_backend",
    "RuntimeEndpoint": "arborlm.frontend_lang.backend.runtime_endpoint",
    "greedy_token_selection": "arborlm.frontend_lang.choices",
    "token_length_normalized": "arborlm.frontend_lang.choices",
    "unconditional_likelihood_normalized": "arborlm.frontend_lang.choices",
    "CompiledFunction": "arborlm.frontend_lang.function",
    "SglFunction": "arborlm.frontend_lang.function",
    "global_config": "arborlm.frontend_lang.global_config",
    "ProgramState": "arborlm.frontend_lang.program_state",
    "ProgramStateGroup": "arborlm.frontend_lang.program_state",
    **{name: _API for name in (
        "Anthropic", "LiteLLM", "Runtime", "VertexAI", "assistant", "assistant_begin", "assistant_end",
        "flush_cache", "function", "gen", "gen_int", "gen_string", "get_default_backend", "get_server_info",
        "image", "select", "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
        "user", "user_begin", "user_end", "video",
    )},
}

__all__ = ["__version__", "SamplingParams", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'arborlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
