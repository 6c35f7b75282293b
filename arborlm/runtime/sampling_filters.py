"""Sampling's filters and draw: which tokens a sampled row may take, and the seeded draw.

Place in the request path: `sampling.Sampler` (a decode step) and the speculative
verifier (`speculative.verify`) draw each sampled row with `SampledRows`: one float64
uniform from the request's own generator (`draw_uniforms`), then the row's logits turned
into probabilities (temperature, softmax), what top-k, top-p and min-p remove zeroed
(`filter_probs`) and the token found by inverse CDF (`draw_from_probs`). On the CPU one
native pass per row does all of it (`kernels.cpu_sampling`); the torch ops here are the
path elsewhere and its oracle in tests. Both work row by row, so a seed's token does not
depend on the other rows of the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from arborlm.kernels import cpu_sampling

if TYPE_CHECKING:  # only for annotations: `sampling` builds on this module
    from arborlm.runtime.sampling import SamplingBatchInfo


def sampling_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, list[int]]:
    """What sampled rows draw from, as a decode step and a verify step both compute it.

    Returns ``softmax(logits / temperature)`` with top-k, top-p and min-p applied
    (`filter_probs`), (B, V) float32, and the sampled rows (`SamplingBatchInfo.sampled_rows`)
    whose probabilities are not finite or sum to 0 (they cannot be drawn from).
    """
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = filter_probs(probs, info)
    rows = info.sampled_rows
    usable = (torch.isfinite(probs[rows]).all(dim=-1) & (probs[rows].sum(dim=-1) > 0)).tolist()
    return probs, [r for r, ok in zip(rows, usable) if not ok]


# Candidates per row that `filter_probs` takes with `topk`, in turn, before it sorts a whole row.
FILTER_CANDIDATES = (256, 4096)


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities removed by top-k, then top-p, then min-p; (B, V) float32.

    Top-p is taken over the top-k survivors renormalised (as Hugging Face and
    vLLM chain the warpers); min-p keeps tokens with ``p >= min_p * max p``. At
    least the most likely token always survives. The result is unnormalised,
    which `sample_from_probs` accepts.

    Each filter keeps a prefix of the row in descending order (ties by token id,
    a stable sort's order). That prefix is nearly always among the row's
    largest probabilities, so the row's `FILTER_CANDIDATES[0]` largest are found with
    `topk` and ordered; a row whose kept prefix reaches the candidates' smallest value
    (a flat distribution, a large top-k) tries the next count, and past the last is
    sorted whole. A stable sort of 8 rows of 49152 tokens took 25-50 ms on a 2-core
    CPU, more than the rest of a step.
    """
    filtered = probs.clone()
    vocab = probs.shape[-1]
    # Rows no filter touches (greedy rows, plain temperature) pass through.
    active = (info.top_ks < vocab) | (info.top_ps < 1.0) | (info.min_ps > 0.0)
    rows = active.nonzero().view(-1)
    if rows.numel() == 0:
        return filtered
    for count in FILTER_CANDIDATES:
        candidates = _filter_candidates(probs[rows], info, rows, count)
        if candidates is None:
            break
        done, redo = candidates
        filtered[rows] = done
        if not redo:
            return filtered
        rows = rows[torch.tensor(redo, device=probs.device)]
    filtered[rows] = _filter_sorted(probs[rows], info, rows)
    return filtered


def _mask_sorted(probs_sort: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor | None = None,
                 total: torch.Tensor | None = None) -> torch.Tensor:
    """The filters on rows already in descending order, (n, k) float32 (``rows``: which of
    ``info``'s rows they are; ``total``: (n, 1) each row's top-k survivors' sum when the
    rows hold only part of the vocabulary)."""
    def of(values: torch.Tensor) -> torch.Tensor:
        return (values if rows is None else values[rows]).view(-1, 1)

    ranks = torch.arange(probs_sort.shape[-1], device=probs_sort.device).view(1, -1)
    if info.need_top_k:
        probs_sort = probs_sort.masked_fill(ranks >= of(info.top_ks), 0.0)
    if info.need_top_p:
        if total is None:
            total = probs_sort.sum(dim=-1, keepdim=True)
        mass_before = torch.cumsum(probs_sort, dim=-1) - probs_sort
        drop = (mass_before > of(info.top_ps) * total) & (ranks > 0)
        probs_sort = probs_sort.masked_fill(drop, 0.0)
    if info.need_min_p:
        threshold = probs_sort[:, :1] * of(info.min_ps)
        probs_sort = probs_sort.masked_fill(probs_sort < threshold, 0.0)
    return probs_sort


def _filter_sorted(probs: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`filter_probs` by a stable sort of each whole row."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    return torch.zeros_like(probs).scatter_(1, probs_idx, _mask_sorted(probs_sort, info, rows))


def _filter_candidates(probs: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor,
                       count: int) -> tuple[torch.Tensor, list[int]] | None:
    """`filter_probs` of ``probs`` (``info``'s ``rows``) over each row's ``count`` (or more, for
    top-k) largest probabilities: (the filtered rows, positions of the rows whose kept tokens
    may reach past their candidates: not filtered), or None when the candidates would be
    most of the vocabulary."""
    n, vocab = probs.shape
    top_ks = info.top_ks[rows]
    limited = top_ks < vocab  # rows whose top-k removes something
    k = count
    if info.need_top_k and bool(limited.any()):
        k = max(k, int(top_ks[limited].max()) + 1)  # + 1: the value after the last kept
    if 2 * k >= vocab:
        return None
    values, index = probs.topk(k, dim=-1)
    # Equal values in token id order, as the stable sort puts them.
    index, perm = index.sort(dim=-1)
    values, perm = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    index = index.gather(1, perm)
    total = None
    if info.need_top_p:
        # The sum top-p scales by: the top-k survivors' (all among the candidates) where top-k
        # limits the row, else the whole row's.
        survivors = values.masked_fill(torch.arange(k, device=probs.device).view(1, -1) >= top_ks.view(-1, 1), 0.0)
        total = torch.where(limited.view(-1, 1), survivors.sum(dim=-1, keepdim=True), probs.sum(dim=-1, keepdim=True))
    kept = _mask_sorted(values, info, rows, total=total)
    # Exact where every kept token is above the candidates' smallest value (or that value is 0:
    # every positive token is a candidate); else tokens outside the candidates could be kept.
    count = (kept > 0).sum(dim=-1).clamp(min=1)
    last_kept = values.gather(1, (count - 1).view(-1, 1)).view(-1)
    smallest = values[:, -1]
    exact = (smallest == 0) | (last_kept > smallest)
    redo = [i for i, ok in enumerate(exact.tolist()) if not ok]
    return torch.zeros_like(probs).scatter_(1, index, kept), redo


# Tokens per block of `draw_from_probs`' two-level inverse CDF.
SAMPLE_BLOCK = 256


def draw_uniforms(generators: list[torch.Generator], device: torch.device | str = "cpu") -> torch.Tensor:
    """(n,) float64: one uniform in [0, 1) from each generator, which advances by one draw."""
    if not generators:
        return torch.empty(0, dtype=torch.float64, device=device)
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=device) for g in generators])


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """`draw_from_probs` with one uniform from each row's generator (`draw_uniforms`): (n,) int64."""
    return draw_from_probs(probs, draw_uniforms(generators, probs.device))


def draw_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn by inverse CDF: (n,) int64.

    Row i returns the first token whose cumulative probability exceeds ``uniforms[i]``
    times the row's total, so token k comes with probability ``probs[i, k] /
    probs[i].sum()`` (to float64 rounding) and a zero-probability token never comes.
    The cumulative sums are taken in two levels, over blocks of `SAMPLE_BLOCK` tokens
    and then inside the chosen block, in float64: a row is one read of its
    probabilities. Each row's draw depends on its own row and uniform only, so the
    same seed gives the same token whatever else shares the batch. (`torch.multinomial` draws one
    exponential per token of the vocabulary: 1.2-1.5 ms a row at 49152 tokens on
    a 2-core CPU, against about 0.06 ms here.)

    Parameters
    ----------
    probs: (n, V) float32, unnormalised, every row finite and non-negative with a
        positive sum (`filter_probs`' output).
    uniforms: (n,) float64 in [0, 1), one per row (`draw_uniforms`).
    """
    n, vocab = probs.shape
    u = uniforms.to(device=probs.device, dtype=torch.float64)
    pad = -vocab % SAMPLE_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(n, -1, SAMPLE_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = u * block_cdf[:, -1]
    last_block = block_cdf.shape[1] - 1
    block = torch.searchsorted(block_cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=last_block)
    rows = torch.arange(n, device=probs.device)
    before = torch.where(block > 0, block_cdf[rows, (block - 1).clamp(min=0)], torch.zeros_like(target))
    inside = blocks[rows, block]  # (n, SAMPLE_BLOCK)
    within = torch.searchsorted(inside.to(torch.float64).cumsum(dim=-1), (target - before).unsqueeze(1),
                                right=True).squeeze(1)
    # Rounding between the block sums and the cumulative sum inside a block can put the target
    # past the block's last token: take the block's last token of positive probability then.
    last_positive = SAMPLE_BLOCK - 1 - (inside > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return block * SAMPLE_BLOCK + torch.minimum(within, last_positive)


class SampledRows:
    """The draws of one step's sampled rows from their processed logits (penalties, masks).

    On the CPU, where the native sampler builds, each row is one native pass
    (`cpu_sampling.sample_rows`: about 0.05 ms a row of 49152 tokens against 0.5 ms of
    torch ops, 2 ms when a flat row's top-p sorted it whole); elsewhere (or with
    ``native=False``) `sampling_probs` over the whole batch, once, then `draw_from_probs`.
    The two give the same token for the same uniform except where their rounding differs
    at a boundary of the cumulative probabilities.

    Parameters
    ----------
    logits: (B, V) float32, not modified.
    info: the batch's `SamplingBatchInfo` (row i's temperature, top-k, top-p, min-p).
    native: use the native sampler where it applies.
    """

    def __init__(self, logits: torch.Tensor, info: SamplingBatchInfo, native: bool = True):
        self.logits = logits
        self.info = info
        usable = native and logits.is_cpu and logits.dtype == torch.float32
        self.lib = cpu_sampling.native_library() if usable else None
        if self.lib is not None:
            if logits.stride(-1) != 1:
                self.logits = logits.contiguous()
            # One per logits row, typed and contiguous once: a verify step draws its chain rows
            # one call each.
            self._params = (info.temperatures.reshape(-1).float().contiguous(), info.top_ks.long().contiguous(),
                            info.top_ps.float().contiguous(), info.min_ps.float().contiguous())
        self._probs: tuple[torch.Tensor, set[int]] | None = None

    def draw(self, rows: list[int], uniforms: torch.Tensor) -> list[int]:
        """Row ``rows[i]``'s token for ``uniforms[i]`` ((n,) float64), or -1 where the row's
        probabilities are not finite or sum to 0 (it cannot be drawn from)."""
        if not rows:
            return []
        index = torch.tensor(rows, dtype=torch.int64, device=self.logits.device)
        if self.lib is not None:
            return cpu_sampling.sample_rows(self.lib, self.logits, index, *self._params,
                                            uniforms.to(torch.float64).contiguous()).tolist()
        if self._probs is None:
            probs, unusable = sampling_probs(self.logits, self.info)
            self._probs = probs, set(unusable)
        probs, unusable = self._probs
        good = [i for i, r in enumerate(rows) if r not in unusable]
        tokens = [-1] * len(rows)
        if good:
            drawn = draw_from_probs(probs[index[good]], uniforms[good]).tolist()
            for i, t in zip(good, drawn):
                tokens[i] = t
        return tokens
