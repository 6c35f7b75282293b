"""Serving GGUF weights as stored (`quantization="gguf"`) against the dequantized path ("none").

Tiny models: a random Llama (untied head, q/k rows permuted as llama.cpp stores them)
and a random Qwen2 (tied head, q/k/v biases) are written as GGUF files whose tensors
are quantized with `gguf.quants` in a mix of formats (fused q/k/v shards of three
formats, one tensor in Q5_0, which the kernels do not serve). With the torch ops the
quantized path computes the same float matmuls over the same dequantized values as
the "none" path (transformers' conversion of the same file), so prompt logits agree
within float32 rounding; with the C++ kernels (int8 activations) within their noise.

A wider tiny Llama holds Q4_K / Q5_K / Q6_K tensors (random blocks: the gguf package has
no K-quant quantizer). The default model (SmolLM2-135M-Instruct, Q4_1 + Q8_0): greedy tokens of a few
prompts agree with the dequantized bf16 path for most tokens, and the weights held
in memory are about the file's size. Refusals: "gguf" for a checkpoint folder or an
architecture the quantized loader does not name; truncated and corrupt files are a
`ModelLoadError`, never a crash.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from arborlm.errors import ModelLoadError  # noqa: E402
from arborlm.runtime.config import ServerArgs  # noqa: E402
from arborlm.runtime.layers.quantization.gguf_file import read_gguf_file  # noqa: E402
from arborlm.runtime.layers.quantization.gguf_loader import weight_bytes  # noqa: E402
from arborlm.runtime.layers.quantization.quant_linear import QuantizedEmbedding, QuantizedLinear  # noqa: E402
from arborlm.runtime.model_loader import (  # noqa: E402
    default_model_path,
    load_model,
    resolve_checkpoint,
    resolve_quantization,
)
from tests.runtime import gguf_writer  # noqa: E402
from tests.runtime.family_helpers import PROMPTS, tiny_checkpoint  # noqa: E402
from tests.runtime.model_helpers import ModelHarness  # noqa: E402

T = gguf.GGMLQuantizationType
# llama.cpp tensor kind -> its type in the tiny files (None: float32, as the converter's F32 files)
LLAMA_TYPES = {
    "token_embd": T.Q8_0, "output": T.Q4_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0,
    "attn_output": T.Q4_1, "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0,
}
QWEN2_TYPES = {
    "token_embd": T.Q4_1, "attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
    "ffn_gate": T.Q4_0, "ffn_up": T.Q4_0, "ffn_down": T.Q4_1,
}
# K-quants need rows of 256: a wider tiny Llama; gguf has no K-quant quantizer, so these
# tensors are random blocks with scales that keep the weights about +-0.1.
K_LLAMA_TYPES = {
    "token_embd": T.Q6_K, "output": T.Q5_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K,
    "attn_output": T.Q4_K, "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K,
}
K_SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
UNSERVED = {"blk.1.ffn_up.weight": T.Q5_0}  # a type the kernels do not serve: dequantized, logged
CASES = {"llama": LLAMA_TYPES, "qwen2": QWEN2_TYPES, "llama-k": K_LLAMA_TYPES}
ARCH_NAMES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
SMOLLM_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
]


def write_quantized_gguf(model, path: Path, types: dict) -> Path:
    """`model` (a transformers Llama or Qwen2, vocabulary 256) as a GGUF file, llama.cpp's
    names and q/k row order, each weight quantized to `types[kind]` (float32 when absent)."""
    config = model.config
    arch = ARCH_NAMES[config.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    gguf_writer._write_hparams(writer, config)
    gguf_writer._write_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        data = tensor.float()
        if config.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = gguf_writer.permute_rotary_rows(data, heads)
        data = data.contiguous().numpy()
        qtype = UNSERVED.get(gguf_name) or (types.get(gguf_name.split(".")[-2]) if data.ndim == 2 else None)
        if qtype is None:
            writer.add_tensor(gguf_name, data)
        elif qtype in K_SCALES:
            writer.add_tensor(gguf_name, random_k_blocks(qtype, data.shape, seed=len(writer.tensors[0])), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# K-quant type -> {byte offset of an fp16 scale in the block: its value}
K_SCALES = {T.Q4_K: {0: 2e-4, 2: 1.5e-3}, T.Q5_K: {0: 1e-4, 2: 1.5e-3}, T.Q6_K: {208: 2.5e-5}}


def random_k_blocks(qtype, shape: tuple[int, int], seed: int) -> np.ndarray:
    """(rows, row bytes) of random K-quant blocks, their fp16 scales set from `K_SCALES`."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for at, value in K_SCALES[qtype].items():
        raw[:, :, at:at + 2] = np.full(raw.shape[:2] + (1,), value, np.float16).view(np.uint8)
    return raw.reshape(shape[0], -1)


@pytest.fixture(scope="module", params=list(CASES))
def tiny_gguf(request, tmp_path_factory):
    """(the GGUF file, the checkpoint folder its "none" path converts it to)."""
    folder = tmp_path_factory.mktemp(f"{request.param}_quantized")
    tied = request.param == "qwen2"
    sizes = K_SIZES if request.param == "llama-k" else {}
    reference = tiny_checkpoint(folder / "hf", request.param.removesuffix("-k"), tie_word_embeddings=tied, **sizes)
    path = write_quantized_gguf(reference, folder / "tiny.gguf", CASES[request.param])
    return path, resolve_checkpoint(str(path), cache_dir=folder / "cache", progress=False)


def prompt_logits(loaded, prompts=PROMPTS) -> torch.Tensor:
    harness = ModelHarness(loaded.model, loaded.hf_config)
    return harness.extend([harness.new_req() for _ in prompts], prompts, return_full_logits=True).full_logits


def test_tiny_gguf_torch_path_equals_the_dequantized_model(tiny_gguf, caplog):
    path, converted = tiny_gguf
    assert resolve_quantization(str(path), None) == path  # quantized tensors: served as stored by default
    with caplog.at_level(logging.WARNING):
        quantized = load_model(converted, torch.float32, torch.device("cpu"), cpu_kernels=False, gguf_file=path)
    assert "Q5_0" in caplog.text  # the unserved type is named
    plain = load_model(converted, torch.float32, torch.device("cpu"), cpu_kernels=False)
    torch.testing.assert_close(prompt_logits(quantized), prompt_logits(plain), atol=1e-4, rtol=1e-4)


def test_tiny_gguf_layers_keep_each_shards_format(tiny_gguf):
    path, converted = tiny_gguf
    model = load_model(converted, torch.float32, torch.device("cpu"), gguf_file=path).model
    layer0, layer1 = model.model.layers
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    if model.tie_word_embeddings:  # the head reads the embedding's packed table
        assert model.lm_head.weights[0] is model.model.embed_tokens.weight
    qkv = [w.fmt for w in layer0.self_attn.qkv_proj.weights]
    expected = {"qwen2": ["q8_0"], 64: ["q4_0", "q4_1", "q8_0"], 256: ["q4_k", "q5_k", "q6_k"]}
    assert qkv == expected["qwen2" if model.config.model_type == "qwen2" else model.config.hidden_size]
    assert isinstance(layer0.mlp.gate_up_proj, QuantizedLinear)
    assert not isinstance(layer1.mlp.gate_up_proj, QuantizedLinear)  # its up shard is Q5_0: dequantized


def test_tiny_gguf_needs_only_a_config_folder(tiny_gguf, tmp_path):
    """Served from the file, a GGUF needs no dequantized copy: the folder holds config and tokenizer."""
    path, converted = tiny_gguf
    folder = resolve_checkpoint(str(path), cache_dir=tmp_path, progress=False, weights=False)
    assert folder.name.endswith("-config") and (folder / "config.json").is_file()
    assert not list(folder.glob("*.safetensors"))
    alone = load_model(folder, torch.float32, torch.device("cpu"), cpu_kernels=False, gguf_file=path)
    full = load_model(converted, torch.float32, torch.device("cpu"), cpu_kernels=False, gguf_file=path)
    assert alone.architecture == full.architecture
    torch.testing.assert_close(prompt_logits(alone), prompt_logits(full), atol=0, rtol=0)


def test_tiny_gguf_native_kernels_within_int8_noise(tiny_gguf):
    path, converted = tiny_gguf
    quantized = prompt_logits(load_model(converted, torch.float32, torch.device("cpu"), gguf_file=path))
    plain = prompt_logits(load_model(converted, torch.float32, torch.device("cpu")))
    assert float((quantized - plain).norm() / plain.norm()) < 0.05


@pytest.fixture(scope="module")
def smollm_pair(smollm_dir):
    """The default model served quantized and dequantized, bf16 as the server runs it here."""
    path = resolve_quantization(None, None)
    assert path == default_model_path()
    checkpoint = resolve_checkpoint(None, progress=False, weights=False)
    quantized = load_model(checkpoint, torch.bfloat16, torch.device("cpu"), gguf_file=path)
    plain = load_model(smollm_dir, torch.bfloat16, torch.device("cpu"))
    return quantized, plain


def teacher_forced_ranks(plain, prompts: list[list[int]], continuations: list[list[int]]) -> list[int]:
    """Rank (0 = argmax) of each continuation token among `plain`'s next-token logits, fed the
    prompt and the continuation so far (one extend over prompt + continuation)."""
    harness = ModelHarness(plain.model, plain.hf_config, dtype=torch.bfloat16)
    seqs = [p + c for p, c in zip(prompts, continuations)]
    full = harness.extend([harness.new_req() for _ in seqs], seqs, return_full_logits=True).full_logits
    ranks, offset = [], 0
    for p, c, s in zip(prompts, continuations, seqs):
        for j, token in enumerate(c):
            row = full[offset + len(p) - 1 + j].float()
            ranks.append(int((row > row[token]).sum()))
        offset += len(s)
    return ranks


@pytest.mark.smollm
def test_default_model_greedy_tokens_agree(smollm_pair, smollm_dir):
    """The quantized model's greedy tokens, scored by the dequantized one on the same prefix
    (teacher-forced): mostly its argmax, always near its top. Not free-running agreement: once
    a near-tie flips (the 4-bit path rounds activations to int8), the texts part for good, and
    where they part depends on the CPU's summation order (bf16 AMX vs AVX-512)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_dir))
    prompts = [tokenizer.encode(p) for p in SMOLLM_PROMPTS]
    quantized, plain = smollm_pair
    continuations = ModelHarness(quantized.model, quantized.hf_config, dtype=torch.bfloat16).greedy(prompts, 16)
    ranks = teacher_forced_ranks(plain, prompts, continuations)
    assert sum(r == 0 for r in ranks) / len(ranks) >= 0.85, ranks
    assert max(ranks) <= 4, ranks


@pytest.mark.smollm
def test_default_model_weights_stay_the_files_size(smollm_pair):
    quantized, plain = smollm_pair
    file_bytes = default_model_path().stat().st_size
    assert weight_bytes(quantized.model) <= 1.2 * file_bytes
    assert weight_bytes(plain.model) >= 2.5 * weight_bytes(quantized.model)


def test_gguf_refused_for_a_checkpoint_folder(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs.from_kwargs(model_path=str(tiny_llama_dir), quantization="gguf")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_quantization(str(tiny_llama_dir), "gguf")
    assert resolve_quantization(str(tiny_llama_dir), None) is None
    assert resolve_quantization(None, "none") is None
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs.from_kwargs(quantization="awq")


def test_gguf_refused_for_an_architecture_it_does_not_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(np.ones((4, 32), np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="falcon"):
        resolve_quantization(str(tmp_path / "falcon.gguf"), "gguf")
    assert resolve_quantization(str(tmp_path / "falcon.gguf"), None) is None  # falls back to dequantizing


def _corrupt_copies(source: Path, folder: Path) -> dict[str, Path]:
    """Copies of `source` cut or overwritten where a reader could go wrong."""
    data = source.read_bytes()
    parsed = read_gguf_file(source)
    table_end = len(data) - parsed.data.nbytes  # where the (aligned) data section starts
    first = parsed.tensors[0]
    type_at = data.index(first.name.encode()) + len(first.name) + 4 + 8 * len(first.shape)
    cases = {
        "empty": b"",
        "magic": b"GGUX" + data[4:],
        "cut in the header": data[:20],
        "cut in the tensor table": data[:table_end - 40],
        "cut in the data": data[:len(data) - 1000],
        "unknown tensor type": data[:type_at] + (99).to_bytes(4, "little") + data[type_at + 4:],
    }
    paths = {}
    for name, content in cases.items():
        paths[name] = folder / f"{name.replace(' ', '_')}.gguf"
        paths[name].write_bytes(content)
    return paths


def test_truncated_or_corrupt_gguf_is_a_model_load_error(tiny_gguf, tmp_path):
    path, converted = tiny_gguf
    for case, broken in _corrupt_copies(path, tmp_path).items():
        with pytest.raises(ModelLoadError):
            read_gguf_file(broken)
        for quantization in ("gguf", None, "none", "int8"):  # checked whatever the weights become
            with pytest.raises(ModelLoadError, match=str(broken)):
                resolve_quantization(str(broken), quantization)
        if case.startswith("cut"):
            with pytest.raises(ModelLoadError, match="is truncated"):
                read_gguf_file(broken)
        with pytest.raises(ModelLoadError):
            load_model(converted, torch.float32, torch.device("cpu"), gguf_file=broken)
        assert case  # every case raised at each step


def test_gguf_with_a_tensor_the_table_does_not_name_is_refused(tiny_gguf, tmp_path):
    path, converted = tiny_gguf
    data = path.read_bytes()
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(data.replace(b"blk.0.ffn_down.weight", b"blk.0.ffn_dwnX.weight", 1))
    with pytest.raises(ModelLoadError, match="ffn_dwnX"):
        load_model(converted, torch.float32, torch.device("cpu"), gguf_file=renamed)
    shutil.rmtree(tmp_path, ignore_errors=True)
