"""Verify steps as decode rows (`ForwardMode.TARGET_VERIFY`, `speculative/verify_batch.py`).

Oracles: the extend chains the scheduler builds (the fallback layout) on the tiny
float32 Llama, within float32 rounding; sequential decode steps of one token
each, bit for bit, on the native bfloat16 path (fused decoder layer at up to 8
rows, the unfused modules beyond) and on the default model as served (bfloat16,
its Q4_1 GGUF weights). Then greedy NGRAM output in bfloat16 on the default
model equals speculation off token for token, which the extend chains did not
give (docs/speculative.md).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arborlm.radix_cache.memory_pool import KV_CACHE_DTYPES
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode
from arborlm.runtime.model_loader import load_model, resolve_quantization
from arborlm.runtime.speculative.scheduling import build_verify_batch, verify_num_tokens
from arborlm.runtime.speculative.verify_batch import uses_verify_rows, verify_rows
from tests.runtime.model_helpers import ModelHarness
from tests.runtime.scheduler_helpers import create_scheduler, make_req, run_to_completion

CPU = torch.device("cpu")
PROMPT_LENS = (37, 5, 64)


def _prefilled(model, config, dtype, prompt_lens=PROMPT_LENS, seed=0):
    """A harness whose requests have prefilled ragged prompts and taken one token each;
    returns it and stand-ins for the `Req`s (`output_ids`, `kv_len`, `seqlen`, `req_pool_idx`)."""
    gen = torch.Generator().manual_seed(seed)
    harness = ModelHarness(model, config, dtype=dtype)
    prompts = [torch.randint(100, 4000, (n,), generator=gen).tolist() for n in prompt_lens]
    rows = [harness.new_req() for _ in prompts]
    last = harness.extend(rows, prompts).next_token_logits.argmax(-1).tolist()
    reqs = [SimpleNamespace(output_ids=[t], kv_len=harness.seq_lens[r], seqlen=harness.seq_lens[r] + 1, req_pool_idx=r)
            for r, t in zip(rows, last)]
    return harness, reqs


def _chains(harness, reqs, drafts) -> ForwardBatch:
    out_cache_loc = harness.allocator.alloc(verify_num_tokens(reqs, drafts))
    return build_verify_batch(reqs, drafts, harness.req_to_token_pool, harness.token_to_kv_pool, out_cache_loc)


def _sequential_decode(harness, reqs, drafts, chains: ForwardBatch) -> torch.Tensor:
    """Each chain as decode steps of one token of one request (speculation off at batch 1),
    into the chain's own slots: (rows, V) float32 in the chains' row order."""
    out, offset = [], 0
    for req, draft in zip(reqs, drafts):
        for j, token in enumerate([req.output_ids[-1], *draft]):
            step = ForwardBatch.build(
                ForwardMode.DECODE, [token], [req.req_pool_idx], [req.kv_len + j], [1],
                chains.out_cache_loc[offset + j : offset + j + 1], harness.req_to_token_pool,
                harness.token_to_kv_pool,
            )
            out.append(harness.model.forward(step).next_token_logits)
        offset += 1 + len(draft)
    return torch.cat(out)


def test_verify_rows_layout(tiny_llama_dir):
    """One row per chain token: the request's row repeated, positions and lengths per token."""
    loaded = load_model(tiny_llama_dir, torch.float32, CPU)
    harness, reqs = _prefilled(loaded.model, loaded.hf_config, torch.float32, prompt_lens=(4, 9))
    chains = _chains(harness, reqs, [[11, 12], []])
    rows = verify_rows(chains)
    assert rows.forward_mode is ForwardMode.TARGET_VERIFY and rows.forward_mode.is_decode()
    assert rows.batch_size == 4 and rows.return_full_logits
    assert rows.input_ids.tolist() == [reqs[0].output_ids[-1], 11, 12, reqs[1].output_ids[-1]]
    assert rows.positions.tolist() == [4, 5, 6, 9]
    assert rows.seq_lens.tolist() == rows.seq_lens_cpu == [5, 6, 7, 10]
    r0, r1 = reqs[0].req_pool_idx, reqs[1].req_pool_idx
    assert rows.req_pool_indices.tolist() == [r0, r0, r0, r1]
    assert torch.equal(rows.out_cache_loc, chains.out_cache_loc)
    assert rows.extend_prefix_lens_cpu == [4, 5, 6, 9] and rows.extend_seq_lens_cpu == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="chains"):
        verify_rows(rows)


@pytest.mark.parametrize("backend,cpu_kernels", [("torch", True), ("torch", False), ("reference", True)])
def test_rows_equal_the_extend_chains_in_float32(tiny_llama_dir, backend, cpu_kernels):
    """Full logits of every chain row as decode rows equal the extend chains' within float32
    rounding, and the K/V the rows stored are the chains' (native kernels, torch fallback,
    reference backend)."""
    loaded = load_model(tiny_llama_dir, torch.float32, CPU, attention_backend=backend, cpu_kernels=cpu_kernels)
    assert uses_verify_rows(loaded.model)
    harness, reqs = _prefilled(loaded.model, loaded.hf_config, torch.float32)
    drafts = [[101, 102, 103, 104, 105, 106], [], [7, 8, 9]]
    chains = _chains(harness, reqs, drafts)
    want = loaded.model.forward(chains).full_logits
    k_want = harness.token_to_kv_pool.k_buffer[:, chains.out_cache_loc].clone()
    got = loaded.model.forward(verify_rows(chains)).full_logits
    assert got.shape == want.shape == (12, loaded.hf_config.vocab_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(harness.token_to_kv_pool.k_buffer[:, chains.out_cache_loc], k_want,
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("drafts", [
    [[101, 102, 103, 104, 105, 106]],  # 7 rows: the fused decoder layer
    [[101, 102, 103, 104, 105, 106], [], [7, 8, 9]],  # 11 rows: the unfused native modules
])
def test_rows_equal_sequential_decode_bitwise_in_bfloat16(tiny_llama_dir, drafts):
    """bf16 verify rows give exactly the logits of the decode steps speculation off would run."""
    loaded = load_model(tiny_llama_dir, torch.bfloat16, CPU)
    harness, reqs = _prefilled(loaded.model, loaded.hf_config, torch.bfloat16, PROMPT_LENS[: len(drafts)])
    chains = _chains(harness, reqs, drafts)
    got = loaded.model.forward(verify_rows(chains)).full_logits
    want = _sequential_decode(harness, reqs, drafts, chains)
    assert torch.equal(got, want)


def test_rows_equal_sequential_decode_bitwise_on_the_default_model(smollm_dir):
    """The same on SmolLM2 as served by default: bfloat16 over its Q4_1 GGUF weights."""
    gguf_file = resolve_quantization(None, None)
    loaded = load_model(smollm_dir, torch.bfloat16, CPU, gguf_file=gguf_file, quantization="gguf")
    assert uses_verify_rows(loaded.model)
    harness, reqs = _prefilled(loaded.model, loaded.hf_config, torch.bfloat16, prompt_lens=(40, 23))
    drafts = [[504, 3458, 2496, 28, 253, 1432], [330, 281]]
    chains = _chains(harness, reqs, drafts)
    got = loaded.model.forward(verify_rows(chains)).full_logits
    want = _sequential_decode(harness, reqs, drafts, chains)
    assert torch.equal(got, want)


def test_verifier_refuses_logits_without_a_row_per_chain_token():
    from arborlm.runtime.speculative.verify import DraftVerifier

    verifier = DraftVerifier(8, lambda req: [])
    reqs = [SimpleNamespace(rid="r")]
    with pytest.raises(ValueError, match="full_logits"):
        verifier.verify(reqs, [[1, 2]], torch.zeros(2, 8))
    with pytest.raises(ValueError, match="full_logits"):
        verifier.verify(reqs, [[1, 2]], None)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "int8"])
def test_rows_over_a_one_byte_kv_pool_equal_the_extend_chains(tiny_llama_dir, kv_cache_dtype):
    """With the native kernels a one-byte KV pool is read in place, so verify steps take
    decode rows: their logits equal the extend chains' (which read the same stored K/V
    upcast) within float32 rounding."""
    loaded = load_model(tiny_llama_dir, torch.float32, CPU, kv_cache_dtype=kv_cache_dtype)
    assert uses_verify_rows(loaded.model)
    harness, reqs = _prefilled(loaded.model, loaded.hf_config, KV_CACHE_DTYPES[kv_cache_dtype])
    assert harness.token_to_kv_pool.quantized
    drafts = [[101, 102, 103, 104, 105, 106], [], [7, 8, 9]]
    chains = _chains(harness, reqs, drafts)
    want = loaded.model.forward(chains).full_logits
    got = loaded.model.forward(verify_rows(chains)).full_logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_upcast_copies_and_triton_keep_the_extend_chains(tiny_llama_dir):
    """The backends whose decode path does not take verify rows keep the chains: a one-byte
    KV pool without the native kernels (each row would gather its upcast copy), Triton."""
    fp8 = load_model(tiny_llama_dir, torch.float32, CPU, kv_cache_dtype="fp8_e5m2", cpu_kernels=False)
    assert not uses_verify_rows(fp8.model)
    from arborlm.runtime.layers.attention.triton_backend import TritonAttentionBackend

    assert not TritonAttentionBackend.takes_verify_rows


# Prompts of bench_spec.py's batch-1 copy and chat cells, on which the extend chains'
# bfloat16 rounding made greedy NGRAM output leave speculation off's within 64 tokens.
PROMPTS = (
    "Repeat the following passage word for word.\n\nContinuous batching lets new requests join the running "
    "batch between two decode steps. The scheduler prefers requests whose prompts share the longest cached "
    "prefix. The radix cache keeps every prompt prefix it has seen, so a second call with the same system "
    "prompt starts at once.",
    "Why do cats purr?",
)


def test_bfloat16_greedy_ngram_equals_speculation_off_on_the_default_model(smollm_dir):
    """Default serving where the CPU has bf16 (asked for here on any CPU; GGUF weights):
    greedy NGRAM gives the tokens speculation off gives, token for token, with drafts accepted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    # The cost-aware switch off: every draft found is verified, whatever this machine's step times.
    sched = create_scheduler(smollm_dir, tok, model=None, dtype="bfloat16", speculative_algorithm="NGRAM",
                             speculative_adaptive=False, max_total_tokens=2048)
    assert sched.worker.model_runner.dtype == torch.bfloat16 and sched.worker.verify_as_rows
    speculator = sched.speculator
    for text in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False))
        sched.speculator = None
        assert sched.flush_cache()
        off = run_to_completion(sched, [make_req("r", ids, max_new_tokens=64)])
        sched.speculator = speculator
        assert sched.flush_cache()
        on = run_to_completion(sched, [make_req("r", ids, max_new_tokens=64)])
        assert on.tokens == off.tokens, text
        # The copy prompt's output quotes its passage: drafts are accepted there on any CPU;
        # whether the chat answer repeats itself depends on the kernels' rounding.
        assert on.steps < off.steps if text is PROMPTS[0] else on.steps <= off.steps
    assert sched.get_info()["spec_num_accepted_tokens"] > 0


def test_verify_rows_travel_to_other_tensor_parallel_ranks(tiny_llama_dir):
    """What rank 0 broadcasts of a TARGET_VERIFY step (`ForwardStep`, pickled) rebuilds the
    same rows on another rank's pools (its req_to_token written from the message, a request's
    row repeated), and that rank's forward gives rank 0's logits. (The Engine with tp_size=2
    and NGRAM equals one rank without speculation as well; too slow to run here each time.)"""
    import pickle

    from arborlm.runtime.distributed.step_sync import ForwardStep

    loaded = load_model(tiny_llama_dir, torch.float32, CPU)
    harness, reqs = _prefilled(loaded.model, loaded.hf_config, torch.float32, prompt_lens=(9, 20))
    rows = verify_rows(_chains(harness, reqs, [[5, 6, 7], [8]]))
    other = ModelHarness(loaded.model, loaded.hf_config)
    other.token_to_kv_pool.k_buffer.copy_(harness.token_to_kv_pool.k_buffer)
    other.token_to_kv_pool.v_buffer.copy_(harness.token_to_kv_pool.v_buffer)
    message = pickle.loads(pickle.dumps(ForwardStep.from_batch(rows)))
    rebuilt = message.to_batch(other.req_to_token_pool, other.token_to_kv_pool)
    assert rebuilt.forward_mode is ForwardMode.TARGET_VERIFY and rebuilt.batch_size == 6
    assert rebuilt.seq_lens_cpu == rows.seq_lens_cpu and torch.equal(rebuilt.req_pool_indices, rows.req_pool_indices)
    for r in set(rows.req_pool_indices.tolist()):
        n = max(rows.seq_lens_cpu)
        assert torch.equal(other.req_to_token_pool.req_to_token[r, :n], harness.req_to_token_pool.req_to_token[r, :n])
    want = loaded.model.forward(rows).full_logits
    assert torch.equal(loaded.model.forward(rebuilt).full_logits, want)


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_ngram_over_a_quantized_kv_pool(tiny_llama_dir, tiny_tokenizer, cpu_kernels):
    """With an fp8 KV pool the worker verifies in decode rows where the native kernels read
    the pool in place, and keeps the extend chains without them; either way greedy NGRAM
    output equals speculation off (float32 activations), pools whole after every step."""
    from tests.runtime.speculative.test_spec_model import copy_prompts

    sched = create_scheduler(tiny_llama_dir, tiny_tokenizer, kv_cache_dtype="fp8_e5m2", disable_cpu_kernels=not cpu_kernels,
                             speculative_algorithm="NGRAM", speculative_adaptive=False)
    assert sched.worker.verify_as_rows == cpu_kernels
    prompts = copy_prompts(3, seed=5)

    def reqs():
        return [make_req(f"r{i}", p, max_new_tokens=20, ignore_eos=True) for i, p in enumerate(prompts)]

    speculator, sched.speculator = sched.speculator, None
    off = run_to_completion(sched, reqs())
    sched.speculator = speculator
    assert sched.flush_cache()
    on = run_to_completion(sched, reqs())
    assert on.tokens == off.tokens
    assert sched.get_info()["spec_num_accepted_tokens"] > 0


def test_draft_rows_skip_the_forced_tokens_of_a_chain():
    from arborlm.runtime.speculative.verify_batch import draft_rows

    # Chains without forced tokens: every row scores a draft position.
    assert draft_rows([1, 3, 2], [[], [5, 6], [7]]) is None
    # A jump's chain of 1 + 3 forced tokens + 2 drafts: its first 3 rows only store K/V.
    assert draft_rows([3, 6, 1], [[5, 6], [8, 9], []]) == [0, 1, 2, 6, 7, 8, 9]
    assert draft_rows([4], [[]]) == [3]
