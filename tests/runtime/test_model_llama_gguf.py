"""Llama 3.x from GGUF files: the llama3 rope scaling travels as the `rope_freqs` tensor.

llama.cpp's converter writes a Llama 3.1+ checkpoint's llama3 scaling as one divisor per
rotary pair (`rope_freqs.weight`) and no scaling key; transformers' GGUF reader drops the
tensor, so without `gguf_config` the converted model would rotate as plain RoPE. A tiny
Llama with Meta's released scaling (low 1, high 4, original 8192, factor 8; head_dim 16,
base 500k puts pairs in all three wavelength bands) converts back to `llama3`; one with
other low/high factors (which the file cannot tell apart) converts to the same
frequencies written as LongRoPE with equal short and long factors. Both untied and tied
heads (no `output` tensor), against the original's prompt logits within 1e-4 in float32
and 32 greedy tokens, from the converted folder and served from the file as stored.
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.runtime.gguf_config import llama3_rope_freqs
from arborlm.runtime.gguf_metadata import read_metadata
from arborlm.runtime.model_loader import load_model, resolve_checkpoint
from tests.runtime.family_helpers import (
    PROMPTS,
    check_greedy,
    check_prompt_logits,
    hf_logits,
    tiny_checkpoint,
)
from tests.runtime.gguf_writer import write_gguf
from tests.runtime.model_helpers import ModelHarness

META_LLAMA3 = dict(
    rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
OTHER_LLAMA3 = dict(
    rope_type="llama3", rope_theta=10_000.0, factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
    original_max_position_embeddings=64,
)
# A long prompt first: Meta's scaling slows only the slow pairs, whose angles differ
# from plain RoPE's by more than the tolerance only some hundred positions in.
LONG_PROMPTS = [[(37 * i + 11) % 256 for i in range(200)], *PROMPTS[1:]]
CASES = {  # name -> (config on top of TINY, the rope_type the converted config says)
    "llama3-untied": (dict(rope_parameters=META_LLAMA3), "llama3"),
    "llama3-tied": (dict(rope_parameters=META_LLAMA3, tie_word_embeddings=True), "llama3"),
    "other-factors-tied": (dict(rope_parameters=OTHER_LLAMA3, tie_word_embeddings=True), "longrope"),
}


@pytest.fixture(scope="module", params=list(CASES))
def llama_gguf(request, tmp_path_factory):
    """(the GGUF file, its converted checkpoint folder, the transformers original, the expected rope_type)."""
    config, rope_type = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    reference = tiny_checkpoint(folder / "hf", "llama", **config)
    gguf_file = write_gguf(reference, folder / "tiny.gguf")
    converted = resolve_checkpoint(str(gguf_file), cache_dir=folder / "cache", progress=False)
    return gguf_file, converted, reference, rope_type


def test_the_file_has_the_converters_rope_freqs(llama_gguf):
    gguf_file, _, reference, _ = llama_gguf
    rope = reference.config.rope_parameters
    factors = read_metadata(gguf_file).rope_freqs
    assert factors == pytest.approx(llama3_rope_freqs(rope["rope_theta"], 16, rope), rel=1e-6)
    assert 1.0 in factors and rope["factor"] in factors and len(set(factors)) > 2  # every band present


def test_converted_config_says_the_scaling(llama_gguf):
    _, converted, reference, rope_type = llama_gguf
    config = json.loads((converted / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == rope_type
    assert config["tie_word_embeddings"] == reference.config.tie_word_embeddings
    if rope_type == "llama3":
        for key, value in META_LLAMA3.items():
            assert config["rope_parameters"][key] == pytest.approx(value), key


def test_prompt_logits_match_the_original(llama_gguf):
    _, converted, reference, _ = llama_gguf
    check_prompt_logits(converted, reference, LONG_PROMPTS)


def test_greedy_tokens_match_the_original(llama_gguf):
    _, converted, reference, _ = llama_gguf
    check_greedy(converted, reference, LONG_PROMPTS[:1] + PROMPTS)


def test_served_from_the_file_matches_the_original(llama_gguf):
    """quantization='gguf' reads the config folder's rope and the file's float32 tensors."""
    gguf_file, converted, reference, _ = llama_gguf
    loaded = load_model(converted, torch.float32, torch.device("cpu"), cpu_kernels=False, gguf_file=gguf_file)
    harness = ModelHarness(loaded.model, loaded.hf_config)
    out = harness.extend([harness.new_req() for _ in LONG_PROMPTS], LONG_PROMPTS, return_full_logits=True)
    expected = torch.cat([hf_logits(reference, ids) for ids in LONG_PROMPTS])
    torch.testing.assert_close(out.full_logits, expected, atol=1e-4, rtol=0)


def test_without_the_factors_the_logits_differ(llama_gguf, tmp_path):
    """The check can fail: the same weights with plain RoPE (what transformers' reader makes)."""
    _, converted, reference, _ = llama_gguf
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in converted.iterdir():
        (plain / file.name).write_bytes(file.read_bytes())
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": reference.config.rope_parameters["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError):
        check_prompt_logits(plain, reference, LONG_PROMPTS)


def _llama_meta(rope_freqs, **fields):
    from arborlm.runtime.gguf_metadata import GGUFMetadata

    base = {"llama.embedding_length": 64, "llama.attention.head_count": 4, "llama.rope.freq_base": 500_000.0,
            "llama.context_length": 256}
    return GGUFMetadata("m.gguf", "llama", {**base, **fields}, {}, {}, rope_freqs=rope_freqs)


def test_llama3_factors_of_another_length_are_refused():
    from arborlm.errors import ModelLoadError
    from arborlm.runtime.gguf_config import _llama_fields

    with pytest.raises(ModelLoadError, match="rope_freqs has 3 factors for a rotary dim of 16"):
        _llama_fields(_llama_meta([1.0, 2.0, 8.0]))


def test_rope_freqs_beside_a_scaling_key_is_refused():
    from arborlm.errors import ModelLoadError
    from arborlm.runtime.gguf_config import _llama_fields

    factors = llama3_rope_freqs(500_000.0, 16, META_LLAMA3)
    with pytest.raises(ModelLoadError, match="llama.rope.scaling.type"):
        _llama_fields(_llama_meta(factors, **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}))


def test_all_ones_is_plain_rope():
    from arborlm.runtime.gguf_config import _llama_fields

    assert _llama_fields(_llama_meta([1.0] * 8))["rope_parameters"]["rope_type"] == "default"
