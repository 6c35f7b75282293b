"""Gemma 3 (text) against transformers on tiny random checkpoints (float32).

The checkpoints switch on what sets the family apart: sliding and global layers
with a window (5) shorter than the prompts, two rotary bases (the global one
linearly scaled), q/k norms and `1 + weight` norms with random weights,
`query_pre_attn_scalar` != head_dim, GeGLU, a final logit soft-cap in its
non-linear range and a tied head; head_dim 256 (real Gemma's) too, through the
torch backend with the native CPU kernels and through the reference backend. One
Engine runs the family with chunked prefill and a prefix-cache hit.
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.models import registry
from arborlm.runtime.models.gemma3 import (
    FULL,
    SLIDING,
    Gemma3ForCausalLM,
    layer_rope,
    layer_types_of,
)
from tests.conftest import TOKENIZER_FILES
from tests.runtime.agreement_helpers import (
    check_greedy,
    check_prompt_logits,
    hf_logits,
    load,
    save_tiny,
)
from tests.runtime.scheduler_helpers import reference_greedy

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=5,
    layer_types=[SLIDING, FULL, SLIDING, SLIDING],
    rope_parameters={
        FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    },
    query_pre_attn_scalar=24, final_logit_softcapping=0.15, tie_word_embeddings=True,
)
CASES = {  # name -> overrides of BASE
    "head_dim_32": {},
    "head_dim_256": {"head_dim": 256, "num_attention_heads": 2, "num_key_value_heads": 1},
    # transformers' Gemma 3 does not apply it (QK-norm replaced it); neither do we.
    "attn_softcap_set": {"attn_logit_softcapping": 0.5},
}
PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 6, 9, 31, 4], [200, 1, 2], list(range(30, 60))]
BACKENDS = ["torch", "reference"]


def gemma3_config(**overrides):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**BASE, **overrides})


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_gemma3(request, tmp_path_factory):
    """(folder, transformers model) of one case of CASES."""
    folder = tmp_path_factory.mktemp(f"gemma3_{request.param}")
    return folder, save_tiny(folder, gemma3_config(**CASES[request.param]))


def test_the_checkpoint_is_what_the_registry_serves(tiny_gemma3):
    folder, _ = tiny_gemma3
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert registry.architecture_from_config({"model_type": "gemma3_text"}, "c") == "Gemma3ForCausalLM"
    assert registry.architecture_from_gguf("gemma3", "g") == "Gemma3ForCausalLM"
    assert isinstance(load(folder).model, Gemma3ForCausalLM)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logits(tiny_gemma3, backend):
    folder, reference = tiny_gemma3
    check_prompt_logits(folder, reference, PROMPTS, attention_backend=backend)


def test_greedy_32_tokens(tiny_gemma3):
    folder, reference = tiny_gemma3
    check_greedy(folder, reference, PROMPTS, max_new_tokens=32)


def test_layer_types_from_the_older_pattern():
    """Configs before `layer_types` gave `sliding_window_pattern`: every n-th layer global."""

    class Old:
        num_hidden_layers = 7
        sliding_window_pattern = 3
        rope_local_base_freq = 12.0
        rope_theta = 34.0

    assert layer_types_of(Old) == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING]
    assert layer_rope(Old, SLIDING) == (12.0, {"rope_type": "default"})
    assert layer_rope(Old, FULL)[0] == 34.0


def test_bidirectional_config_is_refused():
    from arborlm.runtime.layers.attention.reference_backend import ReferenceAttentionBackend

    config = gemma3_config(use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(config, torch.float32, torch.device("cpu"), ReferenceAttentionBackend())


def test_bfloat16_is_as_close_to_float32_as_transformers(tiny_gemma3):
    """bf16 weights and KV: our last-token logits stray from the float32 ones no more
    than transformers' own bf16 run does (x1.5), e.g. the norms' float32 `1 + weight`."""
    from transformers import AutoModelForCausalLM

    from arborlm.runtime.model_loader import load_model
    from tests.runtime.model_helpers import ModelHarness

    folder, reference = tiny_gemma3
    reference_bf16 = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    float32 = torch.stack([hf_logits(reference, ids)[-1] for ids in PROMPTS])
    theirs = torch.stack([hf_logits(reference_bf16, ids)[-1] for ids in PROMPTS])
    loaded = load_model(folder, torch.bfloat16, torch.device("cpu"))
    harness = ModelHarness(loaded.model, loaded.hf_config, dtype=torch.bfloat16)
    ours = harness.extend([harness.new_req() for _ in PROMPTS], PROMPTS).next_token_logits
    assert ours.dtype == torch.float32
    assert (ours - float32).abs().max() <= 1.5 * (theirs - float32).abs().max()


# ---------------------------------------------------------------- through the Engine


@pytest.fixture(scope="module")
def gemma3_engine_dir(tmp_path_factory, smollm_dir):
    """A tiny Gemma 3 of SmolLM2's vocabulary, with its tokenizer files."""
    folder = tmp_path_factory.mktemp("gemma3_engine")
    reference = save_tiny(folder, gemma3_config(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).is_file():
            (folder / name).write_bytes((smollm_dir / name).read_bytes())
    return folder, reference


def test_engine_chunked_prefill_and_prefix_hit(gemma3_engine_dir):
    """Prompts longer than the chunk (8) and the window (5), the second sharing the
    first's first 24 tokens: both give transformers' greedy tokens, the second from
    the prefix cache."""
    import arborlm

    folder, reference = gemma3_engine_dir
    first = [(i * 37 + 11) % 49152 for i in range(30)]
    second = first[:24] + [(i * 53 + 7) % 49152 for i in range(9)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    engine = arborlm.Engine(
        model=str(folder), dtype="float32", max_total_tokens=2048, chunked_prefill_size=8, max_prefill_tokens=8,
        enable_cache_report=True, log_level="warning",
    )
    try:
        outs = [engine.generate(input_ids=ids, sampling_params=params) for ids in (first, second)]
    finally:
        engine.shutdown()
    assert outs[0]["meta_info"]["cached_tokens"] == 0
    assert outs[1]["meta_info"]["cached_tokens"] == 24
    for ids, out in zip((first, second), outs):
        assert out["output_ids"] == reference_greedy(reference, ids, 12)
