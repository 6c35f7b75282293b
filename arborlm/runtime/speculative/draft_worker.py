"""The draft model of STANDALONE speculation: its own KV pool, kept in step with each request.

Place in the request path: the model worker owns a `DraftWorker` beside the
target model when ``speculative_algorithm="STANDALONE"``. On every extend step
the target runs (prefill, a prompt chunk, jump-forward), the draft runs the same
requests over the same tokens (`prefill`), so its prompt KV is ready when the
request starts decoding. On a decode step the scheduler's `DraftModelSpeculator`
asks for drafts (`propose`): one batched draft extend catches every request up
on the tokens it has not seen (the last verify step's accepted and bonus
tokens, or forced ones) and yields the first draft token, then
``speculative_num_steps - 1`` batched draft decode steps yield the rest.

KV layout: a per-request slot map (no radix cache). Each request holds one row
of the draft's `ReqToTokenPool`; `DraftReqState.tokens` lists the token at each
position of that row whose K/V the draft holds. Syncing a request to its
current tokens keeps the longest common prefix of the two and frees the rest
(`truncate`): after verification that drops exactly the rejected draft tokens
(`trim`, called at once); a request that finished, was aborted or retracted
gives its row and slots back (`release`, `release_dead`).

Draft tokens are the draft's greedy argmax under the request's grammar mask
(its matcher advanced along the draft, then rolled back). The distribution q
is not kept: rejection sampling treats each draft token as a point mass
(`verify.rejection_sample`), which still preserves the target's distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from arborlm.constrained.base import allocate_vocab_mask, apply_vocab_mask
from arborlm.errors import ModelLoadError
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode
from arborlm.runtime.model_runner import ModelRunner
from arborlm.runtime.schedule_batch import Req

logger = logging.getLogger(__name__)


@dataclass
class DraftReqState:
    """The draft's KV of one request: its row and the token at each position of it.

    The first ``num_confirmed`` tokens are the request's own (prompt and output);
    those after them are draft tokens run by a draft decode step, not yet verified.
    """

    req: Req
    row: int
    tokens: list[int] = field(default_factory=list)
    num_confirmed: int = 0

    def matched_len(self, fill_ids: Sequence[int]) -> int:
        """Positions whose K/V hold the request's tokens ``fill_ids`` (a request's tokens only
        grow, so only the unconfirmed tail needs comparing)."""
        n = min(self.num_confirmed, len(fill_ids))
        return n + common_prefix_len(self.tokens[n:], fill_ids[n:])


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftWorker:
    """Runs the draft model over its own pools and proposes greedy drafts (see the module docstring).

    Parameters
    ----------
    runner: the draft model and its pools (a `ModelRunner` of the draft checkpoint).
    vocab_size: the target's vocabulary; draft logits are cut (or padded with -inf)
        to this width, so no draft token falls outside it.
    max_batch_size: prefill nothing for steps of this many requests or more
        (``speculative_disable_by_batch_size``: such batches never draft); 0: no limit.
    """

    def __init__(self, runner: ModelRunner, vocab_size: int, max_batch_size: int = 0):
        self.runner = runner
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.allocator = runner.token_to_kv_pool_allocator
        self.states: dict[int, DraftReqState] = {}  # id(req) -> its state
        self.num_forward_steps = 0  # draft extend and decode steps run

    # ---- memory ---------------------------------------------------------------

    def _state(self, req: Req) -> DraftReqState | None:
        """The request's state, a fresh row when it has none; None when no row is free."""
        state = self.states.get(id(req))
        if state is None:
            rows = self.req_to_token_pool.alloc(1)
            if rows is None:
                return None
            state = self.states[id(req)] = DraftReqState(req, rows[0])
        return state

    def truncate(self, state: DraftReqState, keep: int) -> None:
        """Free the slots at positions ``keep..`` of the request's draft row."""
        if keep < len(state.tokens):
            slots = self.req_to_token_pool.req_to_token[state.row, keep : len(state.tokens)]
            self.allocator.free(slots.to(torch.int64))
            del state.tokens[keep:]
        state.num_confirmed = min(state.num_confirmed, keep)

    def trim(self, req: Req) -> None:
        """Keep only the draft KV that matches the request's tokens (frees rejected drafts at once)."""
        state = self.states.get(id(req))
        if state is not None:
            self.truncate(state, state.matched_len(req.fill_ids))

    def release(self, req: Req) -> None:
        """Give the request's draft row and slots back (a no-op when it holds none)."""
        state = self.states.pop(id(req), None)
        if state is not None:
            self.truncate(state, 0)
            self.req_to_token_pool.free(state.row)

    def release_dead(self, keep: Sequence[Req] = ()) -> None:
        """Release every request that finished, was aborted or retracted (it holds no target row),
        except those in ``keep``."""
        kept = set(map(id, keep))
        for state in list(self.states.values()):
            req = state.req
            if id(req) not in kept and (req.finished or req.req_pool_idx is None):
                self.release(req)

    def _make_room(self, num_tokens: int, keep: Sequence[Req]) -> bool:
        """Free draft KV of requests outside ``keep`` until ``num_tokens`` slots are free."""
        self.release_dead(keep)
        kept = set(map(id, keep))
        for state in list(self.states.values()):
            if self.allocator.available_size() >= num_tokens:
                break
            if id(state.req) not in kept:
                self.release(state.req)
        return self.allocator.available_size() >= num_tokens

    # ---- forward steps --------------------------------------------------------

    def prefill(self, reqs: Sequence[Req], seq_lens: Sequence[int]) -> None:
        """Bring each request's draft KV to ``fill_ids[:seq_lens[i]]`` (the target's extend step).

        A failure is logged and drops those requests' draft KV (they draft after
        catching up later); it never fails the target's step.
        """
        if self.max_batch_size and len(reqs) >= self.max_batch_size:
            return
        try:
            self._extend(list(reqs), list(seq_lens), need_logits=False)
        except Exception:  # noqa: BLE001 - the draft is an optimisation; the target step goes on
            logger.exception("draft model prefill failed; dropping its KV of %d request(s)", len(reqs))
            for req in reqs:
                self.release(req)

    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> list[list[int]]:
        """Greedy drafts of at most ``max_lens[i]`` tokens after each request's tokens.

        Parameters
        ----------
        reqs: the decode step's requests.
        max_lens: per request, the longest draft it may take (0: none).

        Returns
        -------
        list[list[int]]
            One draft per request (empty when it drafts nothing, or the draft pool
            had no room for it). Grammar matchers are left where they were.

        Raises whatever the draft model raises; the slots of the failing step are freed.
        """
        drafts: list[list[int]] = [[] for _ in reqs]
        wanted = [i for i, n in enumerate(max_lens) if n > 0]
        if not wanted:
            return drafts
        ran, logits = self._extend([reqs[i] for i in wanted], [reqs[i].seqlen for i in wanted], need_logits=True)
        active = [wanted[j] for j in ran]
        matched = {i: 0 for i in active if reqs[i].grammar is not None}  # draft tokens each matcher took
        try:
            while active:
                still = []
                for i, token_id in zip(active, self._pick([reqs[i] for i in active], logits)):
                    drafts[i].append(token_id)
                    if self._advance_grammar(reqs[i], token_id, matched, i) and len(drafts[i]) < max_lens[i]:
                        still.append(i)
                active = still
                if active:
                    logits = self._decode([reqs[i] for i in active], [drafts[i][-1] for i in active])
                    if logits is None:
                        break
        finally:
            for i, n in matched.items():
                reqs[i].grammar.rollback(n)
        return drafts

    @staticmethod
    def _advance_grammar(req: Req, token_id: int, matched: dict[int, int], i: int) -> bool:
        """Move a constrained request's matcher over its new draft token; False when the draft
        must end here (the matcher rejects it or has terminated: the scheduler then cuts the
        draft before that token, `scheduling.grammatical_prefix`)."""
        if req.grammar is None:
            return True
        if not req.grammar.accept_token(token_id):
            return False
        matched[i] += 1
        return not req.grammar.is_terminated()

    def _extend(self, reqs: list[Req], seq_lens: list[int], need_logits: bool) -> tuple[list[int], torch.Tensor | None]:
        """One draft extend step bringing each request's KV to ``fill_ids[:seq_lens[i]]``.

        With ``need_logits`` the last token is always run again when already cached
        (its logits give the first draft token). Returns the indices into ``reqs``
        that ran and their last-token logits, (len(ran), vocab_size) float32.
        """
        plan: list[tuple[int, DraftReqState, list[int]]] = []
        for j, (req, n) in enumerate(zip(reqs, seq_lens)):
            state = self._state(req)
            if state is None:
                continue
            tokens = req.fill_ids[:n]
            keep = state.matched_len(tokens)
            if need_logits:
                keep = min(keep, n - 1)
            self.truncate(state, keep)
            if keep < n:
                plan.append((j, state, tokens[keep:]))
        needed = sum(len(new) for _, _, new in plan)
        if plan and not self._make_room(needed, reqs):
            while plan and self.allocator.available_size() < needed:
                _, state, new = plan.pop()
                needed -= len(new)
                self.release(state.req)
        if not plan:
            return [], None
        out_cache_loc = self.allocator.alloc(needed)
        offset = 0
        for _, state, new in plan:
            start = len(state.tokens)
            self.req_to_token_pool.req_to_token[state.row, start : start + len(new)] = (
                out_cache_loc[offset : offset + len(new)].to(torch.int32))
            offset += len(new)
        fb = ForwardBatch.build(
            ForwardMode.EXTEND, [t for _, _, new in plan for t in new], [s.row for _, s, _ in plan],
            [len(s.tokens) for _, s, _ in plan], [len(new) for _, _, new in plan], out_cache_loc,
            self.req_to_token_pool, self.token_to_kv_pool,
        )
        logits = self._forward(fb, out_cache_loc)
        for _, state, new in plan:
            state.tokens.extend(new)
            state.num_confirmed = len(state.tokens)
        return [j for j, _, _ in plan], logits

    def _decode(self, reqs: list[Req], token_ids: list[int]) -> torch.Tensor | None:
        """One draft decode step over each request's last draft token; its logits, or None
        (nothing run) when the draft pool has no slot for every request."""
        if not self._make_room(len(reqs), reqs):
            return None
        states = [self.states[id(r)] for r in reqs]
        out_cache_loc = self.allocator.alloc(len(reqs))
        for state, slot in zip(states, out_cache_loc.tolist()):
            self.req_to_token_pool.req_to_token[state.row, len(state.tokens)] = slot
        fb = ForwardBatch.build(
            ForwardMode.DECODE, token_ids, [s.row for s in states], [len(s.tokens) for s in states],
            [1] * len(states), out_cache_loc, self.req_to_token_pool, self.token_to_kv_pool,
        )
        logits = self._forward(fb, out_cache_loc)
        for state, token_id in zip(states, token_ids):
            state.tokens.append(token_id)
        return logits

    def _forward(self, fb: ForwardBatch, out_cache_loc: torch.Tensor) -> torch.Tensor:
        """Run the draft model; on failure free the step's slots (no state covers them yet)."""
        try:
            logits = self.runner.forward(fb).next_token_logits
        except Exception:
            self.allocator.free(out_cache_loc)
            raise
        self.num_forward_steps += 1
        return self._to_vocab(logits.float())

    def _to_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits at the target's vocabulary width (extra columns cut, missing ones -inf)."""
        width = logits.shape[-1]
        if width >= self.vocab_size:
            return logits[:, : self.vocab_size].clone()
        pad = logits.new_full((logits.shape[0], self.vocab_size - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    @staticmethod
    def _pick(reqs: list[Req], logits: torch.Tensor) -> list[int]:
        """The greedy token of each row, under each constrained request's grammar mask."""
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
        if rows:
            mask = allocate_vocab_mask(len(reqs), logits.shape[-1])
            for i in rows:
                reqs[i].grammar.fill_vocab_mask(mask, i)
            apply_vocab_mask(logits, mask, rows)
        return logits.argmax(dim=-1).tolist()

    # ---- introspection --------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert that every draft slot is free or held by exactly one request's state."""
        self.allocator.check_invariants()
        self.req_to_token_pool.check_invariants()
        held = sum(len(s.tokens) for s in self.states.values())
        assert self.allocator.available_size() + held == self.allocator.size, "draft KV slots leaked"
        rows = self.req_to_token_pool.available_size() + len(self.states)
        assert rows == self.req_to_token_pool.size, "draft request rows leaked"


def make_draft_worker(server_args: ServerArgs, target_vocab_size: int, context_length: int,
                      max_total_tokens: int, tokenizer) -> DraftWorker | None:
    """The `DraftWorker` of ``speculative_algorithm="STANDALONE"``; None for any other algorithm.

    The draft gets the target's dtype, device and attention backend, its own KV
    pool of ``max_total_tokens + context_length`` slots (the target shares
    prefixes through its radix cache, the draft does not) and rows for
    ``max_running_requests``; its quantization is chosen from its own path.

    Raises
    ------
    ModelLoadError
        When the draft checkpoint cannot be loaded (missing, unsupported, unreadable).
    ValueError
        Naming ``speculative_draft_model_path``: its tokenizer's vocabulary differs
        from the target's, or its context is shorter than the target's.
    """
    spec = server_args.speculative
    if spec.speculative_algorithm != "STANDALONE":
        return None
    path = spec.speculative_draft_model_path
    draft_args = server_args.replace(
        model_path=path, quantization=None, max_total_tokens=max_total_tokens + context_length,
        context_length=context_length, speculative_algorithm=None, speculative_draft_model_path=None,
    )
    try:
        runner = ModelRunner(draft_args)
    except ValueError as exc:
        raise ValueError(f"speculative_draft_model_path={path!r}: {exc}") from exc
    except ModelLoadError as exc:
        raise ModelLoadError(f"speculative_draft_model_path={path!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a draft that fails to load must stop start-up typed
        raise ModelLoadError(f"speculative_draft_model_path={path!r} could not be loaded: {exc}") from exc
    check_same_vocab(path, runner.checkpoint, tokenizer)
    return DraftWorker(runner, target_vocab_size, spec.speculative_disable_by_batch_size)


def check_same_vocab(path: str, checkpoint, tokenizer) -> None:
    """Raise ValueError naming speculative_draft_model_path unless the draft's tokenizer maps
    every token string to the same id as the target's ``tokenizer``."""
    from transformers import AutoTokenizer

    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    except Exception as exc:  # noqa: BLE001 - no tokenizer in the draft checkpoint
        raise ModelLoadError(f"speculative_draft_model_path={path!r}: cannot load its tokenizer: {exc}") from exc
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"speculative_draft_model_path={path!r} is invalid: its tokenizer differs from the target model's "
            f"({len(draft_tokenizer)} vs {len(tokenizer)} tokens, or the same size with other ids); "
            "a draft model must share the target's tokenizer"
        )
