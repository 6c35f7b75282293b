"""Request bodies of OpenAI's Responses API (`POST /v1/responses`) as pydantic models.

As in `protocol.py`, types are strict and unknown fields are ignored (the
Agents SDK and newer clients send `include`, `truncation`, `prompt_cache_key`
...). `input` items and `tools` entries are kept as plain objects here and read
one by one in `responses_input.py`, so that an error names the item
(``input[3].call_id``) rather than a branch of a pydantic union.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class TextFormat(_Body):
    """`text.format`: ``text``, ``json_object`` or ``json_schema`` (name, schema, strict)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a text.format of type json_schema needs schema")
        return self


class TextConfig(_Body):
    """`text`: the output's format (`verbosity` is accepted and has no effect)."""

    format: TextFormat | None = None
    verbosity: str | None = None


class FunctionTool(_Body):
    """One `tools` entry of type ``function`` (the Responses API's flat shape)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Body):
    """`tool_choice={"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: str


class ResponsesRequest(_Body):
    """`POST /v1/responses`.

    `input` is a string (one user message) or a list of items: messages
    (``{"role", "content"}`` with text parts), ``function_call`` and
    ``function_call_output`` items for tool turns, and ``reasoning`` items
    (accepted and not rendered, as chat templates drop past reasoning).
    `previous_response_id` continues a stored response: its conversation comes
    first, its `instructions` do not carry over (OpenAI's rule). `store: false`
    keeps the response out of the store. `seed`, `top_k`, `min_p`,
    `repetition_penalty` and `stop` are vLLM's and SGLang's extra sampling fields.
    """

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False  # only false: arborlm has no background mode (`serving_responses`)
    # vLLM's and SGLang's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None

    @field_validator("stream", "store", "background", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info) -> Any:
        """null means "not set": sglang-router re-encodes every body with these as null."""
        if value is None:
            return cls.model_fields[info.field_name].default
        return value
