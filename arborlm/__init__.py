"""arborlm: structured generation and agent serving with a radix-tree KV cache.

The public API mirrors SGLang's, so `import arborlm as sgl` runs SGLang programs:
`function`, `gen`, `system`, `user`, `assistant`, `set_default_backend`, `Engine`,
`RuntimeEndpoint` (programs against a running server), `SamplingParams`.
"""

from arborlm.frontend_lang.api import (
    SglFunction,
    assistant,
    function,
    gen,
    get_default_backend,
    set_default_backend,
    system,
    user,
)
from arborlm.frontend_lang.backend.runtime_endpoint import RuntimeEndpoint
from arborlm.runtime.engine import Engine
from arborlm.runtime.sampling import SamplingParams

__all__ = [
    "Engine",
    "RuntimeEndpoint",
    "SamplingParams",
    "SglFunction",
    "assistant",
    "function",
    "gen",
    "get_default_backend",
    "set_default_backend",
    "system",
    "user",
]
__version__ = "0.1.0"
