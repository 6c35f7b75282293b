"""Sampling: a batch's parameters as tensors, and the sampler (`SamplingParams` lives in
`sampling_params`).

Place in the request path: the TokenizerManager builds and verifies a
`SamplingParams` per request (it crosses zmq, so it stays a plain picklable
dataclass); the scheduler turns the running batch's params into a
`SamplingBatchInfo` and, after each forward step, calls `Sampler` on the
logits (grammar vocab mask already applied) to pick the next token per request.

The processing order follows vLLM and SGLang (``sglang/srt/layers/sampler.py``,
``vllm/v1/sample/sampler.py``):

1. penalties: repetition (Hugging Face style: divide positive logits, multiply
   negative ones, over prompt + output tokens), then frequency and presence
   (OpenAI style: subtract, over output tokens only), then ``logit_bias``
   (OpenAI style: added to the logits);
2. min_new_tokens: EOS and stop token ids are masked to ``-inf`` until the
   request has generated that many tokens;
3. greedy rows (temperature 0) take the argmax; the other rows are divided by
   their temperature, filtered by top-k, top-p and min-p, and sampled with the
   request's own ``torch.Generator``, so a seed gives the same tokens whatever
   else shares the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from arborlm.kernels import cpu_sampling
from arborlm.runtime.sampling_filters import SampledRows, draw_uniforms
from arborlm.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (reduced into torch's 64-bit range)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (2**63))
    return generator


@dataclass
class SamplingBatchInfo:
    """The sampling parameters of a batch as tensors, one row per request.

    Shapes: ``temperatures`` (B, 1) float32 (1.0 on greedy rows, so dividing is
    safe); ``top_ps``, ``min_ps``, the three penalties (B,) float32; ``top_ks``
    (B,) int64 with -1 replaced by ``vocab_size``; ``min_new_tokens`` (B,)
    int64; ``is_greedy`` (B,) bool; ``sampled_rows`` the non-greedy row indices
    as a host list (so sampling on a GPU needs no device-to-host copy to find
    them). The ``need_*`` flags let the sampler skip whole stages when no request
    in the batch uses them.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    repetition_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    min_new_tokens: torch.Tensor
    is_greedy: torch.Tensor
    generators: list[torch.Generator]
    stop_token_ids_list: list[list[int]]
    vocab_size: int
    sampled_rows: list[int] = field(default_factory=list)
    all_greedy: bool = False
    need_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False
    need_repetition_penalty: bool = False
    need_frequency_presence_penalty: bool = False
    need_min_new_tokens: bool = False
    need_logit_bias: bool = False
    params_list: list[SamplingParams] = field(default_factory=list, repr=False)

    @classmethod
    def from_params(
        cls,
        params_list: list[SamplingParams],
        seeds: list[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        generators: list[torch.Generator] | None = None,
    ) -> SamplingBatchInfo:
        """Stack verified params into tensors on ``device``.

        Parameters
        ----------
        params_list:
            One verified `SamplingParams` per request, in batch order.
        seeds:
            One seed per request (the scheduler draws one for requests without
            ``seed``); each row gets ``make_generator(seed, device)``.
        generators:
            Optional generators to use instead of fresh ones from ``seeds``. A
            request keeps its generator across decode steps (build it once with
            `make_generator` and pass it every step) so its random stream
            continues instead of restarting.
        """
        assert len(params_list) == len(seeds), "one seed per request"

        def floats(name: str) -> torch.Tensor:
            values = [float(getattr(p, name)) for p in params_list]
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [p.is_greedy for p in params_list]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params_list, greedy)]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params_list]
        if generators is None:
            generators = [make_generator(s, device) for s in seeds]
        sampled = [p for p, g in zip(params_list, greedy) if not g]
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).view(-1, 1),
            top_ps=floats("top_p"),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=floats("min_p"),
            repetition_penalties=floats("repetition_penalty").clamp_(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
            frequency_penalties=floats("frequency_penalty"),
            presence_penalties=floats("presence_penalty"),
            min_new_tokens=torch.tensor(
                [p.min_new_tokens for p in params_list], dtype=torch.int64, device=device
            ),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=list(generators),
            stop_token_ids_list=[list(p.stop_token_ids or ()) for p in params_list],
            vocab_size=vocab_size,
            sampled_rows=[i for i, g in enumerate(greedy) if not g],
            all_greedy=all(greedy),
            need_top_k=any(p.top_k > 0 and p.top_k < vocab_size for p in sampled),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            need_repetition_penalty=any(p.repetition_penalty != 1.0 for p in params_list),
            need_frequency_presence_penalty=any(
                p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params_list
            ),
            need_min_new_tokens=any(p.min_new_tokens > 0 for p in params_list),
            need_logit_bias=any(p.logit_bias for p in params_list),
            params_list=list(params_list),
        )

    @property
    def batch_size(self) -> int:
        return len(self.generators)


class SamplingInfoCache:
    """The last step's `SamplingBatchInfo`, reused while the same requests sample again.

    A decode batch is usually the same requests in the same order step after step, and
    nothing `from_params` reads changes while a request runs (its `SamplingParams` are
    verified once and never modified; its generator is the same object, advancing in
    place). Rebuilding the ~10 small tensors and the flags every step costs more host
    time than the greedy argmax itself at small batches. The key is the identity of each
    row's params and generator; the cache holds them, so no id can be reused by a new
    object while it is compared.
    """

    def __init__(self):
        self._params: list[SamplingParams] = []
        self._generators: list[torch.Generator] = []
        self._info: SamplingBatchInfo | None = None
        self._shape: tuple[int, str] | None = None

    def get(
        self,
        params_list: list[SamplingParams],
        seeds: list[int],
        vocab_size: int,
        device: torch.device | str,
        generators: list[torch.Generator],
    ) -> SamplingBatchInfo:
        """`SamplingBatchInfo.from_params(params_list, seeds, vocab_size, device, generators)`,
        the previous one when every row is the same params and generator as last time."""
        shape = (vocab_size, str(device))
        if not (self._info is not None and shape == self._shape and _same_objects(params_list, self._params)
                and _same_objects(generators, self._generators)):
            self._info = SamplingBatchInfo.from_params(params_list, seeds, vocab_size, device, generators)
            self._params, self._generators, self._shape = list(params_list), list(generators), shape
        return self._info


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class TokenLogprobs(NamedTuple):
    """Log probabilities of chosen tokens and, when asked, the top alternatives.

    ``logprobs`` (N,) float32; ``top_values`` (N, k) float32 and ``top_ids``
    (N, k) int64, or None when k is 0. Under a grammar mask fewer than k
    tokens may be allowed, and the rest of a row is -inf; read rows with
    `top_pairs`, which leaves those out.
    """

    logprobs: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    def top_pairs(self, row: int, k: int) -> list[tuple[float, int]]:
        """The first ``k`` (logprob, token id) alternatives of ``row`` that are finite (see `finite_top_pairs`)."""
        if self.top_values is None or self.top_ids is None or k <= 0:
            return []
        return finite_top_pairs(self.top_values[row, :k].tolist(), self.top_ids[row, :k].tolist())


def finite_top_pairs(values: list[float], token_ids: list[int]) -> list[tuple[float, int]]:
    """(logprob, token id) pairs of a top-logprobs row without its non-finite entries.

    The top alternatives are taken after the grammar mask, so a masked token
    (logprob -inf: it could not have been sampled) is no alternative, and it
    is left out rather than reported: a constrained request may get fewer
    than the ``top_logprobs`` it asked for. JSON has no -inf either (the HTTP
    reply would fail). NaN (a broken row) is left out too.

    Parameters
    ----------
    values:
        Logprobs in descending order (one row of `TokenLogprobs.top_values`).
    token_ids:
        Their token ids (the same row of `TokenLogprobs.top_ids`).
    """
    return [(v, t) for v, t in zip(values, token_ids) if math.isfinite(v)]


class SampleOutput(NamedTuple):
    """What the sampler picked for a batch.

    ``next_token_ids`` (B,) int64; ``logprobs`` (B,) float32 of those tokens
    (see `Sampler` for which distribution); ``top_logprobs`` when
    ``top_logprobs_num > 0`` was asked for, else None. ``invalid_rows``: the
    rows whose logits or probabilities were not finite (NaN, +inf, or every
    token masked); their token is meaningless and the caller aborts those
    requests alone.
    """

    next_token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_logprobs: TokenLogprobs | None
    invalid_rows: tuple[int, ...] = ()


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_logprobs_num: int = 0
) -> TokenLogprobs:
    """Log-softmax log probabilities of ``token_ids`` and the ``top_logprobs_num`` best.

    Parameters
    ----------
    logits:
        (N, V) float; N is the batch for decode or the prompt positions for
        prompt logprobs. Temperature is not applied (logprobs are of the
        model's distribution at temperature 1).
    token_ids:
        (N,) int64, the token whose log probability each row reports.
    top_logprobs_num:
        How many of the most likely tokens to return per row (0: none).
    """
    logits = logits.float()
    token_ids = token_ids.view(-1, 1).long()
    if top_logprobs_num <= 0:
        # log p(t) = logit(t) - logsumexp(logits): no (N, V) log-softmax when only the
        # chosen tokens are wanted.
        return TokenLogprobs(logits.gather(1, token_ids).squeeze(1) - torch.logsumexp(logits, dim=-1), None, None)
    # One log-softmax for both, so a chosen token's logprob equals its entry in the top list.
    log_probs = torch.log_softmax(logits, dim=-1)
    top_values, top_ids = log_probs.topk(top_logprobs_num, dim=-1)
    return TokenLogprobs(log_probs.gather(1, token_ids).squeeze(1), top_values, top_ids)


def _pad(lists: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """(B, max_len) int64 from ragged lists, padded with ``pad_id``."""
    width = max((len(x) for x in lists), default=0)
    rows = [list(x) + [pad_id] * (width - len(x)) for x in lists]
    return torch.tensor(rows, dtype=torch.int64, device=device).view(len(lists), width)


def _token_counts(ids_list: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(B, V) float32 count of each token id per row; ids out of range are ignored."""
    ids = _pad(ids_list, vocab_size, device)
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
    counts = torch.zeros(len(ids_list), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    output_ids_list: list[list[int]],
    prompt_ids_list: list[list[int]] | None = None,
    native: bool = True,
) -> None:
    """Apply repetition, frequency and presence penalties to ``logits`` (B, V) in place.

    Repetition as Hugging Face's ``RepetitionPenaltyLogitsProcessor`` (over prompt
    and output tokens: positive logits divided by the penalty, negative ones
    multiplied); frequency and presence as OpenAI's API (over output tokens:
    ``logit -= frequency * count + presence * (count > 0)``).

    On the CPU, where the native sampler builds, only the seen tokens' logits are touched
    (`cpu_sampling.apply_penalties`, the same bits); the torch ops below build (B, V) counts
    (elsewhere, or with ``native=False``).
    """
    usable = native and logits.is_cpu and logits.dtype == torch.float32 and logits.stride(-1) == 1
    lib = cpu_sampling.native_library() if usable else None
    if lib is not None:
        both = info.need_frequency_presence_penalty
        cpu_sampling.apply_penalties(
            lib, logits, output_ids_list, prompt_ids_list if info.need_repetition_penalty else None,
            info.repetition_penalties if info.need_repetition_penalty else None,
            info.frequency_penalties if both else None, info.presence_penalties if both else None)
        return
    vocab_size = logits.shape[-1]
    output_counts = _token_counts(output_ids_list, vocab_size, logits.device)
    if info.need_repetition_penalty:
        seen = output_counts > 0
        if prompt_ids_list is not None:
            seen |= _token_counts(prompt_ids_list, vocab_size, logits.device) > 0
        penalty = info.repetition_penalties.view(-1, 1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if info.need_frequency_presence_penalty:
        logits -= info.frequency_penalties.view(-1, 1) * output_counts
        logits -= info.presence_penalties.view(-1, 1) * (output_counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, info: SamplingBatchInfo) -> None:
    """Add each row's ``logit_bias`` to ``logits`` (B, V) in place (ids already verified)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, params in enumerate(info.params_list):
        for token_id, bias in params._logit_bias_items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def apply_min_new_tokens(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    eos_ids_list: list[list[int]],
    num_generated: list[int],
) -> None:
    """Mask EOS and stop token ids to ``-inf`` in place on rows below their min_new_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, params in enumerate(info.params_list):
        if num_generated[i] >= params.min_new_tokens:
            continue
        ids = set(eos_ids_list[i]) | set(info.stop_token_ids_list[i])
        ids = {t for t in ids if 0 <= t < logits.shape[-1]}
        rows += [i] * len(ids)
        cols += sorted(ids)
    if rows:
        logits[
            torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)
        ] = float("-inf")


# Columns per chunk of `row_max`'s first pass.
ROW_MAX_CHUNK = 1024

def row_max(logits: torch.Tensor, native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(dim=-1)`` of (B, V) float32: (B,) values and (B,) int64 indices of each
    row's first maximum (NaN propagates into the value as torch's does).

    native: on the CPU, one pass per row in the native sampler (`cpu_sampling.row_max`,
    the same values and indices bit for bit) where its library builds; else as below.

    In two passes, because torch's CPU max-with-indices over a long row is slow (SmolLM2's
    49152 columns: 44 us a row at B=1, 720 us at B=32): the chunks' maxima without indices
    (``amax``, vectorised), the first chunk holding the row's maximum, then the first index
    of it within that chunk (29 and 140 us; 5x at B=32). Ties resolve to the first index as
    in one pass: the first chunk with the maximum, the first position in it. Other devices
    take the one pass (their max-with-indices has no such cost).
    """
    lib = cpu_sampling.native_library() if native and logits.is_cpu and logits.dim() == 2 else None
    if lib is not None and logits.shape[1] > 0:
        return cpu_sampling.row_max(lib, logits if logits.stride(1) == 1 else logits.contiguous())
    rows, cols = logits.shape
    main = cols // ROW_MAX_CHUNK * ROW_MAX_CHUNK
    if main == 0 or not logits.is_cpu:
        return logits.max(dim=-1)
    chunks = logits[:, :main].reshape(rows, main // ROW_MAX_CHUNK, ROW_MAX_CHUNK)
    values, chunk = chunks.amax(dim=-1).max(dim=-1)
    indices = chunk * ROW_MAX_CHUNK + chunks[torch.arange(rows), chunk].argmax(dim=-1)
    if main < cols:
        tail_values, tail_indices = logits[:, main:].max(dim=-1)
        later = (tail_values > values) | torch.isnan(tail_values)  # a tie keeps the earlier index
        values = torch.where(later, tail_values, values)
        indices = torch.where(later, tail_indices + main, indices)
    return values, indices


def invalid_logit_rows(logits: torch.Tensor, maxima: torch.Tensor | None = None) -> tuple[int, ...]:
    """Rows of ``logits`` (B, V) float32 that cannot be sampled from: a NaN or +inf
    anywhere, or no finite value at all (every token masked).

    maxima: ``logits.max(dim=-1).values`` when the caller has it (the sampler takes
    its greedy tokens from the same pass), else computed here.
    """
    if maxima is None:
        maxima = logits.amax(dim=-1)
    # max is NaN when any entry is NaN. One host copy of B floats: the torch ops (isnan,
    # isinf, or, any) took 0.1 ms of a batch-1 decode step, run right after the model.
    return tuple(i for i, m in enumerate(maxima.tolist()) if not math.isfinite(m))


class Sampler:
    """Pick the next token of every request in a batch from its logits.

    The returned log probabilities are those of the chosen tokens under the
    *unfiltered, temperature-1* log-softmax of the logits after penalties and
    min_new_tokens masking (and after any grammar mask the caller applied):
    the model's own distribution, as SGLang and OpenAI report it, not the
    truncated distribution actually sampled from (whose logprobs would be 0 for
    every greedy token).

    native: on the CPU, penalties and draws in the native sampler (`kernels.cpu_sampling`)
    where it builds; False takes the torch ops (``--disable-cpu-kernels``).
    """

    def __init__(self, native: bool = True):
        self.native = native

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        output_ids_list: list[list[int]] | None = None,
        prompt_ids_list: list[list[int]] | None = None,
        eos_ids_list: list[list[int]] | None = None,
        num_generated: list[int] | None = None,
        top_logprobs_num: int = 0,
        return_logprob: bool = True,
    ) -> SampleOutput:
        """Sample one token per row.

        Parameters
        ----------
        logits:
            (B, V) float32; not modified.
        info:
            The batch's `SamplingBatchInfo`; its generators advance.
        output_ids_list:
            Tokens generated so far per request (for penalties); default none.
        prompt_ids_list:
            Prompt tokens per request (for the repetition penalty); default none.
        eos_ids_list:
            EOS ids per request, masked with the request's ``stop_token_ids``
            while ``num_generated`` is below ``min_new_tokens``.
        num_generated:
            Output length so far per request; defaults to the lengths of
            ``output_ids_list``.
        top_logprobs_num:
            Also return this many top logprobs per row (the batch's maximum;
            callers slice per request).
        return_logprob:
            Compute the chosen tokens' logprobs; when False (no request asked),
            ``logprobs`` is an empty tensor and the (B, V) log-softmax is skipped.
        """
        batch_size = logits.shape[0]
        assert batch_size == info.batch_size, "one SamplingBatchInfo row per logits row"
        if output_ids_list is None:
            output_ids_list = [[] for _ in range(batch_size)]
        if num_generated is None:
            num_generated = [len(x) for x in output_ids_list]
        logits = self._process_logits(
            logits, info, output_ids_list, prompt_ids_list, eos_ids_list, num_generated, native=self.native
        )
        # One `row_max` gives both the rows' validity and the greedy tokens.
        maxima, argmax = row_max(logits, self.native)
        invalid = invalid_logit_rows(logits, maxima)
        if invalid:
            # A poisoned row must not poison the batch: sample it from zeros (its token is
            # discarded) so softmax and the draws see only finite rows.
            logits = logits.clone()
            logits[list(invalid)] = 0.0
            argmax = row_max(logits, self.native)[1]
        next_token_ids, unsampleable = self._sample(logits, info, argmax, native=self.native)
        invalid = tuple(sorted(set(invalid) | set(unsampleable)))
        if not return_logprob and top_logprobs_num <= 0:
            return SampleOutput(next_token_ids, logits.new_empty(0), None, invalid)
        out = compute_logprobs(logits, next_token_ids, top_logprobs_num)
        top = out if top_logprobs_num > 0 else None
        return SampleOutput(next_token_ids, out.logprobs, top, invalid)

    @staticmethod
    def _process_logits(
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        output_ids_list: list[list[int]],
        prompt_ids_list: list[list[int]] | None,
        eos_ids_list: list[list[int]] | None,
        num_generated: list[int],
        native: bool = True,
    ) -> torch.Tensor:
        """Penalties, logit bias, then min_new_tokens masking, on a copy when any applies."""
        need_penalties = info.need_repetition_penalty or info.need_frequency_presence_penalty
        if not need_penalties and not info.need_logit_bias and not info.need_min_new_tokens:
            return logits.float()
        logits = logits.float().clone()
        if need_penalties:
            apply_penalties(logits, info, output_ids_list, prompt_ids_list, native=native)
        if info.need_logit_bias:
            apply_logit_bias(logits, info)
        if info.need_min_new_tokens:
            eos = eos_ids_list if eos_ids_list is not None else [[] for _ in num_generated]
            apply_min_new_tokens(logits, info, eos, num_generated)
        return logits

    @staticmethod
    def _sample(
        logits: torch.Tensor, info: SamplingBatchInfo, argmax: torch.Tensor | None = None, native: bool = True
    ) -> tuple[torch.Tensor, list[int]]:
        """(B,) int64: argmax on greedy rows, a seeded draw (`SampledRows`) on the others; and the
        sampled rows whose probabilities were not finite (left at their argmax).

        argmax: ``logits.max(dim=-1).indices`` when the caller has it, else computed here.
        """
        if argmax is None:
            argmax = row_max(logits, native)[1]
        if info.all_greedy:
            return argmax, []
        # Each sampled row draws with its own request's generator, so a seed's draws do
        # not depend on the batch's composition.
        rows = info.sampled_rows
        uniforms = draw_uniforms([info.generators[i] for i in rows], logits.device)
        tokens = SampledRows(logits, info, native=native).draw(rows, uniforms)
        next_token_ids = argmax.clone()
        good = [(r, t) for r, t in zip(rows, tokens) if t >= 0]
        if good:
            index = torch.tensor([r for r, _ in good], device=logits.device)
            next_token_ids[index] = torch.tensor([t for _, t in good], dtype=next_token_ids.dtype,
                                                 device=logits.device)
        return next_token_ids, [r for r, t in zip(rows, tokens) if t < 0]
