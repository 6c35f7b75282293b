"""Run our model step by step on hand-made pools, as a model runner would.

`ModelHarness` owns a ReqToTokenPool, a TokenToKVPoolAllocator and a TokenToKVPool
sized for a few requests, and builds `ForwardBatch`es for extend and decode steps.
"""

from __future__ import annotations

import torch

from arborlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode, LogitsOutput


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class ModelHarness:
    """Pools plus per-request bookkeeping (row, tokens so far) for driving a model."""

    def __init__(self, model, config, num_reqs: int = 8, max_context_len: int = 512,
                 num_slots: int = 4096, dtype: torch.dtype = torch.float32):
        self.model = model
        self.req_to_token_pool = ReqToTokenPool(num_reqs, max_context_len)
        self.allocator = TokenToKVPoolAllocator(num_slots)
        self.token_to_kv_pool = TokenToKVPool(
            num_slots, config.num_hidden_layers, config.num_key_value_heads, head_dim_of(config), dtype
        )
        self.seq_lens: dict[int, int] = {}  # req_pool_idx -> tokens with K/V in the pool

    def new_req(self) -> int:
        (row,) = self.req_to_token_pool.alloc(1)
        self.seq_lens[row] = 0
        return row

    def extend(self, rows: list[int], new_ids: list[list[int]], return_full_logits: bool = False) -> LogitsOutput:
        """One EXTEND step: `new_ids[i]` continue request `rows[i]` after its cached tokens."""
        return self._step(ForwardMode.EXTEND, rows, new_ids, return_full_logits)

    def decode(self, rows: list[int], next_ids: list[int]) -> LogitsOutput:
        """One DECODE step: one token per request."""
        return self._step(ForwardMode.DECODE, rows, [[t] for t in next_ids], False)

    def _step(self, mode, rows, new_ids, return_full_logits) -> LogitsOutput:
        prefix_lens = [self.seq_lens[r] for r in rows]
        extend_lens = [len(ids) for ids in new_ids]
        out_cache_loc = self.allocator.alloc(sum(extend_lens))
        assert out_cache_loc is not None, "test pool too small"
        start = 0
        for row, prefix, n in zip(rows, prefix_lens, extend_lens):
            self.req_to_token_pool.req_to_token[row, prefix:prefix + n] = out_cache_loc[start:start + n].to(torch.int32)
            self.seq_lens[row] = prefix + n
            start += n
        batch = ForwardBatch.build(
            mode, [t for ids in new_ids for t in ids], rows, prefix_lens, extend_lens, out_cache_loc,
            self.req_to_token_pool, self.token_to_kv_pool, return_full_logits=return_full_logits,
        )
        return self.model.forward(batch)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt: one extend of all, then batched decode steps."""
        rows = [self.new_req() for _ in prompts]
        logits = self.extend(rows, prompts).next_token_logits
        outputs = [[t] for t in logits.argmax(-1).tolist()]
        for _ in range(max_new_tokens - 1):
            logits = self.decode(rows, [out[-1] for out in outputs]).next_token_logits
            for out, t in zip(outputs, logits.argmax(-1).tolist()):
                out.append(t)
        return outputs


def count_fused_layer_calls(monkeypatch) -> list[int]:
    """Decoder layers run through the fused native call from now on (one entry per call of
    `fused_decoder_layer.run_layer`, the stack's layer count per `run_layers`); the list
    returned fills as they run."""
    from arborlm.kernels import fused_decoder_layer as fused

    calls: list[int] = []
    one, many = fused.run_layer, fused.run_layers
    monkeypatch.setattr(fused, "run_layer", lambda *a: calls.append(1) or one(*a))
    monkeypatch.setattr(fused, "run_layers", lambda lib, stack, *a: calls.append(len(stack.layers)) or many(lib, stack, *a))
    return calls
