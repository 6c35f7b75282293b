"""Weight-only int4 serving of a float checkpoint (`quantization="int4"`, "int4wo-32",
"int4wo-128") on a tiny random Llama.

On torch ops the int4 model is exactly the float model with each linear's weight replaced by
its group-wise rounding q * scale + minimum (prompt logits within 1e-4). On the C++ kernels
(int8 activations per block of 32): prompt logits within 3 % of the torch path, greedy tokens
at >= 90 % of positions those of the torch path and >= 75 % those of the unquantized model,
in float32 and bf16.
A model whose linear widths are not a multiple of the group is refused at start-up with a
ValueError naming the layer and dimension; nothing is half-replaced.
"""

from __future__ import annotations

import pytest
import torch

from arborlm.kernels.quant_layout import quantize_groupwise_int4
from arborlm.runtime.config import ModelConfig, ServerArgs
from arborlm.runtime.layers.linear import Linear
from arborlm.runtime.layers.quantization.quant_linear import QuantizedLinear
from arborlm.runtime.model_loader import load_model, resolve_quantization
from tests.runtime.family_helpers import PROMPTS, tiny_checkpoint
from tests.runtime.model_helpers import ModelHarness

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("int4_llama")  # hidden 64, intermediate 96: group 32 only
    tiny_checkpoint(folder, "llama", tie_word_embeddings=True)
    return folder


def prompt_logits(loaded, dtype=torch.float32) -> torch.Tensor:
    harness = ModelHarness(loaded.model, loaded.hf_config, dtype=dtype)
    return harness.extend([harness.new_req() for _ in PROMPTS], PROMPTS, return_full_logits=True).full_logits.float()


def greedy(loaded, dtype=torch.float32) -> list[list[int]]:
    return ModelHarness(loaded.model, loaded.hf_config, dtype=dtype).greedy(PROMPTS, 16)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of greedy positions where `tokens` equals `reference`."""
    return sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r)) / sum(map(len, reference))


def rounded_float_model(folder, group_size: int):
    """The float model with every linear's weight replaced by its int4 rounding, in float."""
    loaded = load_model(folder, torch.float32, CPU, cpu_kernels=False)
    for module in list(loaded.model.modules()):
        if isinstance(module, Linear):
            q, scale, minimum = quantize_groupwise_int4(module.weight, group_size)
            s = scale.float().repeat_interleave(group_size, dim=1)
            m = minimum.float().repeat_interleave(group_size, dim=1)
            module.weight = torch.nn.Parameter(q.float() * s + m, requires_grad=False)
            module.pack()
    return loaded


def test_every_linear_is_int4_and_the_embedding_stays_float(llama_dir):
    model = load_model(llama_dir, torch.float32, CPU, quantization="int4").model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and not any(isinstance(m, Linear) for m in model.modules())
    assert {w.fmt for m in linears for w in m.weights} == {"q4_1"}
    assert isinstance(model.model.embed_tokens.weight, torch.nn.Parameter)  # the tied table, float


def test_torch_path_is_the_float_model_with_rounded_weights(llama_dir):
    quantized = load_model(llama_dir, torch.float32, CPU, cpu_kernels=False, quantization="int4")
    torch.testing.assert_close(prompt_logits(quantized), prompt_logits(rounded_float_model(llama_dir, 32)),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_agree_with_the_torch_oracle_and_the_float_model(llama_dir, dtype):
    native = load_model(llama_dir, dtype, CPU, quantization="int4")
    oracle = load_model(llama_dir, dtype, CPU, cpu_kernels=False, quantization="int4")
    plain = load_model(llama_dir, dtype, CPU)
    n, o, p = prompt_logits(native, dtype), prompt_logits(oracle, dtype), prompt_logits(plain, dtype)
    assert float((n - o).norm() / o.norm()) < 0.03
    assert 0 < float((n - p).norm() / p.norm()) < 0.25  # 4-bit weights: changed, not broken
    tokens = greedy(native, dtype)
    # int8 activations may flip a near tie, and everything after it: most positions, not all.
    assert agreement(tokens, greedy(oracle, dtype)) >= 0.9
    assert agreement(tokens, greedy(plain, dtype)) >= 0.75


def test_group_128_serves_a_model_whose_widths_allow_it(tmp_path):
    tiny_checkpoint(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    quantized = load_model(tmp_path, torch.float32, CPU, cpu_kernels=False, quantization="int4wo-128")
    torch.testing.assert_close(prompt_logits(quantized), prompt_logits(rounded_float_model(tmp_path, 128)),
                               atol=1e-4, rtol=1e-4)
    native = load_model(tmp_path, torch.float32, CPU, quantization="int4wo-128")
    n, o = prompt_logits(native), prompt_logits(quantized)
    assert float((n - o).norm() / o.norm()) < 0.03


def test_a_width_not_a_multiple_of_the_group_is_refused_at_start_up(llama_dir):
    with pytest.raises(ValueError, match=r"group size 128 .* in_features=64"):
        load_model(llama_dir, torch.float32, CPU, quantization="int4wo-128")
    from arborlm.runtime.model_runner import ModelRunner

    with pytest.raises(ValueError, match="in_features=64"):  # the serving start-up path
        ModelRunner(ServerArgs.from_kwargs(model_path=str(llama_dir), quantization="int4wo-128",
                                           max_total_tokens=256, log_level="warning"))


def test_int4_loads_float_weights_and_its_names_are_accepted(llama_dir):
    for name in ("int4", "int4wo-32", "int4wo-128"):
        assert resolve_quantization(str(llama_dir), name) is None
        ModelConfig(model_path=str(llama_dir), quantization=name)
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int4wo-64")


def test_moe_experts_are_int4_too(tmp_path):
    from arborlm.runtime.layers.moe import FusedMoE
    from arborlm.runtime.layers.quantization.quant_moe import QuantizedFusedMoE

    tiny_checkpoint(tmp_path, "qwen3_moe", num_experts=4, num_experts_per_tok=2, head_dim=16,
                    moe_intermediate_size=64, norm_topk_prob=True)
    quantized = load_model(tmp_path, torch.float32, CPU, cpu_kernels=False, quantization="int4")
    assert not any(isinstance(m, FusedMoE) for m in quantized.model.modules())
    experts = quantized.model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedFusedMoE) and experts.down[0][0].fmt == "q4_1"
    plain = load_model(tmp_path, torch.float32, CPU, cpu_kernels=False)
    q, p = prompt_logits(quantized), prompt_logits(plain)
    assert 0 < float((q - p).norm() / p.norm()) < 0.25
