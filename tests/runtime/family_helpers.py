"""Agreement checks for one model family: a tiny random checkpoint built with transformers
(fixed seed), loaded through arborlm's loader, against transformers in float32."""

from __future__ import annotations

from pathlib import Path

import torch

from arborlm.runtime.model_loader import load_model
from tests.runtime.model_helpers import ModelHarness

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=256, tie_word_embeddings=False,
)
PROMPTS = [  # ragged; longer than the sliding windows the tests set
    [5, 17, 99, 3, 250, 8, 41, 77, 12, 6, 140, 33, 9],
    [200, 1, 2],
    [7, 7, 7, 64, 128, 31, 90, 15],
]
ATOL = 1e-4


def tiny_checkpoint(folder: Path, model_type: str, **config):
    """Save a random float32 checkpoint of `model_type` (TINY sizes, `config` on top) in `folder`.

    Weights transformers initialises to a constant (norms at 1, biases and Qwen3-MoE's
    router at 0) get noise, so q/k norms, biases and routing are exercised. Returns the
    transformers model (eval mode), the reference.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(model_type, **{**TINY, **config})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and param.std() == 0:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return model


def load_ours(folder: Path):
    """Our model for `folder` through the loader, float32 on the CPU."""
    return load_model(folder, torch.float32, torch.device("cpu"))


def hf_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


def check_prompt_logits(folder: Path, reference, prompts=PROMPTS) -> None:
    """Prompt logits of one extend, of an extend after cached prefixes, and of decode steps
    all within ATOL of transformers'."""
    loaded = load_ours(folder)
    harness = ModelHarness(loaded.model, loaded.hf_config)
    out = harness.extend([harness.new_req() for _ in prompts], prompts, return_full_logits=True)
    expected = torch.cat([hf_logits(reference, ids) for ids in prompts])
    torch.testing.assert_close(out.full_logits, expected, atol=ATOL, rtol=0)

    rows = [harness.new_req() for _ in prompts]
    cut = [len(prompts[0]) // 2, len(prompts[1]) - 1, 0]
    harness.extend(rows[:2], [prompts[0][: cut[0]], prompts[1][: cut[1]]])
    out = harness.extend(rows, [ids[c:] for ids, c in zip(prompts, cut)], return_full_logits=True)
    expected = torch.cat([hf_logits(reference, ids)[c:] for ids, c in zip(prompts, cut)])
    torch.testing.assert_close(out.full_logits, expected, atol=ATOL, rtol=0)

    extra = [[11, 22, 33], [44, 55, 66], [77, 88, 99]]
    for step in range(3):
        out = harness.decode(rows, [e[step] for e in extra])
        expected = torch.stack([hf_logits(reference, ids + e[: step + 1])[-1] for ids, e in zip(prompts, extra)])
        torch.testing.assert_close(out.next_token_logits, expected, atol=ATOL, rtol=0)


def check_greedy(folder: Path, reference, prompts=PROMPTS, max_new_tokens: int = 32) -> None:
    """Batched greedy decoding gives transformers' `generate` tokens (compared through its EOS)."""
    loaded = load_ours(folder)
    outputs = ModelHarness(loaded.model, loaded.hf_config).greedy(prompts, max_new_tokens)
    eos = reference.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for ids, got in zip(prompts, outputs):
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
            )[0, len(ids):].tolist()
        assert len(got) == max_new_tokens
        assert len(generated) == max_new_tokens or generated[-1] in eos
        assert got[: len(generated)] == generated
