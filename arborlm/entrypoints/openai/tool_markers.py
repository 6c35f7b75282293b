"""Tool-call markers that are special tokens, in `tool_choice="auto"`: a stop, then the calls.

Mistral v0.3 opens its calls with the control token `[TOOL_CALLS]`, Llama 3.x its tool
code with `<|python_tag|>`. A grammar never lets a model write a special token as text
(`constrained/vocab.py`: the detokenizer would drop it), so under the `auto` grammar a
model that means to call could not. Here the marker token is a stop token of the free
text instead: the grammar lets a request's own stop ids through wherever it may end, which
free text always may. When a choice stops on a marker, the calls are a second generation
of the same choice: its prompt is the first's prompt and output (the marker included, so
the radix cache serves all of it), its grammar the calls that follow the marker
(`ToolCallFormat.after_marker_tag`), its budget what `max_tokens` leaves. The two read as
one choice: the marker's text joins the text (the call format's parser reads
`[TOOL_CALLS] [...]` as if written), token counts add up, the second's finish is the
choice's. Streamed, the first generation's chunks go out as they come, then the second's.

The markers are found in the tokenizer (`marker_ids`): a format's `marker_texts` that the
tokenizer holds as one special token. A tokenizer whose marker is plain text needs none of
this: the grammar's text trigger catches it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from arborlm.constrained.vocab import special_token_ids
from arborlm.entrypoints.openai.common import OPENAI_RULES
from arborlm.entrypoints.openai.tool_calls import ToolPlan
from arborlm.entrypoints.request_builder import build_batch
from arborlm.entrypoints.streaming import merge_streams
from arborlm.runtime.io_struct import GenerateReqInput

# Usage fields of the first generation that the second does not repeat.
_SUMMED = ("completion_tokens",)
_FIRST = ("prompt_tokens", "cached_tokens")
_LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs")


def marker_ids(plan: ToolPlan | None, tokenizer) -> dict[int, str]:
    """Special token id -> marker text, for the markers of `plan`'s format that `tokenizer`
    holds as one special token; empty unless the plan is ``auto``."""
    if plan is None or plan.choice != "auto" or tokenizer is None:
        return {}
    special = special_token_ids(tokenizer, len(tokenizer))
    found = {}
    for text in plan.format.marker_texts():
        token_id = tokenizer.convert_tokens_to_ids(text)  # the unknown token's id when it is no token
        if token_id in special and tokenizer.convert_ids_to_tokens(token_id) == text:
            found[token_id] = text
    return found


@dataclass(frozen=True)
class MarkerContinuation:
    """How the choices of one ``auto`` call go on after a special-token marker.

    markers: special token id -> its text (`marker_ids`).
    grammar: the structural tag of the calls after a marker.
    """

    markers: Mapping[int, str]
    grammar: dict[str, Any]

    @classmethod
    def of(cls, plan: ToolPlan | None, tokenizer) -> MarkerContinuation | None:
        """The continuation of `plan` with `tokenizer`, or None when no marker is a special token."""
        markers = marker_ids(plan, tokenizer)
        if not markers:
            return None
        fmt = plan.format.after_marker_tag([t.spec for t in plan.tools], plan.parallel)
        return cls(markers, {"type": "structural_tag", "format": fmt})

    def first_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The first generation's sampling dict: the markers added to its stop token ids."""
        stops = list(params.get("stop_token_ids") or [])
        return {**params, "stop_token_ids": stops + [i for i in self.markers if i not in stops]}

    def marker_of(self, meta: dict[str, Any], user_stops: Sequence[int]) -> str | None:
        """The marker text a finished generation stopped on, or None (a user's own stop id stays a stop)."""
        reason = meta.get("finish_reason") or {}
        matched = reason.get("matched")
        if reason.get("type") != "stop" or not isinstance(matched, int) or matched in user_stops:
            return None
        return self.markers.get(matched)


def stream_continued(manager, built: list, reqs: list[GenerateReqInput], cont: MarkerContinuation,
                           user_stops: Sequence[int]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """As `common.stream_all`, each choice going on after a marker (see the module docstring).

    Parameters
    ----------
    manager: the front's `TokenizerManager`.
    built: `build_batch`'s items for `reqs` (sampling dicts from `first_params`).
    reqs: the choices' requests, in order.
    cont: the call's markers and the grammar after them.
    user_stops: the request's own stop token ids (a marker listed there only stops).
    """
    return merge_streams([_choice(manager, b, r, cont, user_stops) for b, r in zip(built, reqs, strict=True)])


async def run_continued(manager, built: list, reqs: list[GenerateReqInput], cont: MarkerContinuation,
                        user_stops: Sequence[int]) -> list[dict[str, Any]]:
    """As `common.run_all`, each choice going on after a marker."""
    results: list[dict[str, Any]] = [{} for _ in built]
    async for index, result in stream_continued(manager, built, reqs, cont, user_stops):
        results[index] = result
    return results


async def _choice(manager, item, req: GenerateReqInput, cont: MarkerContinuation,
                  user_stops: Sequence[int]) -> AsyncIterator[dict[str, Any]]:
    """One choice's results: the first generation's, then, after a marker, the calls'."""
    if isinstance(item, dict):  # refused when built: its final result already
        yield item
        return
    first, output_ids = None, []
    async for result in manager.generate(item):
        output_ids = output_ids + result["output_ids"] if req.stream else list(result["output_ids"])
        marker = cont.marker_of(result["meta_info"], user_stops)
        if marker is None:
            yield result
            continue
        # The whole first generation, its text with the marker's (the detokenizer skipped it).
        first = {"text": result["text"] + marker, "output_ids": output_ids, "meta_info": result["meta_info"]}
        if req.stream:  # its last chunk goes out unfinished: the choice goes on
            meta = {**result["meta_info"], "finish_reason": None, "matched_stop": None}
            yield {**result, "text": result["text"] + marker, "meta_info": meta}
    if first is None:
        return
    second = _second_request(req, cont, output_ids, first["meta_info"])
    if second is None:  # the marker was the last token max_tokens allowed
        yield _cut(first, req.stream)
        return
    (built,) = await build_batch(manager, [second], OPENAI_RULES)
    results = [built] if isinstance(built, dict) else manager.generate(built)
    async for result in _as_async(results):
        yield _joined(first, result, req.stream)


def _second_request(req: GenerateReqInput, cont: MarkerContinuation, output_ids: list[int],
                    meta: dict[str, Any]) -> GenerateReqInput | None:
    """The calls' generation: the first's prompt and output, the calls' grammar, the rest of the budget."""
    params = dict(req.sampling_params or {})
    left = int(params.get("max_new_tokens", 0)) - int(meta.get("completion_tokens", len(output_ids)))
    if left <= 0:
        return None
    stops = [i for i in params.get("stop_token_ids") or [] if i not in cont.markers]
    params.update(max_new_tokens=left, structural_tag=cont.grammar, stop_token_ids=stops or None)
    params.pop("min_new_tokens", None)
    params.pop("reasoning", None)  # any reasoning came before the marker
    if params["stop_token_ids"] is None:
        del params["stop_token_ids"]
    return GenerateReqInput(
        input_ids=list(req.input_ids or []) + output_ids, sampling_params=params, return_logprob=req.return_logprob,
        top_logprobs_num=req.top_logprobs_num, stream=req.stream,
        rid=None if req.rid is None else f"{req.rid}-calls", cache_salt=req.cache_salt,
    )


def _joined(first: dict[str, Any], second: dict[str, Any], stream: bool) -> dict[str, Any]:
    """A result of the calls' generation as one of the choice: the first's prompt counts, the
    completion tokens summed; not streamed, the texts, ids and logprobs joined too."""
    meta = dict(second["meta_info"])
    head = first["meta_info"]
    for key in _FIRST:
        if key in head:
            meta[key] = head[key]
    for key in _SUMMED:
        meta[key] = int(head.get(key, 0)) + int(meta.get(key, 0))
    if stream:
        return {**second, "meta_info": meta}
    for key in _LOGPROB_LISTS:
        if key in head or key in meta:
            meta[key] = list(head.get(key, [])) + list(meta.get(key, []))
    return {"text": first["text"] + second["text"], "output_ids": first["output_ids"] + second["output_ids"],
            "meta_info": meta}


def _cut(first: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The choice when no token is left after the marker: finished by `length`."""
    meta = {**first["meta_info"], "finish_reason": {"type": "length", "length": first["meta_info"].get(
        "completion_tokens")}, "matched_stop": None}
    return {**first, "text": "" if stream else first["text"], "output_ids": [] if stream else first["output_ids"],
            "meta_info": meta}


async def _as_async(results) -> AsyncIterator[dict[str, Any]]:
    if isinstance(results, list):
        for result in results:
            yield result
    else:
        async for result in results:
            yield result
