"""Quantized GGUF serving (`quantization="gguf"`) for the families beyond Llama: Qwen3-MoE and
Mixtral (stacked 3-D expert tensors, the router), Gemma 3 (its own norm names, norms stored as
1 + weight, a tied head) and Phi-3 (q/k/v and gate/up fused in one tensor each).

Each tiny random model is written as llama.cpp writes it (`gguf_writer.py`), its matrices
quantized with `gguf.quants` in a mix of Q8_0 / Q4_0 / Q4_1 (an expert's gate and up in two
formats). The reference is the dequantized path (`quantization="none"`: the loader's conversion
of the same file). On torch ops the quantized path multiplies by the same dequantized values,
so prompt logits agree within float32 rounding (1e-4); on the C++ int8 kernels within int8
activation noise (relative error < 5 %), and greedy tokens then still agree for most steps.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from arborlm.runtime.layers.moe import FusedMoE  # noqa: E402
from arborlm.runtime.layers.quantization.quant_linear import QuantizedEmbedding, QuantizedLinear  # noqa: E402
from arborlm.runtime.layers.quantization.quant_moe import QuantizedFusedMoE  # noqa: E402
from arborlm.runtime.model_loader import load_model, resolve_checkpoint, resolve_quantization  # noqa: E402
from tests.runtime import gguf_writer  # noqa: E402
from tests.runtime.family_helpers import PROMPTS, tiny_checkpoint  # noqa: E402
from tests.runtime.model_helpers import ModelHarness  # noqa: E402

T = gguf.GGMLQuantizationType
# llama.cpp tensor kind -> its type (absent: float32, as norms in llama.cpp's files)
TYPES = {
    "token_embd": T.Q8_0, "output": T.Q4_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0,
    "attn_qkv": T.Q4_1, "attn_output": T.Q4_1, "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0,
    "ffn_gate_inp": T.Q8_0, "ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q4_1, "ffn_down_exps": T.Q8_0,
}
IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
CASES = {  # model_type -> config on top of family_helpers.TINY (hidden 64, 2 layers)
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, head_dim=16, moe_intermediate_size=64,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=5, tie_word_embeddings=True),
    "phi3": dict(),
}


def write_quantized(model, path):
    """`model` as `gguf_writer.write_gguf` writes it, each matrix quantized to TYPES[kind]."""
    config = model.config
    arch = getattr(gguf.MODEL_ARCH, gguf_writer.ARCHES[config.model_type])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    if config.model_type == "phi3":
        gguf_writer._write_phi3_hparams(writer, config)
    else:
        gguf_writer._write_hparams(writer, config)
    gguf_writer._write_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for gguf_name, data in gguf_writer._gguf_tensors(names, config, name, tensor.float()):
            data = data.contiguous().numpy()
            qtype = TYPES.get(gguf_name.split(".")[-2]) if data.ndim >= 2 else None
            if qtype is None:
                writer.add_tensor(gguf_name, data)
            else:
                writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for gguf_name, data in gguf_writer._rope_factor_tensors(config):
        writer.add_tensor(gguf_name, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(CASES))
def family_gguf(request, tmp_path_factory):
    """(the quantized GGUF file, the checkpoint folder its "none" path converts it to)."""
    folder = tmp_path_factory.mktemp(f"{request.param}_qfamily")
    reference = tiny_checkpoint(folder / "hf", request.param, **IDS, **CASES[request.param])
    path = write_quantized(reference, folder / "tiny.gguf")
    return path, resolve_checkpoint(str(path), cache_dir=folder / "cache", progress=False)


def prompt_logits(loaded) -> torch.Tensor:
    harness = ModelHarness(loaded.model, loaded.hf_config)
    return harness.extend([harness.new_req() for _ in PROMPTS], PROMPTS, return_full_logits=True).full_logits


def test_quantized_layers_are_installed(family_gguf):
    path, converted = family_gguf
    assert resolve_quantization(str(path), None) == path  # served as stored by default
    model = load_model(converted, torch.float32, torch.device("cpu"), cpu_kernels=False, gguf_file=path).model
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    layer = model.model.layers[0]
    qkv = [w.fmt for w in layer.self_attn.qkv_proj.weights]
    assert qkv == (["q4_1"] if model.config.model_type == "phi3" else ["q4_0", "q4_1", "q8_0"])
    if model.config.model_type in ("qwen3_moe", "mixtral"):
        experts = layer.mlp.experts
        assert isinstance(experts, QuantizedFusedMoE) and not any(isinstance(m, FusedMoE) for m in model.modules())
        assert [w.fmt for w in experts.gate_up[0]] == ["q4_0", "q4_1"] and experts.down[0][0].fmt == "q8_0"
        assert isinstance(layer.mlp.gate, QuantizedLinear)  # the router
    else:
        fused = [w.fmt for w in layer.mlp.gate_up_proj.weights]
        assert fused == (["q4_0"] if model.config.model_type == "phi3" else ["q4_1", "q4_0"])
    if model.config.model_type == "gemma3_text":  # tied: the head reads the embedding's table
        assert model.lm_head.weights[0] is model.model.embed_tokens.weight


def test_torch_path_equals_the_dequantized_model(family_gguf):
    path, converted = family_gguf
    quantized = load_model(converted, torch.float32, torch.device("cpu"), cpu_kernels=False, gguf_file=path)
    plain = load_model(converted, torch.float32, torch.device("cpu"), cpu_kernels=False)
    torch.testing.assert_close(prompt_logits(quantized), prompt_logits(plain), atol=1e-4, rtol=1e-4)


def test_native_kernels_within_int8_noise(family_gguf):
    path, converted = family_gguf
    quantized = load_model(converted, torch.float32, torch.device("cpu"), gguf_file=path)
    plain = load_model(converted, torch.float32, torch.device("cpu"))
    q, p = prompt_logits(quantized), prompt_logits(plain)
    assert float((q - p).norm() / p.norm()) < 0.05
    tokens = [ModelHarness(m.model, m.hf_config).greedy(PROMPTS, 8) for m in (quantized, plain)]
    agree = sum(a == b for qs, ps in zip(*tokens) for a, b in zip(qs, ps))
    assert agree >= 0.6 * sum(len(ps) for ps in tokens[1])
