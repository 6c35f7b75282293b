"""SGLang `/generate` fields arborlm does not implement, accepted at their neutral value.

SGLang's `GenerateReqInput` has many more fields than arborlm serves (multimodal data,
LoRA, hidden states, disaggregation bootstrap, ...). Clients and gateways built for SGLang
send some of them on every request with their default value: `sglang-router` re-encodes
each `/generate` body with `model: null`, `log_metrics: true`, `return_hidden_states:
false`, `background: false`, `no_logs: false`, `return_bytes: false`, `return_entropy:
false`. Such a request asks for nothing arborlm lacks, so it is served; a field set to
anything else asks for a feature arborlm does not have, and is refused with a 400 naming
it, instead of being silently dropped. Field names and defaults follow SGLang's
`python/sglang/srt/managers/io_struct.py` (GenerateReqInput).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def _absent(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is None or value is False


def _zero(value: Any) -> bool:
    return value is None or (type(value) is int and value == 0)


def _informational(value: Any) -> bool:
    """Logging, tracing and routing hints: they never change what is generated."""
    return True


# name -> predicate: True when the value asks for nothing arborlm does not do.
NEUTRAL_FIELDS: Mapping[str, Callable[[Any], bool]] = {
    # Names the model; /generate serves the one loaded model whatever it says (as SGLang does).
    "model": lambda v: v is None or isinstance(v, str),
    # Informational: logging, tracing, session and routing labels.
    "log_metrics": lambda v: v is None or isinstance(v, bool),
    "no_logs": lambda v: v is None or isinstance(v, bool),
    "session_id": _informational,
    "conversation_id": _informational,
    "routing_key": _informational,
    "custom_labels": _informational,
    "external_trace_header": _informational,
    "received_time": _informational,
    "kv_router_hint": _informational,
    # Features arborlm does not have: only their "off" value.
    "return_hidden_states": _false,
    "return_routed_experts": _false,
    "routed_experts_start_len": _zero,
    "return_indexer_topk": _false,
    "return_entropy": _false,
    "return_bytes": _false,
    "return_prompt_token_ids": _false,
    "return_sampling_mask": _false,
    "return_flat_raw_top_logprobs": _false,
    "return_flat_raw_top_logprobs_b64": _false,
    "background": _false,
    "require_reasoning": _false,
    "use_audio_in_video": _false,
    "need_wait_for_mm_inputs": _false,
    "max_thinking_tokens": _absent,
    "input_embeds": _absent,
    "image_data": _absent,
    "video_data": _absent,
    "audio_data": _absent,
    "modalities": _absent,
    "mm_hashes": _absent,
    "mm_content_hashes": _absent,
    "video_config": _absent,
    "images_config": _absent,
    "max_dynamic_patch": _absent,
    "min_dynamic_patch": _absent,
    "image_max_dynamic_patch": _absent,
    "video_max_dynamic_patch": _absent,
    "token_ids_logprob": _absent,
    "session_params": _absent,
    "lora_path": _absent,
    "lora_id": _absent,
    "custom_logit_processor": _absent,
    "positional_embed_overrides": _absent,
    "bootstrap_host": _absent,
    "bootstrap_port": _absent,
    "bootstrap_room": _absent,
    "bootstrap_pair_key": _absent,
    "decode_tp_size": _absent,
    "routed_dp_rank": _absent,
    "data_parallel_rank": _absent,
    "disagg_prefill_dp_rank": _absent,
    "priority": _absent,
    "extra_key": _absent,
    "num_items_assigned": _absent,
    "encoder_urls": _absent,
    "multi_item_delimiter_indices": _absent,
}


class UnsupportedFieldError(ValueError):
    """A request field arborlm does not serve: unknown, or an SGLang feature set to a
    non-neutral value. `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


def check_extra_fields(extra: Mapping[str, Any] | None) -> None:
    """Refuse the fields of a `/generate` body that arborlm does not model.

    `extra`: the body's fields outside arborlm's own (pydantic's `model_extra`).

    Raises
    ------
    UnsupportedFieldError: for the first field that is not SGLang's or that holds a value
        other than its neutral one.
    """
    for name, value in (extra or {}).items():
        neutral = NEUTRAL_FIELDS.get(name)
        if neutral is None:
            raise UnsupportedFieldError(f"{name}: unknown field", name)
        if not neutral(value):
            raise UnsupportedFieldError(
                f"{name}: not supported by arborlm; leave it out or send SGLang's default value", name)
