"""Our model against transformers on a tiny random checkpoint: the checks the family tests share.

`save_tiny` builds a transformers model from a config with a fixed seed (its norm
weights randomised too, so that a norm's offset matters) and saves it; the
`check_*` functions load the folder through `load_model`, as the server does, and
compare logits (float32, within `ATOL`) and greedy tokens with transformers.
Prompts are token ids, so the checkpoints need no tokenizer.
"""

from __future__ import annotations

import torch

from arborlm.runtime.model_loader import load_model
from tests.runtime.model_helpers import ModelHarness

ATOL = 1e-4


def save_tiny(folder, config, norm_scale: float = 0.5, seed: int = 0):
    """A random transformers causal LM of `config` in float32, saved to `folder`.

    Norm weights (transformers starts them at 0 or 1) get `N(0, norm_scale)` noise.
    Returns the model (eval mode), the reference.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * norm_scale)
    model.save_pretrained(folder)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of transformers over the whole sequence, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def load(folder, attention_backend: str = "torch", cpu_kernels: bool = True):
    return load_model(folder, torch.float32, torch.device("cpu"), attention_backend, cpu_kernels)


def check_prompt_logits(folder, reference, prompts: list[list[int]], **load_kwargs) -> None:
    """Prompt logits of one batched extend, of a second extend after cached prefixes
    (ragged, one request without a prefix), then three decode steps, all within ATOL."""
    loaded = load(folder, **load_kwargs)
    harness = ModelHarness(loaded.model, loaded.hf_config)
    expected = [hf_logits(reference, ids) for ids in prompts]

    out = harness.extend([harness.new_req() for _ in prompts], prompts, return_full_logits=True)
    torch.testing.assert_close(out.full_logits, torch.cat(expected), atol=ATOL, rtol=0)

    rows = [harness.new_req() for _ in prompts]
    cut = [len(ids) // 2 for ids in prompts[:-1]] + [0]
    harness.extend(rows[:-1], [ids[:c] for ids, c in zip(prompts[:-1], cut)])
    out = harness.extend(rows, [ids[c:] for ids, c in zip(prompts, cut)], return_full_logits=True)
    torch.testing.assert_close(out.full_logits, torch.cat([e[c:] for e, c in zip(expected, cut)]), atol=ATOL, rtol=0)

    extra = [[11 + i, 22 + i, 33 + i] for i in range(len(prompts))]
    for step in range(3):
        out = harness.decode(rows, [e[step] for e in extra])
        want = torch.stack([hf_logits(reference, ids + e[: step + 1])[-1] for ids, e in zip(prompts, extra)])
        torch.testing.assert_close(out.next_token_logits, want, atol=ATOL, rtol=0)


def check_greedy(folder, reference, prompts: list[list[int]], max_new_tokens: int = 32, **load_kwargs) -> None:
    """`max_new_tokens` greedy tokens of every prompt (one batched extend, batched
    decode) equal transformers' `generate` (through its EOS, where it stops)."""
    loaded = load(folder, **load_kwargs)
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
