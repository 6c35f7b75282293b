"""`global_config`: the frontend's process-wide settings, under SGLang's names.

SGLang's programs read and write ``sgl.global_config`` (``sglang/global_config.py``):
the default backend that `set_default_backend` sets, and a few interpreter
switches. The frontend keeps exactly one such object because SGLang's API has one
per process; nothing below `frontend_lang/` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    """The frontend's settings (SGLang's field names).

    default_backend: the backend of programs run without ``backend=`` (an `Engine`,
        `Runtime` or backend; `set_default_backend` stores it as a backend).
    verbosity: 2 prints each program's final text when `run` returns; 0 prints nothing.
    enable_precache_with_tracing: `run_batch` prefills the prefix its programs share
        (found by tracing) before starting them.
    skip_special_tokens_in_output, spaces_between_special_tokens_in_out: the
        detokenizer options sent with every `gen` (the runtime's own defaults: True).
    enable_parallel_encoding: accepted for SGLang's programs; ``join("concate_and_append")``
        always appends the branches' text (arborlm has no KV concatenation).
    """

    default_backend: Any = None
    verbosity: int = 0
    enable_precache_with_tracing: bool = True
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    enable_parallel_encoding: bool = True

    def detokenize_options(self) -> dict[str, bool]:
        """The detokenizer fields a `gen` sends: only those set away from the runtime's defaults."""
        options = {}
        if not self.skip_special_tokens_in_output:
            options["skip_special_tokens"] = False
        if not self.spaces_between_special_tokens_in_out:
            options["spaces_between_special_tokens"] = False
        return options


global_config = GlobalConfig()
