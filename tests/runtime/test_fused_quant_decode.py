"""Models served quantized take the fused decoder layer (`layers/fused_decode.py` with
`QuantizedLinear` projections), and give what they give with it off.

Tiny random models written as GGUF files (`test_quantized_model.write_quantized_gguf`: a
Llama of Q4_0 / Q4_1 / Q8_0 q/k/v shards with one up shard in Q5_0, which is served
dequantized, so layer 1 mixes quantized and plain linears; a Qwen2 with q/k/v biases and a
tied Q4_1 table; a wider Llama of K-quants), a tiny Llama quantized at load to int8 / int4,
and the default model (SmolLM2-135M-Instruct, Q4_1 + Q8_0). Each runs one prefill and
decode steps fed the same tokens (teacher forcing: the fused-on greedy path) with the fused
path on and off: every decode step of every layer is fused, and the logits are equal bit for
bit where every linear has a bit-exact fused kind (bf16: quantized, AVX-512 / AMX packed),
within float32 rounding otherwise, with the same greedy tokens. A quantized KV pool keeps
the unfused path (the fused layer reads a pool in the model dtype).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from arborlm.kernels import cpu_ops  # noqa: E402
from arborlm.kernels import fused_decoder_layer as fused  # noqa: E402
from arborlm.runtime.layers.quantization.quant_linear import QuantizedLinear  # noqa: E402
from arborlm.runtime.model_loader import (  # noqa: E402
    default_model_path,
    load_model,
    resolve_checkpoint,
    resolve_quantization,
)
from tests.runtime.family_helpers import PROMPTS, tiny_checkpoint  # noqa: E402
from tests.runtime.model_helpers import ModelHarness, count_fused_layer_calls  # noqa: E402
from tests.runtime.test_quantized_model import (  # noqa: E402
    K_LLAMA_TYPES,
    K_SIZES,
    LLAMA_TYPES,
    QWEN2_TYPES,
    write_quantized_gguf,
)

pytestmark = pytest.mark.skipif(fused.native_library() is None or cpu_ops.native_library() is None,
                                reason="native CPU kernels unavailable")
NEW_TOKENS = 8
GGUF_CASES = {"llama": ("llama", LLAMA_TYPES, {}), "qwen2-tied-bias": ("qwen2", QWEN2_TYPES, {}),
              "llama-k": ("llama", K_LLAMA_TYPES, K_SIZES)}


def decode_on_off(loaded, dtype, prompts, new_tokens, monkeypatch, pool_dtype=None):
    """(logits on, logits off, fused layer calls, greedy tokens on): a prefill, then decode steps
    fed the fused-on path's greedy tokens, with the fused path on and then off (KV pool in
    `pool_dtype`, default `dtype`)."""
    fd = loaded.model.model.fused_decode
    assert fd is not None
    calls = count_fused_layer_calls(monkeypatch)
    runs, tokens = [], None
    for enabled in (True, False):
        fd.enabled = enabled
        harness = ModelHarness(loaded.model, loaded.hf_config, dtype=pool_dtype or dtype)
        rows = [harness.new_req() for _ in prompts]
        logits = [harness.extend(rows, prompts).next_token_logits]
        greedy = [[t] for t in logits[0].argmax(-1).tolist()]
        for step in range(new_tokens - 1):
            feed = [out[-1] for out in greedy] if tokens is None else [t[step] for t in tokens]
            logits.append(harness.decode(rows, feed).next_token_logits)
            for out, t in zip(greedy, logits[-1].argmax(-1).tolist()):
                out.append(t)
        runs.append((torch.stack(logits), greedy))
        tokens = tokens or greedy
    fd.enabled = True
    (on, greedy_on), (off, greedy_off) = runs
    assert greedy_on == greedy_off
    return on, off, sum(calls)


def _bit_exact_kinds(model) -> bool:
    """Whether every linear of every layer has a fused kind equal to the unfused path bit for bit."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(m, QuantizedLinear) and not isinstance(
                    m.packed_weight, (cpu_ops.AmxWeight, fused.linear_avx512.Avx512Weight)):
                return False
    return True


def check_equal(loaded, dtype, on, off):
    if _bit_exact_kinds(loaded.model):
        assert torch.equal(on, off)
    else:  # a float32 plain linear: torch's GEMM unfused, the row-dot kernel fused
        torch.testing.assert_close(on, off, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """name -> (the GGUF file, the config folder it is served with)."""
    files = {}
    for name, (model_type, types, sizes) in GGUF_CASES.items():
        folder = tmp_path_factory.mktemp(name)
        reference = tiny_checkpoint(folder / "hf", model_type, tie_word_embeddings=model_type == "qwen2", **sizes)
        path = write_quantized_gguf(reference, folder / "tiny.gguf", types)
        files[name] = path, resolve_checkpoint(str(path), cache_dir=folder / "cache", progress=False, weights=False)
    return files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_tiny_gguf_models(gguf_files, name, dtype, monkeypatch):
    path, folder = gguf_files[name]
    loaded = load_model(folder, dtype, torch.device("cpu"), gguf_file=path)
    assert isinstance(loaded.model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    on, off, calls = decode_on_off(loaded, dtype, PROMPTS, NEW_TOKENS, monkeypatch)
    # layer 1's dequantized up shard needs the AVX-512 BF16 / AMX packing to be fused in bf16,
    # and AVX-512 in float32 (the row-dot kernel is not taken without it)
    float_not_fused = dtype == torch.bfloat16 or not cpu_ops.cpu_has_avx512f()
    if float_not_fused and not _bit_exact_kinds(loaded.model):
        assert calls < (NEW_TOKENS - 1) * loaded.hf_config.num_hidden_layers
    else:
        assert calls == (NEW_TOKENS - 1) * loaded.hf_config.num_hidden_layers
    check_equal(loaded, dtype, on, off)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fused_quant_llama")
    tiny_checkpoint(folder, "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=256)
    return folder


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_weights_quantized_at_load(llama_dir, quantization, dtype, monkeypatch):
    loaded = load_model(llama_dir, dtype, torch.device("cpu"), quantization=quantization)
    assert _bit_exact_kinds(loaded.model)
    on, off, calls = decode_on_off(loaded, dtype, PROMPTS, NEW_TOKENS, monkeypatch)
    assert calls == (NEW_TOKENS - 1) * loaded.hf_config.num_hidden_layers
    assert torch.equal(on, off)


@pytest.mark.smollm
def test_default_gguf_model(smollm_dir: Path, monkeypatch):
    """bf16 as served by default; every projection is Q4_1 (the table Q8_0)."""
    path = resolve_quantization(None, None)
    assert path == default_model_path()
    loaded = load_model(resolve_checkpoint(None, progress=False, weights=False), torch.bfloat16,
                        torch.device("cpu"), gguf_file=path)
    prompts = [[1, 4093, 314, 253, 1345, 30, 198] * 3, [1, 504, 3937, 282], list(range(300, 337))]
    on, off, calls = decode_on_off(loaded, torch.bfloat16, prompts, NEW_TOKENS, monkeypatch)
    assert calls == (NEW_TOKENS - 1) * loaded.hf_config.num_hidden_layers
    assert torch.equal(on, off)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_int8_kv_pool_is_fused_bit_for_bit(llama_dir, dtype, monkeypatch):
    """An int8 KV pool (`kv_cache_dtype="int8"`) keeps the fused layer: it quantizes the new
    K/V into the pool as `set_kv_buffer` does and attends in place, so its logits equal the
    unfused path's (store by torch, the same decode kernel) bit for bit."""
    loaded = load_model(llama_dir, dtype, torch.device("cpu"), quantization="int8", kv_cache_dtype="int8")
    on, off, calls = decode_on_off(loaded, dtype, PROMPTS, NEW_TOKENS, monkeypatch, pool_dtype=torch.int8)
    assert calls == (NEW_TOKENS - 1) * loaded.hf_config.num_hidden_layers
    assert torch.equal(on, off)


def test_fp8_kv_pool_keeps_the_unfused_path(llama_dir, monkeypatch):
    loaded = load_model(llama_dir, torch.float32, torch.device("cpu"), quantization="int8", kv_cache_dtype="fp8_e4m3")
    _, _, calls = decode_on_off(loaded, torch.float32, PROMPTS, 3, monkeypatch, pool_dtype=torch.float8_e4m3fn)
    assert calls == 0
