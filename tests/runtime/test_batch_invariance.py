"""A request's logits do not depend on where its prompt was cut or what else the step holds.

On the native CPU attention path an EXTEND step attends as decode rows
(`TorchAttentionBackend`), so the token at position p gets the same bits in a whole
prefill, in any prefill chunk, after a cached prefix, as a decode step, and next to
other requests. With row-independent linears (the int8 kernels here) the whole model
is then batch-invariant: the property that keeps greedy answers the same alone and
under load. The engine-level check is `tests/e2e/test_batch_invariance.py`.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.runtime.layers.attention.torch_native_backend import TorchAttentionBackend
from arborlm.runtime.model_loader import load_model
from tests.runtime.family_helpers import tiny_checkpoint
from tests.runtime.model_helpers import ModelHarness

FAMILIES = {"llama": ("llama", {}), "mistral-window": ("mistral", {"sliding_window": 24})}
PROMPT_LEN = 150  # past the kernel's split-K chunk (128 keys) and the window


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory):
    model_type, extra = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(folder, model_type, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=256, max_position_embeddings=512, **extra)
    return folder


def _load(folder, quantization: str):
    loaded = load_model(folder, torch.float32, torch.device("cpu"), quantization=quantization)
    backend = loaded.model.model.attn_backend
    if not (isinstance(backend, TorchAttentionBackend) and backend.native is not None):
        pytest.skip("no C++ compiler here, so no native CPU kernels: prefills then take torch's SDPA, which "
                    "docs/serving.md says is not batch-invariant; nothing promised is lost")
    return loaded


@pytest.fixture(scope="module")
def loaded(folder):
    return _load(folder, "int8")


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (PROMPT_LEN, 90, 40)]


def _harness(loaded) -> ModelHarness:
    return ModelHarness(loaded.model, loaded.hf_config, num_reqs=8, max_context_len=512, num_slots=4096)


def _last_logits_cut_at(loaded, prompt: list[int], cuts: list[int]) -> torch.Tensor:
    """The prompt's last-token logits, its tokens fed in steps that end at `cuts`."""
    harness = _harness(loaded)
    row = harness.new_req()
    start, out = 0, None
    for end in [*cuts, len(prompt)]:
        out = harness.extend([row], [prompt[start:end]]).next_token_logits[0]
        start = end
    return out


def test_prompt_logits_do_not_depend_on_where_the_prompt_was_cut(loaded):
    prompt = _prompts()[0]
    whole = _last_logits_cut_at(loaded, prompt, [])
    for cuts in ([100], [PROMPT_LEN - 1], [1, 2, 3, 128, 129], list(range(10, PROMPT_LEN, 10))):
        assert torch.equal(_last_logits_cut_at(loaded, prompt, cuts), whole), cuts


def test_decode_step_equals_the_same_token_in_a_prefill(loaded):
    prompt = _prompts()[0]
    harness = _harness(loaded)
    row = harness.new_req()
    harness.extend([row], [prompt[:-1]])
    decoded = harness.decode([row], [prompt[-1]]).next_token_logits[0]
    assert torch.equal(decoded, _last_logits_cut_at(loaded, prompt, []))


def test_a_request_is_the_same_next_to_other_requests(loaded):
    """Alone vs. in one prefill with two others, and a decode row riding along a prefill
    (what a mixed-chunk step holds): the same bits."""
    prompt, *others = _prompts()
    alone = _last_logits_cut_at(loaded, prompt, [])
    harness = _harness(loaded)
    rows = [harness.new_req() for _ in range(3)]
    batched = harness.extend(rows, [others[0], prompt, others[1]]).next_token_logits[1]
    assert torch.equal(batched, alone)

    harness = _harness(loaded)
    row, other = harness.new_req(), harness.new_req()
    harness.extend([row], [prompt[:-1]])
    mixed = harness.extend([other, row], [others[0], prompt[-1:]]).next_token_logits[1]
    assert torch.equal(mixed, alone)


def test_decode_rows_agree_with_the_torch_path(folder):
    """The oracle: the same steps through torch's SDPA (`extend_as_decode_rows=False`) give
    the same logits within float32 rounding (float32 weights: int8 activations would
    turn a rounding difference into a quantization step)."""
    loaded = _load(folder, "none")
    backend = loaded.model.model.attn_backend
    prompts = _prompts()
    results = []
    for rows in (True, False):
        backend.extend_as_decode_rows = rows
        try:
            harness = _harness(loaded)
            reqs = [harness.new_req() for _ in prompts]
            harness.extend(reqs[:1], [prompts[0][:100]])
            results.append(harness.extend(reqs, [prompts[0][100:], *prompts[1:]], return_full_logits=True).full_logits)
        finally:
            backend.extend_as_decode_rows = True
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-4)
