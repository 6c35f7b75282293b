"""Request bodies of the HTTP API as pydantic models: OpenAI's fields plus SGLang's extras.

Validation is strict about types (a string where a number belongs is a 400,
not a coercion) and lenient about unknown fields, which are ignored as vLLM
and SGLang ignore them, so clients that send newer OpenAI fields keep working.
Ranges of sampling values are checked later by `SamplingParams.verify`, which
names the field (`openai_common.openai_param` maps its names back to these).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from arborlm.sampling_params import MAX_N, MAX_TOP_LOGPROBS


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: the schema and whether every keyword must be enforced."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """`text`, `json_object` (any JSON object) or `json_schema` (that schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` object: one constraint (`json`, `regex`, `choice`, `grammar`,
    `json_object` or `structural_tag`) and options of its JSON grammar.

    Unknown keys are refused, not ignored: each one may change what output is allowed.
    How each maps to arborlm's constraints is in `constraints.py`.
    """

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False


class SamplingRequest(_Body):
    """The fields `/v1/completions` and `/v1/chat/completions` share.

    OpenAI's: model, n, stream, stream_options, stop, temperature, top_p, seed,
    presence_penalty, frequency_penalty, logit_bias, user, response_format.
    SGLang's extras: top_k, min_p, repetition_penalty, regex, ebnf, json_schema,
    structural_tag, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
    spaces_between_special_tokens, no_stop_trim, rid, cache_salt.
    vLLM's constraint fields: guided_json, guided_regex, guided_choice,
    guided_grammar, guided_whitespace_pattern, guided_decoding_backend and
    structured_outputs (`constraints.py` maps or refuses each).
    """

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # SGLang's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    structural_tag: str | dict[str, Any] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None
    cache_salt: str | None = None
    # vLLM's constraint fields (the guided_* ones are its older spelling of structured_outputs)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # picks an implementation, not the output: no effect
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`; `prompt` is a string, strings, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # None (null) means OpenAI's default too: 16 (see openai_completions)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Body):
    """One part of a message's content; only `text` parts are served."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class FunctionDefinition(_Body):
    """`tools[i].function`: a function the model may call.

    `parameters` is the JSON Schema of its arguments (no parameters when
    omitted); `strict: true` refuses schema keywords the grammar cannot enforce.
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    """One entry of `tools`; OpenAI's only tool type for chat is `function`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """`tool_choice={"type": "function", "function": {"name": ...}}`: call that function."""

    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Body):
    """The function of a tool call in the history; `arguments` is JSON text (an object is accepted too)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Body):
    """One of an assistant message's `tool_calls`."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    """One chat message; `content` is a string or a list of parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`.

    `max_completion_tokens` wins over `max_tokens` (OpenAI deprecated the latter);
    without either, the answer may run to the end of the context.
    `continue_final_message` continues a final assistant message (assistant
    prefill) instead of opening a new assistant turn. `tools`, `tool_choice`
    and `parallel_tool_calls` are served by `tool_calls.py`. With
    `--reasoning-parser`, `separate_reasoning: false` (SGLang's field) leaves the
    thinking in `content`.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class GenerateRequest(_Body):
    """`POST /generate`, SGLang's native request: one prompt or a batch.

    `rid` is one id, or one per request of the batch (prompts × n).
    `return_text_in_logprobs` fills the token text into each logprob triple.
    Other fields are kept in `model_extra`: the route accepts SGLang's fields at their
    neutral value and refuses the rest (`sglang_fields.check_extra_fields`).
    """

    model_config = ConfigDict(strict=True, extra="allow")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    cache_salt: str | None = None


class AbortRequest(_Body):
    """`POST /abort_request`: one request id, or every request."""

    rid: str | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("give rid or abort_all=true")
        return self
