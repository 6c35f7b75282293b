"""Tests of arborlm.runtime.sampling: parameter validation, penalties, filters, seeds."""

import math
import pickle

import pytest
import torch

from arborlm.errors import InvalidRequestError
from arborlm.runtime.sampling import (
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
    compute_logprobs,
    make_generator,
)
from arborlm.runtime.sampling_filters import filter_probs, sample_from_probs

VOCAB = 32


def make_info(params_list, seeds=None, vocab_size=VOCAB, generators=None):
    seeds = seeds if seeds is not None else [i for i in range(len(params_list))]
    return SamplingBatchInfo.from_params(params_list, seeds, vocab_size, "cpu", generators)


def random_logits(batch_size, vocab_size=VOCAB, seed=0):
    return torch.randn(batch_size, vocab_size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- SamplingParams


INVALID = [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": "abc"}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 3.5e38}, "temperature"),  # finite in float64, inf in the sampler's float32
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_p": None}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"n": 0}, "n"),
    ({"n": False}, "n"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop": 3}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"seed": "1"}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
]


@pytest.mark.parametrize("fields, param", INVALID, ids=[f"{p}={f}" for f, p in INVALID])
def test_verify_rejects_invalid_field(fields, param):
    params = SamplingParams.from_dict(fields)
    with pytest.raises(InvalidRequestError) as excinfo:
        params.verify(VOCAB)
    assert excinfo.value.param == param


VALID = [
    {},
    {"temperature": 0},
    {"top_p": 1, "top_k": 1, "min_p": 1},
    {"frequency_penalty": -2, "presence_penalty": 2},
    {"min_new_tokens": 5, "max_new_tokens": 5},
    {"max_new_tokens": 0},
    {"stop": "x", "stop_token_ids": [0, VOCAB - 1], "seed": 7},
    {"stop": ["a", "b"], "n": 3, "no_stop_trim": True},
    {"logit_bias": {"0": -100, 5: 100.0}},
]


@pytest.mark.parametrize("fields", VALID)
def test_verify_accepts_valid_fields(fields):
    SamplingParams.from_dict(fields).verify(VOCAB)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams.from_dict({"temperature": 0.5, "max_tokens": 3, "best_of": 2})
    assert excinfo.value.param == "best_of"
    assert "max_tokens" in excinfo.value.message and "best_of" in excinfo.value.message
    assert "max_new_tokens" in excinfo.value.message  # the valid ones are listed


def test_defaults_and_normalized():
    params = SamplingParams()
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (
        128,
        1.0,
        1.0,
        -1,
    )
    assert params.normalized().stop == [] and params.normalized().stop_token_ids == []
    assert SamplingParams(stop="end").normalized().stop == ["end"]
    assert SamplingParams(stop=["a", "b"]).normalized().stop == ["a", "b"]


def test_params_are_picklable():
    params = SamplingParams(temperature=0.3, stop=["x"], seed=4)
    assert pickle.loads(pickle.dumps(params)) == params


# ---------------------------------------------------------------- greedy and filters


def test_greedy_equals_argmax():
    logits = random_logits(4)
    info = make_info([SamplingParams(temperature=0)] * 4)
    out = Sampler()(logits, info)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


def test_greedy_rows_in_mixed_batch_equal_argmax():
    logits = random_logits(4)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.5),
    ]
    out = Sampler()(logits, make_info(params))
    assert (
        out.next_token_ids[0] == logits[0].argmax() and out.next_token_ids[2] == logits[2].argmax()
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(temperature=1.0, top_p=1e-6, top_k=5),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=1e-4),
    ],
    ids=["top_k=1", "top_p=tiny", "top_p_tiny_top_k_5", "min_p=1", "temperature=tiny"],
)
def test_filters_that_leave_only_the_argmax(params):
    logits = random_logits(8, seed=3)
    for seed in range(5):
        out = Sampler()(logits, make_info([params] * 8, seeds=[seed] * 8))
        assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_top_k_keeps_only_k_tokens():
    logits = random_logits(1, seed=1)
    allowed = set(logits[0].topk(3).indices.tolist())
    info = make_info([SamplingParams(top_k=3)])
    seen = {int(Sampler()(logits, info).next_token_ids[0]) for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_filters_numerically():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    # the smallest set of most likely tokens whose mass reaches top_p survives
    info = make_info([SamplingParams(top_p=0.85)], vocab_size=4)
    kept = filter_probs(probs, info)
    assert torch.allclose(kept, torch.tensor([[0.5, 0.3, 0.15, 0.0]]))
    info = make_info([SamplingParams(top_p=0.7)], vocab_size=4)
    assert torch.allclose(filter_probs(probs, info), torch.tensor([[0.5, 0.3, 0.0, 0.0]]))


def test_min_p_filters_relative_to_max():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    info = make_info([SamplingParams(min_p=0.5)], vocab_size=4)
    assert torch.allclose(filter_probs(probs, info), torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    info = make_info([SamplingParams(min_p=0.2)], vocab_size=4)
    assert torch.allclose(filter_probs(probs, info), torch.tensor([[0.5, 0.3, 0.15, 0.0]]))


def test_min_p_sampling_never_picks_filtered_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    info = make_info([SamplingParams(min_p=0.5)], vocab_size=4)
    seen = {int(Sampler()(logits, info).next_token_ids[0]) for _ in range(300)}
    assert seen == {0, 1}


def test_top_k_then_top_p_renormalised():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top_k=2 leaves 0.4, 0.3 -> renormalised 4/7, 3/7; top_p=0.5: mass before token 1 is
    # 4/7 > 0.5, so only token 0 survives.
    info = make_info([SamplingParams(top_k=2, top_p=0.5)], vocab_size=4)
    assert torch.allclose(filter_probs(probs, info), torch.tensor([[0.4, 0.0, 0.0, 0.0]]))


def test_fast_path_flags():
    info = make_info([SamplingParams(), SamplingParams(temperature=0.7)])
    assert not (info.need_top_k or info.need_top_p or info.need_min_p or info.all_greedy)
    info = make_info([SamplingParams(temperature=0, top_p=0.5), SamplingParams()])
    assert not info.need_top_p  # greedy rows never need the filters
    assert make_info([SamplingParams(top_k=VOCAB)]).need_top_k is False
    assert make_info([SamplingParams(top_k=4)]).need_top_k


# ---------------------------------------------------------------- seeds


def test_same_seed_same_tokens_across_batch_compositions():
    params = SamplingParams(temperature=1.0, top_k=20)
    target = random_logits(1, seed=11)[0]
    alone = Sampler()(target.unsqueeze(0), make_info([params], seeds=[1234]))
    for others in (1, 3, 7):
        logits = torch.cat([random_logits(others, seed=others), target.unsqueeze(0)])
        batch = [SamplingParams(temperature=0.5)] * others + [params]
        seeds = list(range(100, 100 + others)) + [1234]
        out = Sampler()(logits, make_info(batch, seeds=seeds))
        assert out.next_token_ids[-1] == alone.next_token_ids[0]


def test_persistent_generators_continue_the_stream_across_steps():
    params = [SamplingParams(), SamplingParams(temperature=0.8)]
    logits = random_logits(2, seed=5)

    def run(batch_logits, batch_params, gens, steps=20):
        tokens = []
        for _ in range(steps):
            info = make_info(batch_params, seeds=[0] * len(gens), generators=gens)
            tokens.append(Sampler()(batch_logits, info).next_token_ids[0].item())
        return tokens

    a = run(logits, params, [make_generator(42), make_generator(1)])
    b = run(logits[:1], params[:1], [make_generator(42)])
    assert a == b and len(set(a)) > 1  # the stream advances, and the batch does not matter


def test_different_seeds_differ():
    logits = torch.zeros(1, VOCAB)
    firsts = {
        int(Sampler()(logits, make_info([SamplingParams()], seeds=[s])).next_token_ids[0])
        for s in range(20)
    }
    assert len(firsts) > 3


def test_sampled_distribution_matches_softmax():
    logits = torch.tensor([[0.0, 1.0]])  # p = [0.269, 0.731]
    gen = make_generator(2024)
    info = make_info([SamplingParams(temperature=1.0)], vocab_size=2, generators=[gen])
    ones = sum(int(Sampler()(logits, info).next_token_ids[0]) for _ in range(2000))
    expected = torch.softmax(logits, -1)[0, 1].item()
    assert abs(ones / 2000 - expected) < 0.03


def test_temperature_sharpens_distribution():
    logits = torch.tensor([[0.0, 1.0]])
    info = make_info(
        [SamplingParams(temperature=0.25)], vocab_size=2, generators=[make_generator(7)]
    )
    ones = sum(int(Sampler()(logits, info).next_token_ids[0]) for _ in range(2000))
    expected = torch.softmax(logits / 0.25, -1)[0, 1].item()  # 0.982
    assert abs(ones / 2000 - expected) < 0.02


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_hf_style():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    info = make_info([SamplingParams(temperature=0, repetition_penalty=2.0)], vocab_size=5)
    processed = Sampler._process_logits(logits, info, [[1]], [[0, 3]], None, [1])
    # seen tokens 0 (prompt), 1 (output), 3 (prompt): positive / 2, negative * 2
    assert torch.allclose(processed, torch.tensor([[1.0, -4.0, 1.0, -2.0, 0.5]]))
    assert torch.equal(logits, torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]]))  # input untouched
    out = Sampler()(logits, info, [[1]], [[0, 3]])
    assert out.next_token_ids.tolist() == [0]  # ties between 0 and 2 go to the first


def test_logit_bias_is_added_per_row():
    logits = torch.zeros(2, 4)
    params = [SamplingParams(temperature=0, logit_bias={"2": 5.0, "0": -100}).normalized(),
              SamplingParams(temperature=0)]
    info = make_info(params, vocab_size=4)
    processed = Sampler._process_logits(logits, info, [[], []], None, None, [0, 0])
    assert torch.equal(processed, torch.tensor([[-100.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert Sampler()(logits, info).next_token_ids.tolist() == [2, 0]


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    info = make_info([SamplingParams(temperature=0, repetition_penalty=2.0)], vocab_size=3)
    assert Sampler()(logits, info, [[0]]).next_token_ids.tolist() == [1]


def test_frequency_and_presence_penalties_openai_style():
    logits = torch.zeros(2, 4)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=-1.0),
    ]
    info = make_info(params, vocab_size=4)
    output_ids = [[1, 1, 1, 2], [3]]
    # prompt tokens do not count for OpenAI-style penalties
    processed = Sampler._process_logits(logits, info, output_ids, [[0, 0], [0]], None, [4, 1])
    expected = torch.tensor([[0.0, -1.75, -0.75, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(processed, expected)


def test_penalty_rows_are_independent():
    logits = random_logits(2)
    params = [SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0)]
    processed = Sampler._process_logits(
        logits, make_info(params), [[0, 1], [0, 1]], None, None, [2, 2]
    )
    assert torch.equal(processed[1], logits[1])
    assert torch.allclose(processed[0, :2], logits[0, :2] - 2.0)


# ---------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_blocks_eos_and_stop_ids():
    eos, stop = 5, 7
    logits = torch.zeros(1, VOCAB)
    logits[0, eos] = 10.0
    logits[0, stop] = 9.0
    params = SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[stop])
    info = make_info([params])
    for generated in range(3):
        out = Sampler()(logits, info, [[1] * generated], eos_ids_list=[[eos]])
        assert out.next_token_ids.item() not in (eos, stop)
    out = Sampler()(logits, info, [[1] * 3], eos_ids_list=[[eos]])
    assert out.next_token_ids.item() == eos


def test_min_new_tokens_only_on_its_row():
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 5.0
    params = [SamplingParams(temperature=0, min_new_tokens=4), SamplingParams(temperature=0)]
    out = Sampler()(logits, make_info(params), [[], []], eos_ids_list=[[2], [2]])
    assert out.next_token_ids[0] != 2 and out.next_token_ids[1] == 2


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_unfiltered_temperature_one():
    logits = random_logits(3, seed=9)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.3, top_k=2),
        SamplingParams(top_p=0.1),
    ]
    out = Sampler()(logits, make_info(params), top_logprobs_num=3)
    full = torch.log_softmax(logits, -1)
    expected = full.gather(1, out.next_token_ids.view(-1, 1)).squeeze(1)
    assert torch.allclose(out.logprobs, expected, atol=1e-5)
    assert out.top_logprobs is not None
    values, ids = full.topk(3, dim=-1)
    assert torch.allclose(out.top_logprobs.top_values, values, atol=1e-5)
    assert torch.equal(out.top_logprobs.top_ids, ids)


def test_logprobs_follow_penalties():
    logits = torch.tensor([[1.0, 1.0]])
    info = make_info([SamplingParams(temperature=0, presence_penalty=1.0)], vocab_size=2)
    out = Sampler()(logits, info, [[0]])
    assert out.next_token_ids.item() == 1
    assert out.logprobs.item() == pytest.approx(
        torch.log_softmax(torch.tensor([0.0, 1.0]), -1)[1].item()
    )
    assert out.top_logprobs is None


def test_compute_logprobs_prompt_positions():
    logits = random_logits(6, seed=4)
    token_ids = torch.tensor([3, 1, 4, 1, 5, 9])
    result = compute_logprobs(logits, token_ids, top_logprobs_num=0)
    expected = torch.log_softmax(logits, -1)[torch.arange(6), token_ids]
    assert torch.allclose(result.logprobs, expected, atol=1e-5)
    assert result.top_values is None and result.top_ids is None


def test_n_is_bounded():
    from arborlm.errors import InvalidRequestError
    from arborlm.sampling_params import MAX_N

    SamplingParams(n=MAX_N).verify(49152)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(n=1_000_000).verify(49152)
    assert err.value.param == "n"


def test_chosen_logprob_equals_its_top_logprobs_entry():
    """The chosen token's logprob and its entry in the top list come from one computation."""
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3)) * 7
    chosen = logits.argmax(-1)
    out = compute_logprobs(logits, chosen, top_logprobs_num=3)
    assert torch.equal(out.top_ids[:, 0], chosen)
    assert torch.equal(out.logprobs, out.top_values[:, 0])
    alone = compute_logprobs(logits, chosen)
    torch.testing.assert_close(alone.logprobs, out.logprobs)


# ---------------------------------------------------------------- one row must not poison the batch


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6, 5e-324])
def test_underflowing_temperature_is_greedy(temperature):
    """A positive temperature that underflows float32 samples greedily (SGLang's and vLLM's eps)."""
    params = SamplingParams(temperature=temperature)
    params.verify(VOCAB)
    assert params.is_greedy
    logits = random_logits(3)
    out = Sampler()(logits, make_info([params, SamplingParams(), params]))
    assert out.invalid_rows == ()
    assert out.next_token_ids[0] == logits[0].argmax() and out.next_token_ids[2] == logits[2].argmax()
    assert torch.isfinite(out.logprobs).all()


@pytest.mark.parametrize("penalty", [1e-30, 1e-9, 1e30])
def test_extreme_repetition_penalty_is_clamped_and_finite(penalty):
    params = SamplingParams(repetition_penalty=penalty, temperature=0.7, seed=1)
    params.verify(VOCAB)
    logits = random_logits(2) * 10
    out = Sampler()(logits, make_info([params, SamplingParams()]), output_ids_list=[[0, 1, 2, 3], [4]])
    assert out.invalid_rows == ()
    assert torch.isfinite(out.logprobs).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_row_is_flagged_alone(poison):
    """A row with NaN/inf logits is reported in `invalid_rows`; the other rows sample as without it."""
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=0.8, seed=8), SamplingParams()]
    clean = Sampler()(logits.clone(), make_info(params, seeds=[7, 8, 9]))
    poisoned = logits.clone()
    poisoned[1, 5] = poison
    out = Sampler()(poisoned, make_info(params, seeds=[7, 8, 9]))
    assert out.invalid_rows == (1,)
    assert out.next_token_ids[0] == clean.next_token_ids[0] and out.next_token_ids[2] == clean.next_token_ids[2]


def test_a_fully_masked_row_is_flagged_alone():
    logits = random_logits(2)
    logits[0] = float("-inf")
    out = Sampler()(logits, make_info([SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0)]))
    assert out.invalid_rows == (0,)
    assert out.next_token_ids[1] == logits[1].argmax()


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's test at p = 0.001 over bins expecting >= 5 draws (the rest pooled)."""
    total = int(counts.sum())
    expected = probs / probs.sum() * total
    big = expected >= 5
    stat = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    dof = int(big.sum()) - 1
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        dof += 1
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # Wilson-Hilferty
    return stat < critical


@pytest.mark.parametrize("vocab", [600, 49152])  # 600: a last block of the two-level CDF padded
def test_sample_from_probs_follows_the_distribution(vocab):
    """Draws follow probs / probs.sum() (chi-square), never a zero-probability token (the
    zeros sit at block edges and inside blocks), and each row's draw is the same alone and
    in a batch (its own generator)."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(vocab, generator=gen) ** 4
    probs[::7] = 0.0
    probs[255:257] = 0.0
    probs[-1] = 0.0
    probs[:40] *= 30  # most of the mass in the first block: its edges are sampled often
    draws = 20000
    tokens = sample_from_probs(probs.expand(draws, vocab), [make_generator(s) for s in range(draws)])
    assert bool((probs[tokens] > 0).all())
    assert _chi_square_ok(torch.bincount(tokens, minlength=vocab).double()[probs > 0], probs[probs > 0].double())
    alone = [int(sample_from_probs(probs[None], [make_generator(s)])[0]) for s in range(50)]
    assert alone == tokens[:50].tolist()


def test_sample_from_probs_of_a_single_token_and_unnormalised_rows():
    probs = torch.zeros(3, 1000)
    probs[0, 999] = 1e-30  # the only token, at the very end
    probs[1, 0] = 5.0
    probs[2, 512] = 2.0
    probs[2, 513] = 2.0
    out = sample_from_probs(probs, [make_generator(s) for s in range(3)]).tolist()
    assert out[0] == 999 and out[1] == 0 and out[2] in (512, 513)


@pytest.mark.parametrize("shape", ["peaked", "medium", "flat", "ties", "few_positive"])
def test_filter_probs_candidates_equal_the_whole_sort(shape):
    """The `topk` candidates path keeps exactly the tokens a stable sort of each whole row keeps:
    rows whose kept prefix reaches past the first candidates (flat rows, a top-k above them, ties
    at the edge) try more candidates or are sorted whole, the others are filtered among the
    candidates. Rows no filter touches pass through unchanged (the whole sort's top-p of 1.0
    dropped tail tokens where float32 cumulative sums passed the total)."""
    from arborlm.runtime.sampling_filters import FILTER_CANDIDATES, _filter_sorted

    vocab = 16384
    first = FILTER_CANDIDATES[0]
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=40),
              SamplingParams(temperature=0.8, top_k=first + 44, top_p=0.95),
              SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=first, top_p=0.999),
              SamplingParams(temperature=1.0, top_k=5000, top_p=0.99),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    active = 7
    info = SamplingBatchInfo.from_params([p.normalized() for p in params], list(range(len(params))), vocab)
    scale = {"peaked": 6.0, "medium": 1.0, "flat": 0.05, "ties": 3.0, "few_positive": 1.0}[shape]
    for seed in range(5):
        logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * scale
        if shape == "ties":  # many equal values, some at the candidates' edge
            logits = logits.round()
        probs = torch.softmax(logits, dim=-1)
        if shape == "few_positive":
            probs[:, 100:] = 0.0
        fast = filter_probs(probs, info)
        assert torch.equal(fast[:active], _filter_sorted(probs, info)[:active]), f"seed {seed}"
        assert torch.equal(fast[active:], probs[active:])


@pytest.mark.parametrize("logit_bias, names", [
    ({"7": 1, "-1": 2}, "'-1'"),
    ({"abc": 2}, "'abc'"),
    ({"5": float("nan")}, "logit_bias['5']"),
    ({"5": "x"}, "logit_bias['5']"),
])
def test_a_bad_logit_bias_entry_is_named(logit_bias, names):
    """The message points at the entry that is wrong, not only at the field."""
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(logit_bias=logit_bias).verify(VOCAB)
    assert excinfo.value.param == "logit_bias" and names in str(excinfo.value)


def test_a_requests_prompt_array_is_built_once_and_equals_its_prompt():
    from arborlm.runtime.schedule_batch import Req

    req = Req(rid="r", origin_input_ids=[3, 1, 4, 1, 5], sampling_params=SamplingParams(), seed=0)
    first = req.prompt_id_array()
    assert list(first) == [3, 1, 4, 1, 5] and req.prompt_id_array() is first
    wide = Req(rid="w", origin_input_ids=[1, 2**40], sampling_params=SamplingParams(), seed=0)
    assert wide.prompt_id_array() == [1, 2**40]  # an id past int32: the list itself
