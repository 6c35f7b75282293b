"""GGUF files made for the quantization benchmarks, with the `gguf` package, nothing downloaded.

- `requantized_default(fmt)`: the default model (SmolLM2-135M-Instruct, Q4_1) with every
  matrix dequantized and quantized again to `fmt` (Q8_0, Q4_0, Q4_1 with `gguf.quants`; F16
  as the input of llama.cpp's `llama-quantize`, which writes the K-quants the package cannot);
- `random_llama(fmt)`: a random Llama of ~0.5 B parameters (hidden 1536, 16 layers, FFN 4096,
  24 heads, 8 KV heads) with the default model's tokenizer and chat template, for speed only
  (its perplexity means nothing);
- `llama_quantize(src, fmt)`: `src` (F16) through llama.cpp's `llama-quantize` (Q4_K_M, Q5_K_M,
  Q6_K ...), when `benchmarks/peers/llama_cpp.sh install` has built it.

Files are written once under `$ARBORLM_CACHE/bench-gguf/` (`ENVS.cache_dir`) and reused.
Metadata is copied field by field from the default file (as gguf's `gguf_new_metadata.py`
does), with `general.file_type` and, for the random model, its dimensions replaced.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from arborlm.envs import ENVS
from arborlm.runtime.model_loader import default_model_path

PEERS_CACHE = Path(os.environ.get("ARBORLM_PEERS_CACHE", Path.home() / ".cache" / "arborlm-peers"))
LLAMA_QUANTIZE = PEERS_CACHE / "llama.cpp" / "build" / "bin" / "llama-quantize"
# llama.cpp's LLAMA_FTYPE_* numbers for general.file_type
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
RANDOM_DIMS = {"embedding_length": 1536, "block_count": 16, "feed_forward_length": 4096,
               "attention.head_count": 24, "attention.head_count_kv": 8}


def cache_dir() -> Path:
    path = ENVS.cache_dir / "bench-gguf"
    path.mkdir(parents=True, exist_ok=True)
    return path


def requantized_default(fmt: str) -> Path:
    """The default model with its matrices requantized to `fmt` (F16, Q8_0, Q4_0, Q4_1)."""
    dst = cache_dir() / f"smollm2-135m-{fmt}.gguf"
    if not dst.exists():
        requantize_file(default_model_path(), dst, fmt)
    return dst


def requantize_file(src: Path, dst: Path, fmt: str) -> None:
    """Write `src` (a GGUF file) to `dst` with every matrix dequantized and quantized to `fmt`
    (F16, Q8_0, Q4_0, Q4_1), vectors in F32, the metadata as it was but `general.file_type`.

    Raises
    ------
    ValueError
        From `gguf.quants` for a matrix whose rows are not whole blocks of `fmt`.
    """
    import gguf

    reader = gguf.GGUFReader(str(src))

    def tensors():
        for t in reader.tensors:
            yield t.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))

    _write(dst, reader, fmt, tensors(), {})


def random_llama(fmt: str, seed: int = 0) -> Path:
    """A random Llama of ~0.5 B parameters (`RANDOM_DIMS`) in `fmt` (F16, Q8_0, Q4_0, Q4_1)."""
    import gguf

    dst = cache_dir() / f"random-llama-0.5b-{fmt}.gguf"
    if not dst.exists():
        reader = gguf.GGUFReader(str(default_model_path()))
        _write(dst, reader, fmt, _random_tensors(reader, seed), {f"llama.{k}": v for k, v in RANDOM_DIMS.items()})
    return dst


def llama_quantize(src: Path, fmt: str) -> Path | None:
    """`src` (an F16 GGUF) quantized by llama.cpp's `llama-quantize` to `fmt` (its type names:
    Q4_K_M, Q5_K_M, Q6_K, ...); None when the tool is not built."""
    if not LLAMA_QUANTIZE.is_file():
        return None
    dst = src.with_name(src.name.replace("-F16.gguf", f"-{fmt}.gguf"))
    if not dst.exists():
        tmp = dst.with_suffix(".tmp")
        subprocess.run([str(LLAMA_QUANTIZE), str(src), str(tmp), fmt, "2"], check=True, capture_output=True)
        tmp.rename(dst)
    return dst


def _random_tensors(reader, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """The default file's tensor names for `RANDOM_DIMS`'s layers, random values (std 0.02,
    norms 1), shapes (rows, columns) as numpy holds them."""
    hidden, ffn = RANDOM_DIMS["embedding_length"], RANDOM_DIMS["feed_forward_length"]
    head_dim = hidden // RANDOM_DIMS["attention.head_count"]
    kv = head_dim * RANDOM_DIMS["attention.head_count_kv"]
    vocab = next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1]
    rng = np.random.default_rng(seed)
    shapes = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (hidden, hidden), "attn_k": (kv, hidden),
              "attn_v": (kv, hidden), "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden),
              "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    yield "token_embd.weight", (rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.02)
    yield "output_norm.weight", np.ones(hidden, np.float32)
    for layer in range(RANDOM_DIMS["block_count"]):
        for part, shape in shapes.items():
            values = np.ones(shape, np.float32) if len(shape) == 1 else rng.standard_normal(shape, np.float32) * 0.02
            yield f"blk.{layer}.{part}.weight", values


def _write(dst: Path, reader, fmt: str, tensors: Iterator[tuple[str, np.ndarray]], overrides: dict) -> None:
    """Write `tensors` (matrices in `fmt`, vectors F32) with `reader`'s metadata, `overrides` applied."""
    import gguf

    writer = gguf.GGUFWriter(str(dst.with_suffix(".tmp")), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = overrides.get(field.name, field.contents())
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    writer.add_file_type(FILE_TYPES[fmt])
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    for name, values in tensors:
        writer.add_tensor(name, *_encoded(values, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dst.with_suffix(".tmp").rename(dst)


def _encoded(values: np.ndarray, qtype) -> tuple[np.ndarray, ...]:
    """(data, raw_shape, raw_dtype) for `add_tensor`: a matrix in `qtype`, a vector F32."""
    import gguf

    if values.ndim == 1:
        return (values.astype(np.float32),)
    if qtype == gguf.GGMLQuantizationType.F16:
        return (values.astype(np.float16),)
    quantize: Callable = gguf.quants.quantize
    return quantize(values.astype(np.float32), qtype), None, qtype
