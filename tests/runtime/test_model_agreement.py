"""Our Llama-family model against transformers on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch

from arborlm.runtime.model_loader import load_model
from tests.runtime.model_helpers import ModelHarness

PROMPTS = [  # ragged; the first two share a cached prefix in the prefix test
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def encode(checkpoint) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def hf_prompt_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def check_prompt_logits(checkpoint):
    ours = load_model(checkpoint, torch.float32, torch.device("cpu"))
    ref = hf_model(checkpoint)
    prompts = encode(checkpoint)
    harness = ModelHarness(ours.model, ours.hf_config)

    # One extend over all prompts, no cache.
    rows = [harness.new_req() for _ in prompts]
    out = harness.extend(rows, prompts, return_full_logits=True)
    expected = torch.cat([hf_prompt_logits(ref, ids) for ids in prompts])
    assert out.full_logits.dtype == torch.float32
    assert (out.full_logits - expected).abs().max().item() < 1e-4
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    torch.testing.assert_close(out.next_token_logits, expected[last], atol=1e-4, rtol=0)

    # Cached prefixes: extend the first part, then the rest (ragged, one request without a prefix).
    rows = [harness.new_req() for _ in prompts]
    cut = [len(prompts[0]) // 2, len(prompts[1]) - 1, 0]
    harness.extend(rows[:2], [prompts[0][:cut[0]], prompts[1][:cut[1]]])
    rest = [ids[c:] for ids, c in zip(prompts, cut)]
    out = harness.extend(rows, rest, return_full_logits=True)
    expected = torch.cat([hf_prompt_logits(ref, ids)[c:] for ids, c in zip(prompts, cut)])
    assert (out.full_logits - expected).abs().max().item() < 1e-4

    # Decode steps continue every request.
    extra = [[11, 22, 33], [44, 55, 66], [77, 88, 99]]
    for step in range(3):
        out = harness.decode(rows, [e[step] for e in extra])
        expected = torch.stack([hf_prompt_logits(ref, ids + e[: step + 1])[-1] for ids, e in zip(prompts, extra)])
        assert (out.next_token_logits - expected).abs().max().item() < 1e-4


def check_greedy(checkpoint, max_new_tokens=32):
    ours = load_model(checkpoint, torch.float32, torch.device("cpu"))
    ref = hf_model(checkpoint)
    prompts = encode(checkpoint)
    outputs = ModelHarness(ours.model, ours.hf_config).greedy(prompts, max_new_tokens)
    eos = ref.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for ids, got in zip(prompts, outputs):
        with torch.no_grad():
            generated = ref.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
            )[0, len(ids):].tolist()
        # transformers stops at EOS; we ran on, so compare through its EOS.
        assert len(got) == max_new_tokens
        assert len(generated) == max_new_tokens or generated[-1] in eos
        assert got[: len(generated)] == generated


def test_tiny_llama_prompt_logits(tiny_llama_dir):
    check_prompt_logits(tiny_llama_dir)


def test_tiny_llama_greedy(tiny_llama_dir):
    check_greedy(tiny_llama_dir)


@pytest.mark.smollm
def test_smollm_prompt_logits(smollm_dir):
    check_prompt_logits(smollm_dir)


@pytest.mark.smollm
def test_smollm_greedy(smollm_dir):
    check_greedy(smollm_dir)


def test_bfloat16_runs_close(tiny_llama_dir):
    """bf16 weights and KV give logits near the float32 ones (no agreement claim, a sanity bound)."""
    prompts = encode(tiny_llama_dir)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_model(tiny_llama_dir, dtype, torch.device("cpu"))
        harness = ModelHarness(loaded.model, loaded.hf_config, dtype=dtype)
        logits[dtype] = harness.extend([harness.new_req() for _ in prompts], prompts).next_token_logits
    assert logits[torch.bfloat16].dtype == torch.float32
    assert (logits[torch.bfloat16] - logits[torch.float32]).abs().max().item() < 0.1
