"""arborlm: structured generation and agent serving with a radix-tree KV cache.

The public API mirrors SGLang's, so `import arborlm as sgl` runs SGLang programs:
`function`, `gen`, `gen_int`, `gen_string`, `select`, `separate_reasoning`,
`system`, `user`, `assistant` (and their `_begin`/`_end` markers), `set_default_backend`,
`flush_cache`, `get_server_info`, the choices methods
(`token_length_normalized`, `greedy_token_selection`,
`unconditional_likelihood_normalized`), the backends `Engine`,
`RuntimeEndpoint` (programs against a running server) and `OpenAI` (any
OpenAI-compatible server), and `SamplingParams`.
"""

from arborlm.entrypoints.engine import Engine
from arborlm.frontend_lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from arborlm.frontend_lang.backend.base_backend import BaseBackend
from arborlm.frontend_lang.backend.openai_backend import OpenAI
from arborlm.frontend_lang.backend.runtime_endpoint import RuntimeEndpoint
from arborlm.frontend_lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from arborlm.frontend_lang.function import CompiledFunction, SglFunction
from arborlm.frontend_lang.program_state import ProgramState, ProgramStateGroup
from arborlm.sampling_params import SamplingParams
from arborlm.version import __version__

__all__ = [
    "__version__",
    "BaseBackend",
    "CompiledFunction",
    "Engine",
    "OpenAI",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "SamplingParams",
    "SglFunction",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "greedy_token_selection",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
