"""Weight-only int8 serving of a float checkpoint (`quantization="int8"`) on a tiny random Llama.

On torch ops the int8 model is exactly the float model with each linear's weight replaced by
its per-channel int8 rounding q * scale (prompt logits within 1e-4). On the C++ kernels (int8
activations per block of 32) and against the unquantized float32 and bf16 models: prompt logits
within 5 % relative error and greedy tokens mostly the same. Unknown values of `quantization`
are a ValueError naming it.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.kernels.quant_layout import quantize_per_channel_int8
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.layers.linear import Linear
from arborlm.runtime.layers.quantization.quant_linear import QuantizedLinear
from arborlm.runtime.model_loader import load_model, resolve_quantization
from tests.runtime.family_helpers import PROMPTS, tiny_checkpoint
from tests.runtime.model_helpers import ModelHarness

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("int8_llama")
    tiny_checkpoint(folder, "llama", tie_word_embeddings=True)
    return folder


def prompt_logits(loaded, dtype=torch.float32) -> torch.Tensor:
    harness = ModelHarness(loaded.model, loaded.hf_config, dtype=dtype)
    return harness.extend([harness.new_req() for _ in PROMPTS], PROMPTS, return_full_logits=True).full_logits.float()


def greedy(loaded, dtype=torch.float32) -> list[list[int]]:
    return ModelHarness(loaded.model, loaded.hf_config, dtype=dtype).greedy(PROMPTS, 16)


def test_every_linear_is_int8_and_the_embedding_stays_float(llama_dir):
    model = load_model(llama_dir, torch.float32, CPU, quantization="int8").model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and not any(isinstance(m, Linear) for m in model.modules())
    assert {w.fmt for m in linears for w in m.weights} == {"q8_0"}
    assert isinstance(model.model.embed_tokens.weight, torch.nn.Parameter)  # the tied table, float


def test_torch_path_is_the_float_model_with_rounded_weights(llama_dir):
    quantized = load_model(llama_dir, torch.float32, CPU, cpu_kernels=False, quantization="int8")
    rounded = load_model(llama_dir, torch.float32, CPU, cpu_kernels=False)
    for module in list(rounded.model.modules()):
        if isinstance(module, Linear):
            q, scale = quantize_per_channel_int8(module.weight)
            module.weight = torch.nn.Parameter(q.float() * scale.float().unsqueeze(1), requires_grad=False)
            module.pack()
    torch.testing.assert_close(prompt_logits(quantized), prompt_logits(rounded), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_agree_with_the_unquantized_model(llama_dir, dtype):
    quantized = load_model(llama_dir, dtype, CPU, quantization="int8")
    plain = load_model(llama_dir, dtype, CPU)
    q, p = prompt_logits(quantized, dtype), prompt_logits(plain, dtype)
    assert float((q - p).norm() / p.norm()) < 0.05
    same = sum(a == b for qs, ps in zip(greedy(quantized, dtype), greedy(plain, dtype)) for a, b in zip(qs, ps))
    assert same >= 0.75 * 16 * len(PROMPTS)


def test_int8_loads_float_weights_and_bad_values_are_refused(llama_dir):
    assert resolve_quantization(str(llama_dir), "int8") is None
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int2")
    ModelConfig(model_path=str(llama_dir), quantization="int8")  # accepted for a checkpoint folder


def test_moe_experts_are_int8_too(tmp_path):
    from arborlm.runtime.layers.moe import FusedMoE
    from arborlm.runtime.layers.quantization.quant_moe import QuantizedFusedMoE

    tiny_checkpoint(tmp_path, "qwen3_moe", num_experts=4, num_experts_per_tok=2, head_dim=16,
                    moe_intermediate_size=64, norm_topk_prob=True)
    quantized = load_model(tmp_path, torch.float32, CPU, cpu_kernels=False, quantization="int8")
    assert not any(isinstance(m, FusedMoE) for m in quantized.model.modules())
    experts = quantized.model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedFusedMoE) and experts.down[0][0].fmt == "q8_0"
    plain = load_model(tmp_path, torch.float32, CPU, cpu_kernels=False)
    q, p = prompt_logits(quantized), prompt_logits(plain)
    assert 0 < float((q - p).norm() / p.norm()) < 0.02
