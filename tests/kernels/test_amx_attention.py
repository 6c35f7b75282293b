"""The AMX extend (prefill) attention of the native CPU kernels against `reference.extend_attention`.

Steps mix long prompts, short extends over a cached prefix and one-token requests
(decode tokens riding along a prefill), over a pool whose slots are shuffled (K/V
are read through `req_to_token`, as the scheduler lays them out). The kernel rounds
the probabilities to bf16 before they weigh V, so outputs are compared with the
float32 oracle within bf16 tolerance. Skipped where the CPU or compiler has no AMX.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.kernels import reference
from arborlm.kernels.cpu_ops import NativeLayerOps

# (prefix, new) tokens per request of a step
STEPS = {
    "one-prompt": [(0, 70)],
    "shared-prefix": [(180, 54), (180, 53), (180, 1), (180, 55)],
    "riders": [(40, 1), (0, 33), (7, 1), (300, 1)],
    "long": [(0, 260), (31, 97)],
}


@pytest.fixture(scope="module")
def ops(amx_ops) -> NativeLayerOps:
    return amx_ops


def make_step(lens, q_heads, kv_heads, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    seq_lens = torch.tensor([p + n for p, n in lens], dtype=torch.int64)
    extend = torch.tensor([n for _, n in lens], dtype=torch.int64)
    slots = int(seq_lens.sum()) + 17
    k_buffer = torch.randn(slots, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_buffer = torch.randn(slots, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(slots - 1, generator=gen) + 1  # slot 0 stays unused, as in the pool
    req_to_token = torch.zeros(batch + 2, int(seq_lens.max()) + 8, dtype=torch.int32)
    rows = torch.tensor([2 + i if i % 2 else i for i in range(batch)], dtype=torch.int64)  # not 0..batch-1
    at = 0
    for i, n in enumerate(seq_lens.tolist()):
        req_to_token[rows[i], :n] = perm[at:at + n].to(torch.int32)
        at += n
    q = torch.randn(int(extend.sum()), q_heads, head_dim, generator=gen).to(torch.bfloat16)
    starts = torch.cumsum(extend, 0) - extend
    return q, k_buffer, v_buffer, req_to_token, rows, seq_lens, seq_lens - extend, extend, starts


def check(ops, step, scale, window=None, cap=0.0):
    q, k_buffer, v_buffer, req_to_token, rows, seq_lens, prefix, extend, starts = step
    assert ops.can_extend(q, k_buffer, v_buffer, req_to_token)
    out = ops.extend_attention(q, k_buffer, v_buffer, req_to_token, rows, seq_lens, extend, starts, scale, window, cap)
    expected = reference.extend_attention(
        q.float(), k_buffer.float(), v_buffer.float(), req_to_token, rows, seq_lens, prefix, extend, scale, window, cap
    )
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1), (32, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference(ops, step, heads, head_dim):
    check(ops, make_step(STEPS[step], *heads, head_dim), head_dim ** -0.5)


@pytest.mark.parametrize("window", [1, 16, 45, 100])
def test_sliding_window(ops, window):
    check(ops, make_step(STEPS["shared-prefix"] + STEPS["riders"], 9, 3, 64, seed=1), 0.125, window=window)


def test_logit_cap(ops):
    check(ops, make_step(STEPS["riders"], 9, 3, 64, seed=2), 1.0, cap=5.0)


def test_refused_layouts(ops):
    q, k_buffer, v_buffer, req_to_token, *_ = make_step(STEPS["riders"], 9, 3, 64)
    assert not ops.can_extend(q.float(), k_buffer.float(), v_buffer.float(), req_to_token)  # float32
    q80 = torch.zeros(q.shape[0], 9, 80, dtype=torch.bfloat16)
    kv80 = torch.zeros(k_buffer.shape[0], 3, 80, dtype=torch.bfloat16)
    assert not ops.can_extend(q80, kv80, kv80, req_to_token)  # head_dim not a multiple of 32
    q_many = torch.zeros(q.shape[0], 33, 64, dtype=torch.bfloat16)
    assert not ops.can_extend(q_many, k_buffer[:, :1], v_buffer[:, :1], req_to_token)  # 33 heads per KV head
    assert not ops.can_extend(q, k_buffer, v_buffer, req_to_token.to(torch.int64))


def test_the_default_model_generates_the_same_tokens_as_with_sdpa(ops, smollm_dir, tiny_tokenizer, monkeypatch):
    """SmolLM2-135M in bf16, continuous batching with a shared system prompt: prefills
    on the AMX kernel give the same greedy tokens as prefills on torch's SDPA."""
    from tests.runtime.scheduler_helpers import create_scheduler, make_req, run_to_completion

    system = tiny_tokenizer.encode("You are a helpful assistant who answers questions about geography briefly.")
    questions = ["What is the capital of France?", "Name a river in Egypt.", "Which ocean is the largest?",
                 "Where is Mount Fuji?", "What language is spoken in Brazil?"]

    def generate() -> dict[str, list[int]]:
        scheduler = create_scheduler(smollm_dir, tiny_tokenizer, dtype="bfloat16")
        reqs = [make_req(f"q{i}", system + tiny_tokenizer.encode(" " + text), max_new_tokens=12, ignore_eos=True)
                for i, text in enumerate(questions)]
        return run_to_completion(scheduler, reqs).tokens

    calls = []
    extend = NativeLayerOps.extend_attention
    monkeypatch.setattr(NativeLayerOps, "extend_attention", lambda self, *a, **k: calls.append(1) or extend(self, *a, **k))
    with_amx = generate()
    assert calls, "the prefills did not take the AMX kernel"
    monkeypatch.setattr(NativeLayerOps, "can_extend", lambda self, *a: False)
    calls.clear()
    with_sdpa = generate()
    assert not calls
    assert with_amx == with_sdpa and all(len(t) == 12 for t in with_amx.values())
