"""Q8_0 GGUF files of every family: written with the `gguf` package, served dequantized and as stored.

Each tiny transformers model (the family's features on, as in its float32 GGUF test) first has
every weight llama.cpp's quantize turns to Q8_0 (matrices whose rows are whole blocks of 32;
not norms, biases, routers or rope factors) replaced by its Q8_0 round trip
(`gguf.quants.quantize` then `dequantize`; Q8_0 of those values is exact), so that the model
in the file and the reference hold the same numbers. Then, per family:

- dequantized (`quantization="none"`, the converted folder): prompt logits within 1e-4 of the
  round-tripped reference in float32 (one extend, an extend after cached prefixes, decode
  steps; the float32 GGUF tests check 32 greedy tokens on the same conversion);
- served as stored (`quantization="gguf"`, the default for such a file) on torch ops: the same
  float matmuls over the same values, within 1e-4; on the CPU kernels (int8 activations):
  relative logit error below 5 % (`INT8_NOISE`);
- against the float original: what Q8_0 itself costs, relative logit error below 5 % (`Q8_0_ERROR`;
  3 % measured for the 6-layer Gemma 3, under 1 % for the others).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from arborlm.runtime.model_loader import load_model, resolve_checkpoint, resolve_quantization  # noqa: E402
from tests.runtime.agreement_helpers import save_tiny  # noqa: E402
from tests.runtime.family_helpers import (  # noqa: E402
    PROMPTS,
    check_prompt_logits,
    hf_logits,
    tiny_checkpoint,  # noqa: E402
)
from tests.runtime.gguf_writer import write_gguf  # noqa: E402
from tests.runtime.model_helpers import ModelHarness  # noqa: E402
from tests.runtime.test_model_gemma3_phi3_gguf import tiny_config  # noqa: E402
from tests.runtime.test_model_llama_gguf import META_LLAMA3  # noqa: E402

Q8_0 = gguf.GGMLQuantizationType.Q8_0
BLOCK = gguf.GGML_QUANT_SIZES[Q8_0][0]
INT8_NOISE = 0.05
Q8_0_ERROR = 0.05
# family -> how its tiny model is built (folder -> transformers model)
FAMILIES = {
    "llama": lambda folder: tiny_checkpoint(folder, "llama", rope_parameters=META_LLAMA3),  # Llama 3.x: rope_freqs
    "qwen3": lambda folder: tiny_checkpoint(folder, "qwen3", head_dim=32),
    "qwen3_moe": lambda folder: tiny_checkpoint(
        folder, "qwen3_moe", num_experts=4, num_experts_per_tok=2, head_dim=16, moe_intermediate_size=64,
        norm_topk_prob=True, tie_word_embeddings=True),
    "mixtral": lambda folder: tiny_checkpoint(folder, "mixtral", num_local_experts=4, num_experts_per_tok=2),
    "gemma3_text": lambda folder: save_tiny(folder, tiny_config("gemma3_text")),
    "phi3": lambda folder: save_tiny(folder, tiny_config("phi3")),
}


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether the GGUF writer stores this Hugging Face weight as Q8_0 (`gguf_writer._add_tensor`)."""
    router = name.endswith(".gate.weight") and "experts" not in name
    return tensor.ndim >= 2 and tensor.shape[-1] % BLOCK == 0 and not router


def round_trip_q8_0(model) -> int:
    """Replace each weight the file quantizes by its Q8_0 round trip, in place; returns how many."""
    count = 0
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if is_quantized(name, param):
                data = param.float().numpy()
                values = gguf.quants.dequantize(gguf.quants.quantize(data, Q8_0), Q8_0).reshape(data.shape)
                param.copy_(torch.from_numpy(np.ascontiguousarray(values)))
                count += 1
    return count


@pytest.fixture(scope="module", params=list(FAMILIES))
def q8_family(request, tmp_path_factory):
    """(the Q8_0 file, its converted folder, the round-tripped reference, the float original's logits)."""
    folder = tmp_path_factory.mktemp(f"q8_{request.param}")
    reference = FAMILIES[request.param](folder / "hf")
    original = [hf_logits(reference, ids) for ids in PROMPTS]
    assert round_trip_q8_0(reference) > 0
    gguf_file = write_gguf(reference, folder / "tiny-q8_0.gguf", qtype=Q8_0)
    converted = resolve_checkpoint(str(gguf_file), cache_dir=folder / "cache", progress=False)
    return gguf_file, converted, reference, original


def _logits(loaded) -> torch.Tensor:
    harness = ModelHarness(loaded.model, loaded.hf_config)
    return harness.extend([harness.new_req() for _ in PROMPTS], PROMPTS, return_full_logits=True).full_logits


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_file_holds_q8_0_tensors(q8_family):
    gguf_file = q8_family[0]
    types = {t.tensor_type for t in gguf.GGUFReader(str(gguf_file)).tensors}
    assert Q8_0 in types


def test_dequantized_logits_match_the_reference(q8_family):
    _, converted, reference, _ = q8_family
    check_prompt_logits(converted, reference)


def test_served_as_stored_matches_the_reference(q8_family):
    gguf_file, converted, reference, original = q8_family
    assert resolve_quantization(str(gguf_file), None) == gguf_file  # Q8_0: served as stored by default
    expected = torch.cat([hf_logits(reference, ids) for ids in PROMPTS])
    torch_ops = load_model(converted, torch.float32, torch.device("cpu"), cpu_kernels=False, gguf_file=gguf_file)
    got = _logits(torch_ops)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert _relative(got, torch.cat(original)) < Q8_0_ERROR  # what Q8_0 costs against the float weights
    kernels = load_model(converted, torch.float32, torch.device("cpu"), gguf_file=gguf_file)
    assert _relative(_logits(kernels), expected) < INT8_NOISE
