"""The metadata of a GGUF file, read with the `gguf` package's `GGUFReader`.

`gguf_config` turns it into config.json fields. What is read: every metadata key but the
tokenizer's per-token arrays, each tensor's shape, and the few tensors that carry settings
(Phi-3's LongRoPE factors). Key names are llama.cpp's (`gguf-py/gguf/constants.py`,
`Keys`; `{arch}` is the file's `general.architecture`), spelled out here so that the
installed `gguf` version does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from arborlm.errors import ModelLoadError

# llama.cpp's metadata keys ({arch} is general.architecture).
BLOCK_COUNT = "{arch}.block_count"
CONTEXT_LENGTH = "{arch}.context_length"
EMBEDDING_LENGTH = "{arch}.embedding_length"
FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
VOCAB_SIZE = "{arch}.vocab_size"
HEAD_COUNT = "{arch}.attention.head_count"
HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
KEY_LENGTH = "{arch}.attention.key_length"
VALUE_LENGTH = "{arch}.attention.value_length"
RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
SLIDING_WINDOW = "{arch}.attention.sliding_window"
SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"
FINAL_LOGIT_SOFTCAPPING = "{arch}.final_logit_softcapping"
EXPERT_COUNT = "{arch}.expert_count"
EXPERT_USED_COUNT = "{arch}.expert_used_count"
EXPERT_FEED_FORWARD_LENGTH = "{arch}.expert_feed_forward_length"
EXPERT_SHARED_COUNT = "{arch}.expert_shared_count"
ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
ROPE_FREQ_BASE = "{arch}.rope.freq_base"
ROPE_FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"
ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"  # the linear factor's key before rope.scaling.*
ROPE_SCALING_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"
ROPE_SCALING_ORIG_CTX_LEN = "{arch}.rope.scaling.original_context_length"
YARN_KEYS = {  # HF yarn field -> llama.cpp key
    "beta_fast": "{arch}.rope.scaling.yarn_beta_fast",
    "beta_slow": "{arch}.rope.scaling.yarn_beta_slow",
    "attention_factor": "{arch}.rope.scaling.yarn_attn_factor",
}
TOKEN_ID_KEYS = {  # config.json field -> llama.cpp key
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
TOKEN_LIST = "tokenizer.ggml.tokens"
# Phi-3's LongRoPE factors are tensors, not metadata (MODEL_TENSOR.ROPE_FACTORS_SHORT / _LONG).
ROPE_FACTOR_TENSORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
# Llama 3.x's rotary frequency divisors (MODEL_TENSOR.ROPE_FREQS), one per rotated pair.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


@dataclass(frozen=True)
class GGUFMetadata:
    """What a GGUF file says about its model, its tokenizer's vocabulary and weights aside.

    Attributes
    ----------
    path: the file, for error messages.
    arch: `general.architecture` (llama.cpp's family name), which fills `{arch}` in keys.
    fields: metadata key -> value (int, float, bool, str or a list of them); the
        tokenizer's per-token arrays are left out.
    tensor_shapes: tensor name -> shape in torch order (rows first).
    rope_factors: "short_factor" / "long_factor" -> the values of Phi-3's LongRoPE
        factor tensors present in the file.
    num_tokens: the length of `tokenizer.ggml.tokens`, or None without one.
    rope_freqs: the values of the `rope_freqs` tensor (llama.cpp divides pair i's rotary
        frequency by value i; Llama 3.x's converter writes its llama3 scaling so), or None.
    """

    path: str
    arch: str
    fields: dict = field(repr=False)
    tensor_shapes: dict = field(repr=False)
    rope_factors: dict = field(repr=False)
    num_tokens: int | None = None
    rope_freqs: list[float] | None = field(default=None, repr=False)

    def get(self, key: str, default=None):
        """The value of `key` ("{arch}." filled in), or `default` when the file lacks it."""
        return self.fields.get(key.format(arch=self.arch), default)

    def require(self, key: str):
        """The value of `key`; a ModelLoadError naming it when the file lacks it."""
        value = self.get(key)
        if value is None:
            raise self.error(f"it has no {self.key(key)}")
        return value

    def key(self, key: str) -> str:
        """`key` with "{arch}" filled in, for messages."""
        return key.format(arch=self.arch)

    def error(self, message: str) -> ModelLoadError:
        """The error for a setting of this file that cannot be served."""
        return ModelLoadError(f"cannot serve GGUF file {self.path!r}: {message}")


def read_metadata(gguf_file: Path) -> GGUFMetadata:
    """The metadata, tensor shapes and rope factors of a GGUF file (`gguf.GGUFReader`).

    The reader maps the file; no weight is read but the LongRoPE factors and `rope_freqs`.

    Raises
    ------
    ModelLoadError
        For a file the reader cannot parse.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_file))
        fields = {name: _field_value(f) for name, f in reader.fields.items() if not _is_token_array(name)}
        arch = fields["general.architecture"]
    except Exception as exc:
        raise ModelLoadError(f"cannot read the metadata of GGUF file {str(gguf_file)!r}: {exc!r}") from exc
    tokens = reader.fields.get(TOKEN_LIST)
    return GGUFMetadata(
        path=str(gguf_file),
        arch=arch,
        fields=fields,
        tensor_shapes={t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors},
        rope_factors=_rope_factors(reader),
        num_tokens=None if tokens is None else len(tokens.data),
        rope_freqs=_tensor_values(reader, ROPE_FREQS_TENSOR),
    )


def _is_token_array(name: str) -> bool:
    """Per-token arrays (tokens, scores, types, merges): large, and the tokenizer's business."""
    per_token = ("tokens", "scores", "token_type", "merges")
    return name.startswith("tokenizer.ggml.") and name.rsplit(".", 1)[1] in per_token


def _field_value(reader_field):
    """A `ReaderField`'s value: a scalar or string, or a list of them for an array."""
    from gguf import GGUFValueType

    parts = [reader_field.parts[i] for i in reader_field.data]
    if reader_field.types[-1] == GGUFValueType.STRING:
        values = [bytes(part).decode("utf-8") for part in parts]
    else:
        values = [part.tolist()[0] for part in parts]
    return values if reader_field.types[0] == GGUFValueType.ARRAY else values[0]


def _rope_factors(reader) -> dict[str, list[float]]:
    """The LongRoPE factor tensors of the file, as float lists (llama.cpp writes them float32)."""
    values = {key: _tensor_values(reader, name) for key, name in ROPE_FACTOR_TENSORS.items()}
    return {key: factors for key, factors in values.items() if factors is not None}


def _tensor_values(reader, name: str) -> list[float] | None:
    """The values of the file's tensor `name` as a float list (dequantized), or None without it."""
    import numpy as np
    from gguf import dequantize

    for tensor in reader.tensors:
        if tensor.name == name:
            return np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).ravel().tolist()
    return None
