"""benchmarks/bench_perplexity.py on a tiny random Llama: its windowed perplexity through the model
runner is transformers' exp(cross-entropy) on the same windows, and its re-quantized variant
serves every linear layer from packed ggml blocks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("gguf")

from arborlm.runtime.layers.linear import Linear  # noqa: E402
from arborlm.runtime.layers.quantization.quant_linear import QuantizedLinear  # noqa: E402
from benchmarks import bench_perplexity  # noqa: E402
from tests.runtime.family_helpers import tiny_checkpoint  # noqa: E402

WINDOWS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6], [200, 1, 2, 64, 9], [7, 7]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppl_llama")
    return folder, tiny_checkpoint(folder, "llama")


def test_perplexity_is_exp_cross_entropy(tiny):
    folder, reference = tiny
    ppl, scored = bench_perplexity.perplexity(bench_perplexity.runner_for("none", str(folder), "float32"), WINDOWS)
    with torch.no_grad():
        nll = sum(float(F.cross_entropy(reference(torch.tensor([w])).logits[0, :-1], torch.tensor(w[1:]),
                                        reduction="sum")) for w in WINDOWS)
    assert scored == sum(len(w) - 1 for w in WINDOWS)
    assert ppl == pytest.approx(math.exp(nll / scored), rel=1e-4)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_windows_score_the_same_text(tiny, chunk):
    """Extend steps of `chunk` tokens over the cached prefix give the one-prefill perplexity
    (float32, same weights: within rounding) and leave the pools as they were."""
    folder, _ = tiny
    runner = bench_perplexity.runner_for("none", str(folder), "float32")
    free_rows, free_slots = runner.req_to_token_pool.available_size(), runner.token_to_kv_pool_allocator.available_size()
    whole, scored = bench_perplexity.perplexity(runner, WINDOWS)
    chunked, scored_chunked = bench_perplexity.perplexity(runner, WINDOWS, chunk)
    assert scored_chunked == scored and chunked == pytest.approx(whole, rel=1e-5)
    assert runner.req_to_token_pool.available_size() == free_rows
    assert runner.token_to_kv_pool_allocator.available_size() == free_slots


def test_requantized_variant_serves_packed_blocks(tiny):
    folder, _ = tiny
    runner = bench_perplexity.runner_for("gguf-q8_0", str(folder), "float32")
    assert not any(isinstance(m, Linear) for m in runner.model.modules())
    assert {w.fmt for m in runner.model.modules() if isinstance(m, QuantizedLinear) for w in m.weights} == {"q8_0"}
    plain = bench_perplexity.runner_for("none", str(folder), "float32")
    q8, base = (bench_perplexity.perplexity(r, WINDOWS)[0] for r in (runner, plain))
    assert q8 == pytest.approx(base, rel=0.01) and q8 != base


def test_greedy_tokens_match_the_model_and_free_the_pools(tiny):
    folder, reference = tiny
    runner = bench_perplexity.runner_for("none", str(folder), "float32")
    free_rows, free_slots = runner.req_to_token_pool.available_size(), runner.token_to_kv_pool_allocator.available_size()
    prompts = [WINDOWS[0], WINDOWS[1]]
    tokens = bench_perplexity.greedy_tokens(runner, prompts, 6)
    for prompt, got in zip(prompts, tokens):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got == ids[len(prompt):]
    assert runner.req_to_token_pool.available_size() == free_rows
    assert runner.token_to_kv_pool_allocator.available_size() == free_slots
    assert bench_perplexity.agreement(tokens, tokens) == 1.0
    assert bench_perplexity.agreement([[1, 2]], [[1, 3]]) == 0.5
