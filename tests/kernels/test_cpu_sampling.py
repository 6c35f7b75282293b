"""The native CPU sampler (`kernels/cpu_sampling.py`, `csrc/sampling.cpp`) against its oracle,
the torch path (`sampling_probs` then `draw_from_probs`), on the same uniforms.

Both builds run: the AVX-512 passes where this CPU has them, and the plain C++ ones
(``-mno-avx512f``). A token must be the torch path's for the same uniform (they differ only
where rounding moves a boundary of the cumulative probabilities, which these rows and
uniforms do not hit), a token the filters or a mask remove must never come, a row's token
must not depend on the other rows, and the draws must follow the distribution.
"""

from __future__ import annotations

import math
import platform
from array import array
from collections import Counter

import pytest
import torch

from arborlm.kernels import cpu_ops, cpu_sampling
from arborlm.runtime.sampling import Sampler, SamplingBatchInfo, make_generator
from arborlm.runtime.sampling_filters import SampledRows, draw_from_probs, sampling_probs
from arborlm.sampling_params import SamplingParams

BUILDS = {"native": (), "scalar": ("-mno-avx512f",)}
VOCAB = 49152  # SmolLM2's; a multiple of 16
ODD_VOCAB = 1003  # ends in a partial vector and a partial block of 256

# (temperature, top_p, top_k, min_p); top_k -1: none
SETTINGS = [
    (1.0, 1.0, -1, 0.0),
    (0.7, 0.9, -1, 0.0),
    (1.0, 0.95, -1, 0.0),
    (0.5, 0.5, -1, 0.0),
    (1.0, 1.0, 40, 0.0),
    (1.3, 1.0, 2, 0.0),
    (0.8, 1.0, -1, 0.05),
    (1.0, 0.95, 50, 0.01),
    (1.0, 0.99, 20000, 0.0),
]


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request, compiler, tmp_path_factory):
    """The sampler library, built once per module for each entry of `BUILDS`."""
    if BUILDS[request.param] and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the {request.param} build passes x86-only flags ({' '.join(BUILDS[request.param])}); this "
                    f"machine is {platform.machine()}, where the native build (the one it serves with) is tested")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_ops, "CXX_FLAGS", cpu_ops.CXX_FLAGS + BUILDS[request.param])
        return cpu_sampling.load_library(tmp_path_factory.mktemp(f"sampling-{request.param}"))


def batch_info(settings: list[tuple[float, float, int, float]], vocab: int) -> SamplingBatchInfo:
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m) for t, p, k, m in settings]
    return SamplingBatchInfo.from_params(params, list(range(len(params))), vocab)


def native_draw(lib, logits: torch.Tensor, info: SamplingBatchInfo, uniforms: torch.Tensor,
                rows: list[int] | None = None) -> list[int]:
    rows = list(range(logits.shape[0])) if rows is None else rows
    return cpu_sampling.sample_rows(lib, logits, torch.tensor(rows), info.temperatures.view(-1), info.top_ks,
                                    info.top_ps, info.min_ps, uniforms).tolist()


def torch_draw(logits: torch.Tensor, info: SamplingBatchInfo, uniforms: torch.Tensor) -> list[int]:
    probs, unusable = sampling_probs(logits, info)
    assert not unusable
    return draw_from_probs(probs, uniforms).tolist()


def kinds_of_rows(vocab: int, n: int, seed: int) -> torch.Tensor:
    """(n, vocab) logits: peaked (a few tokens far above the rest), flat (plain normal), spread
    (normal times 3), a row with ties among its largest, and a row masked to a few tokens (the
    rest -inf, as a grammar masks)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        kind = i % 5
        x = torch.randn(vocab, generator=g) * (3.0 if kind == 2 else 1.0)
        if kind == 0:
            x[torch.randint(0, vocab, (30,), generator=g)] += 8.0
        if kind == 3:
            x[torch.randint(0, vocab, (12,), generator=g)] = x.max() + 1.0  # equal largest values
        if kind == 4:
            keep = torch.randint(0, vocab, (7,), generator=g)
            masked = torch.full((vocab,), -math.inf)
            masked[keep] = x[keep]
            x = masked
        rows.append(x)
    return torch.stack(rows)


@pytest.mark.parametrize("vocab", [VOCAB, ODD_VOCAB])
def test_tokens_are_the_torch_paths_for_the_same_uniforms(lib, vocab):
    mismatches, total = [], 0
    for seed in range(6):
        logits = kinds_of_rows(vocab, 10, seed)
        for setting in SETTINGS:
            info = batch_info([setting] * logits.shape[0], vocab)
            u = torch.rand(logits.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
            got, want = native_draw(lib, logits, info, u), torch_draw(logits, info, u)
            total += len(got)
            mismatches += [(seed, setting, r, g, w) for r, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not mismatches, f"{len(mismatches)} of {total} differ: {mismatches[:5]}"


@pytest.mark.parametrize("setting", SETTINGS[1:], ids=lambda s: f"T{s[0]}-p{s[1]}-k{s[2]}-m{s[3]}")
def test_only_kept_tokens_come_even_at_the_ends_of_the_uniforms(lib, setting):
    """Over a grid of uniforms (0 and just below 1 included) every token is one the filters (and
    the -inf mask) keep, and on rows that keep few tokens every kept token comes."""
    logits = kinds_of_rows(ODD_VOCAB, 10, seed=7)
    info = batch_info([setting] * logits.shape[0], ODD_VOCAB)
    probs, _ = sampling_probs(logits, info)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    grid = [0.0, 1e-12, 0.5, 1.0 - 2**-53] + [(i + 0.5) / 400 for i in range(400)]
    for r in range(logits.shape[0]):
        kept = set((probs[r] > 0).nonzero().view(-1).tolist())
        drawn = {native_draw(lib, logits, info, torch.tensor([u], dtype=torch.float64), [r])[0] for u in grid}
        assert drawn <= kept, f"row {r}: {sorted(drawn - kept)[:5]} not kept"
        likely = set((probs[r] > 2 / 400).nonzero().view(-1).tolist())  # wider than a grid step
        assert likely <= drawn, f"row {r}: {sorted(likely - drawn)[:5]} never drawn"


def test_top_k_1_is_the_first_largest(lib):
    logits = kinds_of_rows(VOCAB, 10, seed=3)
    info = batch_info([(1.3, 1.0, 1, 0.0)] * 10, VOCAB)
    u = torch.rand(10, dtype=torch.float64)
    assert native_draw(lib, logits, info, u) == logits.argmax(dim=-1).tolist()  # ties: the lowest id, as argmax


def test_a_row_does_not_depend_on_the_other_rows(lib):
    logits = kinds_of_rows(VOCAB, 10, seed=11)
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(10)]
    info = batch_info(settings, VOCAB)
    u = torch.rand(10, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    together = native_draw(lib, logits, info, u)
    for r in range(10):
        alone_info = batch_info([settings[r]], VOCAB)
        assert native_draw(lib, logits[r : r + 1].clone(), alone_info, u[r : r + 1]) == [together[r]]
    assert native_draw(lib, logits, info, u.flip(0), list(range(9, -1, -1))) == together[::-1]


def test_rows_that_cannot_be_drawn_from_get_minus_one_and_spare_the_others(lib):
    logits = kinds_of_rows(VOCAB, 5, seed=2)
    logits[1, 17] = math.nan
    logits[2, 3] = math.inf
    logits[3] = -math.inf
    info = batch_info([SETTINGS[1]] * 5, VOCAB)
    u = torch.full((5,), 0.3, dtype=torch.float64)
    got = native_draw(lib, logits, info, u)
    assert got[1:4] == [-1, -1, -1]
    assert got[0] == native_draw(lib, logits[:1].clone(), batch_info([SETTINGS[1]], VOCAB), u[:1])[0] >= 0
    assert got[4] >= 0


@pytest.mark.parametrize("vocab", [VOCAB, ODD_VOCAB, 1, 63, 64, 65, 130])
def test_row_max_is_torchs_max_bit_for_bit(lib, vocab):
    """`row_max`: torch's ``max(dim=-1)`` values (bits, -0 included) and first indices, with a
    NaN (the first NaN's index), +inf, all -inf, ties and signed zeros in rows, over rows
    `stride` apart (a slice of a wider tensor)."""
    wide = torch.randn(12, vocab + 5, generator=torch.Generator().manual_seed(vocab))
    logits = wide[:, :vocab]
    logits[1, vocab // 2] = math.nan
    logits[1, vocab - 1] = math.nan
    logits[2, vocab - 1] = math.nan
    logits[3] = -math.inf
    logits[4, vocab // 3] = math.inf
    logits[5] = torch.round(logits[5])  # many ties
    logits[6] = 0.0
    logits[7, ::2], logits[7, 1::2] = -0.0, 0.0
    logits[8, -1] = 100.0  # the maximum in the tail past the lanes
    logits[9, 0] = 100.0
    values, indices = cpu_sampling.row_max(lib, logits)
    want = logits.max(dim=-1)
    assert torch.equal(indices, want.indices)
    assert torch.equal(values.view(torch.int32), want.values.view(torch.int32))


def test_the_sampler_greedy_rows_are_the_torch_paths():
    """`Sampler(native=True)`'s greedy tokens and unsampleable rows equal the torch path's."""
    logits = kinds_of_rows(VOCAB, 6, seed=4)
    logits[2, 5] = math.nan
    logits[3] = -math.inf
    logits[4] = torch.round(logits[4])
    params = [SamplingParams(temperature=0.0)] * 6
    info = SamplingBatchInfo.from_params(params, list(range(6)), VOCAB)
    native = Sampler(native=True)(logits, info, return_logprob=False)
    plain = Sampler(native=False)(logits, info, return_logprob=False)
    assert native.invalid_rows == plain.invalid_rows == (2, 3)
    assert native.next_token_ids[[0, 1, 4, 5]].tolist() == plain.next_token_ids[[0, 1, 4, 5]].tolist()


def test_bad_arguments_raise(lib):
    info = batch_info([SETTINGS[0]], 8)
    u = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        native_draw(lib, torch.zeros(1, 8, dtype=torch.float64), info, u)
    with pytest.raises(ValueError, match="float32"):
        cpu_sampling.row_max(lib, torch.zeros(1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        native_draw(lib, torch.zeros(1, 8), info, u, rows=[1])  # past the logits' rows
    with pytest.raises(ValueError, match="contiguous"):
        native_draw(lib, torch.zeros(1, 8), info, torch.zeros(1, dtype=torch.float32))


@pytest.mark.parametrize("setting", [(1.0, 1.0, -1, 0.0), (0.7, 0.8, -1, 0.0), (1.2, 1.0, 5, 0.0),
                                     (1.0, 1.0, -1, 0.2)], ids=["plain", "top_p", "top_k", "min_p"])
def test_draws_follow_the_distribution(lib, setting):
    """Chi-square (p = 0.001) of 20000 seeded draws against the filtered distribution of one
    row of 300 tokens; a token of probability 0 is never drawn."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 300, generator=g) * 2.0).repeat(20000, 1)
    info = batch_info([setting] * 20000, 300)
    probs, _ = sampling_probs(logits[:1], batch_info([setting], 300))
    probs = (probs[0] / probs[0].sum()).double()
    u = torch.rand(20000, dtype=torch.float64, generator=g)
    counts = Counter(native_draw(lib, logits, info, u))
    assert all(probs[t] > 0 for t in counts)
    stat, dof = 0.0, -1
    for t, p in enumerate(probs.tolist()):
        if p * 20000 >= 5:
            stat += (counts.get(t, 0) - p * 20000) ** 2 / (p * 20000)
            dof += 1
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"


def test_the_sampler_gives_the_torch_paths_tokens_for_the_same_seeds():
    """`Sampler` (native where it builds) against `SampledRows(native=False)`: the same seeds
    draw the same tokens on the default model's vocabulary size."""
    logits = kinds_of_rows(VOCAB, 10, seed=21)
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(10)]
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m) for t, p, k, m in settings]
    for seed in range(3):
        info = SamplingBatchInfo.from_params(params, [seed * 10 + i for i in range(10)], VOCAB)
        got = Sampler()(logits, info, return_logprob=False).next_token_ids.tolist()
        generators = [make_generator(seed * 10 + i) for i in range(10)]
        u = torch.cat([torch.rand(1, generator=gen, dtype=torch.float64) for gen in generators])
        want = SampledRows(logits, info, native=False).draw(list(range(10)), u)
        assert got == want


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.7, "presence_penalty": -0.4},
    {"repetition_penalty": 0.8, "frequency_penalty": -1.5, "presence_penalty": 1.1},
], ids=["repetition", "frequency-presence", "all"])
def test_penalties_are_the_torch_paths_bits(lib, penalties, monkeypatch):
    """`apply_penalties` on the native library against its torch path: the same bits, with
    repeated ids, ids out of the vocabulary, empty rows, rows without the penalty, and
    -inf / NaN logits (a masked token, a poisoned row)."""
    from arborlm.runtime import sampling

    monkeypatch.setattr(cpu_sampling, "native_library", lambda: lib)
    vocab, batch = ODD_VOCAB, 6
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(batch, vocab, generator=g) * 4
    logits[0, :50] = -math.inf
    logits[5, 7] = math.nan
    outputs = [torch.randint(0, 60, (n,), generator=g).tolist() for n in (40, 0, 7, 300, 1, 12)]
    outputs[2] += [vocab, vocab + 5, -3, 2**40]  # out of the vocabulary: ignored
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (0, 90, 15, 400, 3, 30)]
    params = [SamplingParams(temperature=0.7, **(penalties if i != 4 else {})) for i in range(batch)]
    info = SamplingBatchInfo.from_params(params, list(range(batch)), vocab)
    want, got = logits.clone(), logits.clone()
    sampling.apply_penalties(want, info, outputs, prompts, native=False)
    sampling.apply_penalties(got, info, outputs, prompts)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not torch.equal(got.nan_to_num(), logits.nan_to_num())  # something was penalised
    # prompts as the int32 arrays requests keep (`Req.prompt_id_array`), beside lists
    as_arrays = [array("i", p) if i % 2 else p for i, p in enumerate(prompts)]
    again = logits.clone()
    sampling.apply_penalties(again, info, outputs, as_arrays)
    assert torch.equal(again.nan_to_num(), want.nan_to_num())


def test_native_false_never_touches_the_library(monkeypatch):
    """`Sampler(native=False)` (what ``--disable-cpu-kernels`` builds) samples and penalises with
    the torch ops only."""
    def refuse():
        raise AssertionError("the native sampler was used")

    monkeypatch.setattr(cpu_sampling, "native_library", refuse)
    logits = kinds_of_rows(ODD_VOCAB, 4, seed=9)
    params = [SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.3)] * 4
    info = SamplingBatchInfo.from_params(params, [1, 2, 3, 4], ODD_VOCAB)
    out = Sampler(native=False)(logits, info, [[1, 2, 2]] * 4, [[5, 6]] * 4, return_logprob=False)
    assert out.next_token_ids.shape == (4,) and not out.invalid_rows
