"""The same greedy request gets the same tokens alone, under load, chunked, cache warm or cold.

The default model served as stored (Q4_1 GGUF) in float32: its linears take the int8
kernel, whose rows do not depend on each other, and every attention row on the CPU
path is a decode row (`TorchAttentionBackend`). Before that, 5 of 40 concurrent copies
of these requests answered differently from the same request sent alone (11 of 40 with
the radix cache off). `tests/runtime/test_batch_invariance.py` checks the logits bit
for bit on tiny models.
"""

from __future__ import annotations

import pytest

import arborlm as sgl

pytestmark = pytest.mark.smollm

SYSTEM = " ".join(["You are a careful assistant for a logistics company."] * 30)
QUESTIONS = ["Where is my parcel?", "How do I return an item?", "What are your opening hours?"]
PARAMS = {"temperature": 0, "max_new_tokens": 48}
COPIES = 4


def _prompts(engine) -> list[str]:
    return [engine.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def alone():
    """Each question sent alone to a fresh engine (the cache cold for the first), then the
    same questions as concurrent copies on the same engine (every prompt cached now, mixed
    steps of prefills and decodes)."""
    engine = sgl.Engine(dtype="float32", log_level="warning")
    try:
        prompts = _prompts(engine)
        single = [engine.generate(p, PARAMS)["output_ids"] for p in prompts]
        batch = [p for p in prompts for _ in range(COPIES)]
        concurrent = [o["output_ids"] for o in engine.generate(batch, [PARAMS] * len(batch))]
        cached = [o["meta_info"]["cached_tokens"] for o in engine.generate(prompts, [PARAMS] * len(prompts))]
    finally:
        engine.shutdown()
    return single, concurrent, cached


def test_concurrent_copies_answer_as_the_request_alone(alone):
    single, concurrent, cached = alone
    assert all(n > 0 for n in cached)  # the copies did read the radix cache
    assert concurrent == [out for out in single for _ in range(COPIES)]


def test_a_cold_chunked_server_answers_the_same(alone):
    """No radix cache, prompts cut into prefill chunks of 64 tokens, all copies at once."""
    single, _, _ = alone
    engine = sgl.Engine(dtype="float32", log_level="warning", disable_radix_cache=True, chunked_prefill_size=64)
    try:
        batch = [p for p in _prompts(engine) for _ in range(2)]
        outs = [o["output_ids"] for o in engine.generate(batch, [PARAMS] * len(batch))]
    finally:
        engine.shutdown()
    assert outs == [out for out in single for _ in range(2)]


def test_bf16_copies_prefilled_together_answer_as_the_request_alone():
    """bf16 activations: a prefill of many prompts (hundreds of rows) takes the int8 kernel
    as a prompt alone does. Before, past 64 rows it dequantized the weights for oneDNN's
    bf16 GEMM, which rounds differently: 0 of 8 chat prompts in a batch of 32 answered as
    alone (the first token already differed)."""
    from arborlm.kernels import cpu_ops

    if cpu_ops.cpu_has_amx():
        pytest.skip("on AMX CPUs bf16 prefills take the AMX GEMM and extend-attention kernels, which round "
                    "differently from decode steps: bf16 answers there can still depend on the batch "
                    "(float32 ones do not, tested above)")
    engine = sgl.Engine(dtype="bfloat16", log_level="warning", disable_radix_cache=True)
    try:
        prompts = _prompts(engine)
        single = [engine.generate(p, PARAMS)["output_ids"] for p in prompts]
        batch = [p for p in prompts for _ in range(COPIES)]
        together = [o["output_ids"] for o in engine.generate(batch, [PARAMS] * len(batch))]
    finally:
        engine.shutdown()
    assert together == [out for out in single for _ in range(COPIES)]
