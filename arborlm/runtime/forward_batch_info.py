"""Batches on their way to the model.

`ForwardBatch` is the tensor view the model runs on: flattened new tokens of a
ragged batch plus where their K/V go (`out_cache_loc`) and where each request's
earlier K/V live (`req_to_token[req_pool_idx, :prefix_len]`).
CPU bookkeeping (`Req`, `ScheduleBatch`) lives in `schedule_batch.py` and
builds a `ForwardBatch` for each step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from arborlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPool


class ForwardMode(enum.Enum):
    """What a forward step computes.

    TARGET_VERIFY (SGLang's name for the speculative verify step) is laid out as
    decode rows here: one row per token of each request's verify chain ``[last
    token, *draft]``, the request's ``req_pool_index`` repeated, row j at position
    ``kv_len + j`` with ``seq_len = kv_len + j + 1`` (`speculative.verify_batch`).
    Every row is then what a DECODE step computes for that token, once the K/V of
    all rows are stored, so `is_decode` is true for it: attention backends, the
    fused decoder layer and the logits take it as a decode step (logits at every
    row). SGLang's TARGET_VERIFY is extend-shaped with a tree mask instead.
    """

    EXTEND = enum.auto()  # new prompt tokens after a (possibly empty) cached prefix
    DECODE = enum.auto()  # one new token per request
    TARGET_VERIFY = enum.auto()  # speculative verify chains as decode rows (see above)

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        """DECODE, or TARGET_VERIFY (decode-shaped rows)."""
        return self is ForwardMode.DECODE or self is ForwardMode.TARGET_VERIFY

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY


@dataclass
class ForwardBatch:
    """Tensors of one model step over a ragged batch of `batch_size` requests.

    `num_tokens` below is the total of new tokens: `sum(extend_seq_lens)` for
    EXTEND, `batch_size` for DECODE. All index tensors are int64 on the model's
    device; `*_cpu` lists mirror them for host-side loops and shapes.

    Attributes
    ----------
    forward_mode: EXTEND, DECODE or TARGET_VERIFY (decode rows: `batch_size` is then
        the number of rows, several per request).
    batch_size: number of requests (rows for TARGET_VERIFY).
    input_ids: (num_tokens,) int64, the new tokens, request after request.
    positions: (num_tokens,) int64, absolute position of each new token.
    req_pool_indices: (batch_size,) int64, row of each request in `req_to_token`.
    seq_lens: (batch_size,) int64, tokens of each request after this step
        (prefix + new); `req_to_token[row, :seq_len]` are valid once the new
        K/V are written.
    out_cache_loc: (num_tokens,) int64, KV slot each new token's K/V is written to
        (already stored in `req_to_token` at the new positions).
    extend_prefix_lens: (batch_size,) int64, cached tokens before the new ones
        (EXTEND only; for DECODE it is `seq_lens - 1`).
    extend_seq_lens: (batch_size,) int64, new tokens per request (EXTEND only;
        ones for DECODE).
    req_to_token_pool, token_to_kv_pool: the memory the step reads and writes.
    return_full_logits: compute logits at every new token (prompt logprobs,
        agreement tests), not only at each request's last one.
    attn_metadata: what the attention backend precomputes once per step
        (`AttentionBackend.init_forward_metadata`), read by every layer; None
        until the model sets it.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    return_full_logits: bool = False
    attn_metadata: object | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        forward_mode: ForwardMode,
        input_ids: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: TokenToKVPool,
        return_full_logits: bool = False,
    ) -> ForwardBatch:
        """Assemble the tensors from per-request lists.

        `input_ids` holds the new tokens of all requests concatenated
        (`sum(extend_lens)` of them); `out_cache_loc` their KV slots.
        The caller has already written `out_cache_loc` into `req_to_token`.
        """
        device = token_to_kv_pool.device
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        if forward_mode.is_decode():
            positions = torch.tensor(prefix_lens, dtype=torch.int64)
        else:
            positions = torch.cat(
                [torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens)]
            )

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            forward_mode=forward_mode,
            batch_size=len(req_pool_indices),
            input_ids=as_tensor(input_ids),
            positions=positions.to(device),
            req_pool_indices=as_tensor(req_pool_indices),
            seq_lens=as_tensor(seq_lens),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            extend_prefix_lens=as_tensor(prefix_lens),
            extend_seq_lens=as_tensor(extend_lens),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            return_full_logits=return_full_logits,
        )


@dataclass
class LogitsOutput:
    """What the model returns for one step.

    next_token_logits: (batch_size, vocab_size) float32, at each request's last new token.
    full_logits: (num_tokens, vocab_size) float32 when `return_full_logits`, else None.
    """

    next_token_logits: torch.Tensor
    full_logits: torch.Tensor | None = None
