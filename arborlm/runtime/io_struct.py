"""Messages between the front (tokenizer manager) and the scheduler process.

Plain dataclasses, pickled over zmq. The front sends `TokenizedGenerateReqInput`,
`AbortReq`, `FlushCacheReq` and `GetInfoReq`; the scheduler answers with
`BatchTokenOut` after each step and `InfoOut` on request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arborlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from arborlm.constrained.grammar_spec import GrammarSpec


@dataclass
class TokenizedGenerateReqInput:
    """One generation request, tokenized and validated by the front.

    input_ids: prompt token ids (at least one token).
    seed: the sampling seed actually used (the request's or one derived from the server's).
    logprob_start_len: first prompt position whose logprob is returned; -1 = none.
    grammar: the constraint, already checked by the front (None: unconstrained).
    cache_salt: the tenant namespace of this request's cached prefixes (None: shared).
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    grammar: GrammarSpec | None = None
    cache_salt: str | None = None


@dataclass
class AbortReq:
    """Stop a request; its KV goes to the cache and it finishes with `abort`."""

    rid: str


@dataclass
class FlushCacheReq:
    """Drop every unlocked radix-cache entry (only when no request is running)."""


@dataclass
class GetInfoReq:
    """Ask for live scheduler figures (and run the pool invariant checks)."""

    check_invariants: bool = False


@dataclass
class InfoOut:
    """Live scheduler figures."""

    info: dict[str, Any]


@dataclass
class ReqOutput:
    """What one request produced in one scheduler step.

    new_token_ids: tokens generated this step (usually one).
    finish_reason: None while running, else SGLang's dict, e.g.
        {"type": "stop", "matched": 2}, {"type": "length", "length": 16},
        {"type": "abort", "message": "..."}.
    output_token_logprobs: per new token, (logprob, token_id).
    output_top_logprobs: per new token, list of (logprob, token_id).
    input_token_logprobs / input_top_logprobs: prompt logprobs, sent once with the first token.
    """

    rid: str
    new_token_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # Speculative decoding so far: verify steps the request took part in, draft tokens accepted.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # Seconds from arrival in the scheduler to first admission (None before it is admitted).
    queue_time_s: float | None = None
    # An embedding request's pooled vector (`runtime/embedding.py`), sent with its finish.
    embedding: list[float] | None = None


@dataclass
class BatchTokenOut:
    """All request outputs of one scheduler step."""

    outputs: list[ReqOutput]


@dataclass
class GenerateReqInput:
    """One request as the front receives it (text or token ids, not both).

    sampling_params: a dict of `SamplingParams` fields (validated here).
    logprob_start_len: first prompt position to return logprobs for; -1 = none.
    cache_salt: keeps this request's cached prefixes apart from other salts'
        (refused until the radix cache namespaces its keys).
    """

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | SamplingParams | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that the front needs."""

    checkpoint: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    context_length: int
    max_total_tokens: int
    max_running_requests: int
    eos_token_ids: tuple[int, ...]
    # How the weights are served, resolved (`quantization=None` on a quantized GGUF file
    # is "gguf", elsewhere "none"): /get_server_info reports this, not the raw argument.
    quantization: str = "none"


def finish_reason_to_matched_stop(finish_reason: dict[str, Any] | None) -> Any:
    """`matched_stop` of SGLang's meta info: the stop token id or string, else None."""
    if finish_reason and finish_reason.get("type") == "stop":
        return finish_reason.get("matched")
    return None
