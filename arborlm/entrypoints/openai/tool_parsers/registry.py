"""Which tool-call format a server speaks: by `--tool-call-parser` name, else from the chat template.

Names are SGLang's: ``hermes`` and ``qwen25`` (one format), ``llama3``,
``mistral``, ``pythonic``. Without a name, the template decides: it renders
`tools` in one format (`ToolCallFormat.renders_natively`, tried in
`DETECTION_ORDER`); a template that renders none gets Hermes blocks, described
in the system prompt (`tool_prompt.py`).
"""

from __future__ import annotations

from arborlm.entrypoints.openai.tool_parsers.base import ToolCallFormat
from arborlm.entrypoints.openai.tool_parsers.hermes import HermesFormat
from arborlm.entrypoints.openai.tool_parsers.llama3 import Llama3Format
from arborlm.entrypoints.openai.tool_parsers.mistral import MistralFormat
from arborlm.entrypoints.openai.tool_parsers.pythonic import PythonicFormat
from arborlm.runtime.config import TOOL_CALL_PARSERS


def _formats(template: str) -> dict[str, ToolCallFormat]:
    return {"hermes": HermesFormat(), "qwen25": HermesFormat(), "llama3": Llama3Format.from_template(template),
            "mistral": MistralFormat(), "pythonic": PythonicFormat()}


# Most specific first: a pythonic Llama template also has Llama's markers.
DETECTION_ORDER = ("mistral", "pythonic", "hermes", "llama3")


def tool_call_format(name: str | None, template: str | None) -> ToolCallFormat:
    """The format named `name`, or the one the chat template `template` renders (Hermes when none).

    Raises
    ------
    ValueError: `name` is not one of `TOOL_CALL_PARSERS`.
    """
    formats = _formats(template or "")
    assert set(formats) == set(TOOL_CALL_PARSERS)  # one list of names: the config's
    if name is not None:
        if name not in formats:
            raise ValueError(f"tool_call_parser={name!r} is invalid: expected one of {TOOL_CALL_PARSERS}")
        return formats[name]
    for candidate in DETECTION_ORDER:
        if template and formats[candidate].renders_natively(template):
            return formats[candidate]
    return formats["hermes"]
