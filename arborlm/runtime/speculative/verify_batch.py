"""How a speculative verify step runs: as decode rows (TARGET_VERIFY) or as extend chains.

The scheduler builds the verify step as chains (`scheduling.build_verify_batch`):
an EXTEND `ForwardBatch` in which request i runs ``[last token, *draft_i]`` at
positions ``kv_len_i .. kv_len_i + k_i`` over its paged KV, logits at every
position. A chain needs only the causal mask, so any extend kernel verifies it.

An attention backend whose decode path stores every row's new K/V first and then
attends each row on its own over ``req_to_token[req_pool_indices[row],
:seq_lens[row]]`` takes the same chain as ``1 + k_i`` decode rows instead: the
request's ``req_pool_index`` repeated, row j at position ``kv_len_i + j`` with
``seq_len = kv_len_i + j + 1`` and its K/V slot the chain's j-th (already in
``req_to_token``). Row j then attends to exactly the keys the j-th token sees
in the chain, and computes what a decode step after ``draft_i[:j]`` would: the
same kernels in the same summation order, and the fused decoder layer where the
rows fit. So in bfloat16 the verify logits are those of sequential decode steps
(greedy output token-identical to speculation off, not just within rounding),
and the step is a decode step's cost rather than the extend path's.

`uses_verify_rows` is the choice, made once per model by the model worker;
`verify_rows` turns the chain batch into TARGET_VERIFY rows. The chain (extend)
layout stays the fallback for backends that do not take rows, and the oracle
the tests compare the rows with.
"""

from __future__ import annotations

import torch

from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode
from arborlm.runtime.layers.attention.base import AttentionBackend


def uses_verify_rows(model: torch.nn.Module) -> bool:
    """Whether verify steps of ``model`` run as decode rows (TARGET_VERIFY), else as extend chains.

    True when the model attends through at least one attention backend and every
    one of them says its decode path takes verify rows
    (`AttentionBackend.takes_verify_rows`: the torch backend, native kernels or
    not, the reference one, the quantized-KV one with the native kernels). False for
    the Triton backend and the quantized-KV one without native kernels (see their
    reasons there) and for a model without paged attention. No
    model here keeps per-request state outside the KV pool (every layer but
    attention works token by token), so the backends decide alone.
    """
    backends = {id(b): b for b in (getattr(m, "backend", None) for m in model.modules())
                if isinstance(b, AttentionBackend)}
    return bool(backends) and all(b.takes_verify_rows for b in backends.values())


def verify_rows(chains: ForwardBatch) -> ForwardBatch:
    """The verify step ``chains`` (EXTEND, one chain per request) as TARGET_VERIFY decode rows.

    Parameters
    ----------
    chains: the step from `scheduling.build_verify_batch`: request b's
        ``extend_seq_lens[b]`` tokens at positions ``extend_prefix_lens[b] ..
        seq_lens[b] - 1``, their slots in ``out_cache_loc`` and in
        ``req_to_token``.

    Returns
    -------
    ForwardBatch
        TARGET_VERIFY with one row per chain token, in the chains' order (so
        row r's logits are the chains' row r): ``input_ids``, ``positions`` and
        ``out_cache_loc`` as in ``chains``; ``req_pool_indices`` each request's
        repeated over its tokens; ``seq_lens = positions + 1``; per row
        ``extend_prefix_lens = seq_lens - 1`` and ``extend_seq_lens = 1`` (as a
        DECODE batch has them); logits at every row (``return_full_logits``).

    Raises
    ------
    ValueError
        When ``chains`` is not an EXTEND batch.
    """
    if not chains.forward_mode.is_extend():
        raise ValueError(f"chains: an EXTEND verify batch is needed, got {chains.forward_mode.name}")
    counts = chains.extend_seq_lens
    num_rows = chains.num_tokens
    seq_lens_cpu = [p + j + 1 for p, n in zip(chains.extend_prefix_lens_cpu, chains.extend_seq_lens_cpu)
                    for j in range(n)]
    seq_lens = chains.positions + 1
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=num_rows,
        input_ids=chains.input_ids,
        positions=chains.positions,
        req_pool_indices=torch.repeat_interleave(chains.req_pool_indices, counts, output_size=num_rows),
        seq_lens=seq_lens,
        out_cache_loc=chains.out_cache_loc,
        extend_prefix_lens=seq_lens - 1,
        extend_seq_lens=torch.ones_like(seq_lens),
        seq_lens_cpu=seq_lens_cpu,
        extend_prefix_lens_cpu=[n - 1 for n in seq_lens_cpu],
        extend_seq_lens_cpu=[1] * num_rows,
        req_to_token_pool=chains.req_to_token_pool,
        token_to_kv_pool=chains.token_to_kv_pool,
        return_full_logits=True,
    )


def draft_rows(extend_seq_lens: list[int], drafts: list[list[int]]) -> list[int] | None:
    """The rows of a verify step's logits that score its drafts, or None when that is all of them.

    Request i's chain has ``extend_seq_lens[i]`` rows: the tokens it had without KV
    (its last token and, after a jump forward, the tokens its grammar forced, which
    need no verification), then its draft. `speculative.verify` takes the chain's
    last ``1 + len(drafts[i])`` rows (the last token before the draft, then each
    draft token); the others only store K/V.
    """
    if all(n == 1 + len(d) for n, d in zip(extend_seq_lens, drafts)):
        return None
    rows, offset = [], 0
    for n, draft in zip(extend_seq_lens, drafts):
        rows.extend(range(offset + n - 1 - len(draft), offset + n))
        offset += n
    return rows
