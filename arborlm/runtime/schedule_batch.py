"""CPU bookkeeping of requests and of the batch the scheduler runs next.

A `Req` owns one row of `req_to_token` while it is admitted. Positions
`[0, len(prefix_indices))` of that row point at slots of the radix cache (locked
through `last_node`); positions `[len(prefix_indices), kv_len)` at slots the
request allocated itself. `ScheduleBatch` turns a list of requests into the
`ForwardBatch` of one extend or decode step, allocating the slots it writes.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode
from arborlm.sampling_params import SamplingParams


@dataclass(eq=False)  # identity semantics: requests are compared and looked up by object
class Req:
    """One generation request inside the scheduler.

    origin_input_ids: prompt tokens.
    output_ids: generated tokens so far (kept across retraction).
    kv_len: tokens of `fill_ids` whose K/V are in this request's row.
    prefix_indices: (n,) int64 slots matched in the radix cache at admission.
    cached_tokens: prompt tokens served from the cache (first admission only).
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # Namespace of this request's radix-cache paths (a tenant's salt); None: shared.
    cache_salt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    kv_len: int = 0
    extend_input_len: int = 0
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    to_abort: bool = False
    num_retractions: int = 0
    created_time: float = field(default_factory=time.monotonic)
    admitted_time: float = 0.0
    input_logprobs_sent: bool = False
    generator: torch.Generator | None = None
    # GrammarMatcher of a constrained request, positioned after output_ids (None: unconstrained).
    grammar: Any = None
    # Prompt logprob bookkeeping when return_logprob with logprob_start_len >= 0.
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # Speculative decoding: drafting state (`speculative.scheduling.SpecReqState`), verify
    # steps this request took part in, and draft tokens of it the target accepted.
    spec_state: Any = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # `origin_input_ids` as an int32 array, built on first use (`prompt_id_array`).
    _prompt_array: array | None = field(default=None, repr=False)

    def prompt_id_array(self) -> array | list[int]:
        """The prompt as an int32 `array`, built once: the native repetition penalty copies it
        each step (a memcpy) where flattening a Python list took ~15 ns an id (4000-token
        prompts at 32 requests: ~2 ms a step). The list itself where an id does not fit int32."""
        if self._prompt_array is None:
            try:
                self._prompt_array = array("i", self.origin_input_ids)
            except OverflowError:
                return self.origin_input_ids
        return self._prompt_array

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose K/V the request needs before its next token: prompt + output."""
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling_params.max_new_tokens - len(self.output_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def prefix_match_key(self) -> list[int]:
        """The tokens whose cached KV the request may reuse at admission.

        Never the last fill token (its logits give the next token), and not past
        the first prompt position whose logprob was asked for.
        """
        max_prefix = self.seqlen - 1
        if self.wants_prompt_logprobs():
            max_prefix = min(max_prefix, max(self.logprob_start_len - 1, 0))
        return self.fill_ids[:max_prefix]

    def takes_next_token(self, is_extend: bool) -> bool:
        """Whether this request samples a token in this step (decided before the step runs).

        Not a chunked prompt with tokens left after this chunk, nor a request that
        asked for no new token (it finishes once prefilled).
        """
        if self.sampling_params.max_new_tokens == 0:
            return False
        return not is_extend or self.kv_len + self.extend_input_len >= len(self.fill_ids)

    def wants_prompt_logprobs(self) -> bool:
        return (
            self.return_logprob
            and 0 <= self.logprob_start_len < len(self.origin_input_ids)
            and not self.input_logprobs_sent
        )

    def reset_for_retraction(self) -> None:
        """Forget KV bookkeeping; the request goes back to the waiting queue."""
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.kv_len = 0
        self.extend_input_len = 0
        self.num_retractions += 1
        if not self.input_logprobs_sent:
            # Re-admission recomputes every asked-for prompt position (`prefix_match_key`
            # stops before them), so a retracted chunked prompt scores them again.
            self.input_token_logprobs.clear()
            self.input_top_logprobs.clear()


@dataclass
class ScheduleBatch:
    """Requests of one step and the chunk of new tokens each runs.

    forward_mode: EXTEND (each req runs `fill_ids[kv_len : kv_len + extend_input_len]`)
    or DECODE (each req runs its last output token).
    sample_rows: indices into `reqs` of the requests that take a next token in
        this step; set by `Scheduler.run_batch` before the step runs.
    """

    reqs: list[Req]
    forward_mode: ForwardMode
    sample_rows: list[int] = field(default_factory=list)
    # A speculative decode step: each request's draft tokens, verified after its last token
    # (`speculative.scheduling`); None for a plain step.
    draft_tokens: list[list[int]] | None = None

    def is_empty(self) -> bool:
        return not self.reqs

    def prepare_extend(self, req_to_token_pool, token_to_kv_pool, out_cache_loc: torch.Tensor) -> ForwardBatch:
        """Write `out_cache_loc` into each row and build the extend `ForwardBatch`.

        `out_cache_loc`: (sum of extend_input_len,) int64 slots, freshly allocated.
        """
        input_ids: list[int] = []
        prefix_lens, extend_lens = [], []
        offset = 0
        for req in self.reqs:
            start, n = req.kv_len, req.extend_input_len
            input_ids.extend(req.fill_ids[start : start + n])
            req_to_token_pool.req_to_token[req.req_pool_idx, start : start + n] = out_cache_loc[
                offset : offset + n
            ].to(torch.int32)
            offset += n
            prefix_lens.append(start)
            extend_lens.append(n)
        return ForwardBatch.build(
            ForwardMode.EXTEND,
            input_ids,
            [r.req_pool_idx for r in self.reqs],
            prefix_lens,
            extend_lens,
            out_cache_loc,
            req_to_token_pool,
            token_to_kv_pool,
            return_full_logits=any(r.wants_prompt_logprobs() for r in self.reqs),
        )

    def prepare_decode(self, req_to_token_pool, token_to_kv_pool, out_cache_loc: torch.Tensor) -> ForwardBatch:
        """Write each request's new slot at position `kv_len` and build the decode `ForwardBatch`."""
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        positions = torch.tensor([r.kv_len for r in self.reqs], dtype=torch.int64)
        req_to_token_pool.req_to_token[rows, positions] = out_cache_loc.to(torch.int32)
        return ForwardBatch.build(
            ForwardMode.DECODE,
            [r.output_ids[-1] for r in self.reqs],
            rows.tolist(),
            positions.tolist(),
            [1] * len(self.reqs),
            out_cache_loc,
            req_to_token_pool,
            token_to_kv_pool,
        )
