"""The Hugging Face config of a GGUF file: the settings transformers' GGUF reader drops.

`model_loader` converts a GGUF file into a checkpoint folder with transformers' reader,
whose key table (`transformers/integrations/ggml.py`) covers only part of what llama.cpp's
`convert_hf_to_gguf.py` writes. A setting it skips falls back to transformers' config
default and the converted model is another model: Qwen3's head_dim (128), Qwen3-MoE's
expert width (768), Gemma 3's rope scaling, local rope base and layer pattern, Phi-3's
LongRoPE, partial rotary and window. And a Mixtral file, which says "llama", would become
a dense Llama.

From a file's metadata (`gguf_metadata`) this module derives, per family, the config.json
fields that describe the model as llama.cpp runs that file: `read_settings` before the
conversion (it refuses, with a `ModelLoadError` naming the key, what config.json cannot
say), `hf_config` for it (the model transformers fills must have the file's sizes),
`patch_config` after it. Where llama.cpp stores no key but derives the setting in
`src/llama-model.cpp` (Gemma 3's attention scale, its default layer pattern and local
base; Qwen3-MoE's renormalised top-k), the same rule is applied.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from arborlm.errors import ModelLoadError
from arborlm.runtime.gguf_metadata import (
    BLOCK_COUNT,
    CONTEXT_LENGTH,
    EMBEDDING_LENGTH,
    EXPERT_COUNT,
    EXPERT_FEED_FORWARD_LENGTH,
    EXPERT_SHARED_COUNT,
    EXPERT_USED_COUNT,
    FEED_FORWARD_LENGTH,
    FINAL_LOGIT_SOFTCAPPING,
    HEAD_COUNT,
    HEAD_COUNT_KV,
    KEY_LENGTH,
    RMS_EPS,
    ROPE_DIMENSION_COUNT,
    ROPE_FACTOR_TENSORS,
    ROPE_FREQ_BASE,
    ROPE_FREQ_BASE_SWA,
    ROPE_SCALE_LINEAR,
    ROPE_SCALING_ATTN_FACTOR,
    ROPE_SCALING_FACTOR,
    ROPE_SCALING_ORIG_CTX_LEN,
    ROPE_SCALING_TYPE,
    SLIDING_WINDOW,
    SLIDING_WINDOW_PATTERN,
    TOKEN_ID_KEYS,
    VALUE_LENGTH,
    VOCAB_SIZE,
    YARN_KEYS,
    GGUFMetadata,
    read_metadata,
)
from arborlm.runtime.models import registry

# Raised when the rules below change, so that folders converted before are converted again.
CONVERSION_VERSION = 3

SLIDING, FULL = "sliding_attention", "full_attention"
# llama-model.cpp's Gemma 3 unless the file says otherwise: every 6th layer global, local base 10k.
GEMMA3_SWA_PERIOD = 6
GEMMA3_LOCAL_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62
MIXTRAL = "MixtralForCausalLM"
# The llama3 rope scaling Meta released (Llama 3.1-3.3 configs; the converter's defaults but
# `factor`): low and high frequency factors, pretraining length.
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192
# How close the rope_freqs of the file must be to the llama3 rule (the file stores float32).
ROPE_FREQS_RTOL = 1e-5


@dataclass(frozen=True)
class GGUFSettings:
    """How a GGUF file is served.

    architecture: the config.json architecture (a `registry.MODELS` name).
    config: config.json fields that transformers' reader does not write; nested dicts
        (rope_parameters) merge into the converted ones. For Mixtral, the whole config.
    """

    architecture: str
    config: dict


def read_settings(gguf_file: Path) -> GGUFSettings:
    """How to serve `gguf_file`: its architecture, the config fields transformers' reader drops.

    A `llama` file with experts (`llama.expert_count` > 0) is Mixtral, as llama.cpp's
    converter writes it.

    Raises
    ------
    ModelLoadError
        For an unreadable file, an architecture we do not serve, a required key
        missing, or a setting config.json cannot represent (each named).
    """
    meta = read_metadata(gguf_file)
    num_experts = int(meta.get(EXPERT_COUNT, 0) or 0)
    architecture = registry.architecture_from_gguf(meta.arch, meta.path, num_experts=num_experts)
    return GGUFSettings(architecture, _FAMILY_FIELDS.get(architecture, _rope_fields)(meta))


def patch_config(checkpoint: Path, settings: GGUFSettings) -> None:
    """Write `settings.config` into `checkpoint/config.json` (nested dicts merged, others set)."""
    path = checkpoint / "config.json"
    config = _merged(json.loads(path.read_text()), settings.config)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def hf_config(gguf_file: Path, settings: GGUFSettings):
    """The transformers config to convert `gguf_file`'s weights with.

    transformers' GGUF reader's config with `settings.config` merged in: built from the
    reader's own, a model of the sizes it misses (Qwen3's head_dim, Qwen3-MoE's expert
    width) would get those tensors re-initialised, not loaded.

    Raises
    ------
    ModelLoadError
        When transformers cannot read the file's config.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the config of GGUF file {str(gguf_file)!r}: {exc}") from exc
    return type(config).from_dict(_merged(config.to_dict(), settings.config))


def _merged(base: dict, patch: dict) -> dict:
    merged = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merged(merged[key], value)
        merged[key] = value
    return merged


# ---------------------------------------------------------------- shared settings


def _rope_scaling(meta: GGUFMetadata) -> dict:
    """rope_parameters fields of the file's rope scaling; {} for none.

    As llama.cpp reads it: `rope.scaling.type` (default linear) with `rope.scaling.factor`
    (or the older `rope.scale_linear`); a factor of 0 or 1 scales nothing.
    """
    kind = meta.get(ROPE_SCALING_TYPE)
    factor = meta.get(ROPE_SCALING_FACTOR, meta.get(ROPE_SCALE_LINEAR))
    if kind == "none" or (kind in (None, "linear") and factor in (None, 0.0, 1.0)):
        return {}
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return _yarn(meta, factor)
    raise meta.error(f"{meta.key(ROPE_SCALING_TYPE)} = {kind!r} is not a scaling of this family")


def _yarn(meta: GGUFMetadata, factor) -> dict:
    """YaRN in transformers' fields (the model builder says whether it is served)."""
    scaling = {
        "rope_type": "yarn",
        "factor": float(factor or 1.0),
        "original_max_position_embeddings": int(meta.require(ROPE_SCALING_ORIG_CTX_LEN)),
    }
    for name, key in YARN_KEYS.items():
        if meta.get(key) is not None:
            scaling[name] = float(meta.get(key))
    return scaling


def _rope(meta: GGUFMetadata) -> dict:
    """One rope_parameters dict: the base (where the file has one) and the scaling."""
    rope = {"rope_type": "default", **_rope_scaling(meta)}
    if meta.get(ROPE_FREQ_BASE) is not None:
        rope["rope_theta"] = float(meta.get(ROPE_FREQ_BASE))
    return rope


def _rope_fields(meta: GGUFMetadata) -> dict:
    """rope_parameters where the file scales its rope (transformers' reader reads no scaling)."""
    return {"rope_parameters": _rope(meta)} if _rope_scaling(meta) else {}


def _head_dim(meta: GGUFMetadata) -> dict:
    """head_dim from `attention.key_length`; config.json has one size for keys and values."""
    key, value = meta.get(KEY_LENGTH), meta.get(VALUE_LENGTH)
    if key is None:
        return {}
    if value is not None and value != key:
        raise meta.error(
            f"attention.key_length {key} != attention.value_length {value}: config.json has one head_dim"
        )
    return {"head_dim": int(key)}


def _token_ids(meta: GGUFMetadata) -> dict:
    ids = {name: meta.get(key) for name, key in TOKEN_ID_KEYS.items()}
    return {name: int(value) for name, value in ids.items() if value is not None}


# ---------------------------------------------------------------- families


def _llama_fields(meta: GGUFMetadata) -> dict:
    """Llama: rope scaling, and Llama 3.x's `rope_freqs` tensor (see `_rope_freqs_parameters`)."""
    if meta.rope_freqs is None:
        return _rope_fields(meta)
    if _rope_scaling(meta):
        raise meta.error(f"it has both rope_freqs and {meta.key(ROPE_SCALING_TYPE)}: config.json says one scaling")
    head_dim = int(meta.get(KEY_LENGTH) or int(meta.require(EMBEDDING_LENGTH)) // int(meta.require(HEAD_COUNT)))
    rotary_dim = int(meta.get(ROPE_DIMENSION_COUNT, head_dim))
    if rotary_dim != head_dim or len(meta.rope_freqs) != rotary_dim // 2:
        raise meta.error(
            f"rope_freqs has {len(meta.rope_freqs)} factors for a rotary dim of {rotary_dim} "
            f"(head_dim {head_dim}): expected head_dim / 2"
        )
    theta = float(meta.get(ROPE_FREQ_BASE, 10_000.0))  # llama.cpp's default base
    return {"rope_parameters": {"rope_theta": theta, **_rope_freqs_parameters(meta, theta, rotary_dim)}}


def _rope_freqs_parameters(meta: GGUFMetadata, theta: float, rotary_dim: int) -> dict:
    """rope_parameters for a `rope_freqs` tensor: llama.cpp's rotary pair i turns at
    `theta ** (-2i / rotary_dim) / rope_freqs[i]` (`ggml_rope_ext`'s freq_factors).

    llama.cpp's converter (`LlamaModel.generate_extra_tensors`) writes the llama3 scaling
    of a Llama 3.1+ checkpoint as that tensor and no scaling key. When the factors are
    the llama3 rule's for Meta's released low / high factors and pretraining length
    (`rope.scaling.original_context_length` where the file has it) with `factor` their
    largest value, the config says llama3 as the original did. Any other factors are
    written as what they are: LongRoPE with the same short and long factors and an
    attention factor of 1 (`1 / (factor_i * theta ** (2i / d))`, transformers'
    `_compute_longrope_parameters`), which transformers and our models compute exactly.
    """
    factors = [float(f) for f in meta.rope_freqs]
    if all(f == 1.0 for f in factors):
        return {"rope_type": "default"}
    llama3 = {
        "rope_type": "llama3",
        "factor": max(factors),
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": int(meta.get(ROPE_SCALING_ORIG_CTX_LEN, LLAMA3_ORIGINAL_CONTEXT)),
    }
    expected = llama3_rope_freqs(theta, rotary_dim, llama3)
    if all(math.isclose(f, e, rel_tol=ROPE_FREQS_RTOL) for f, e in zip(factors, expected)):
        return llama3
    context = int(meta.require(CONTEXT_LENGTH))
    return {
        "rope_type": "longrope",
        "short_factor": factors,
        "long_factor": factors,
        "attention_factor": 1.0,
        "original_max_position_embeddings": context,
    }


def llama3_rope_freqs(theta: float, rotary_dim: int, scaling: dict) -> list[float]:
    """The `rope_freqs` values llama.cpp's converter writes for a llama3 rope scaling
    (`LlamaModel.generate_extra_tensors`): 1 for short wavelengths, `factor` for long ones,
    the smooth interpolation between (transformers' `_compute_llama3_parameters`, inverted).

    Parameters
    ----------
    theta: rope base. rotary_dim: rotated dims of a head (even).
    scaling: llama3 rope_parameters (factor, low_freq_factor, high_freq_factor,
        original_max_position_embeddings).
    """
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    values = []
    for i in range(0, rotary_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / rotary_dim)
        if wavelen < original / high:
            values.append(1.0)
        elif wavelen > original / low:
            values.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            values.append(1 / ((1 - smooth) / factor + smooth))
    return values


def _qwen3_fields(meta: GGUFMetadata) -> dict:
    """Qwen3: head_dim (`attention.key_length`) and rope scaling."""
    return {**_head_dim(meta), **_rope_fields(meta)}


def _qwen3_moe_fields(meta: GGUFMetadata) -> dict:
    """Qwen3-MoE: Qwen3's fields, expert counts and width; all layers sparse, top-k renormalised.

    llama.cpp's qwen3moe graph (`src/models/qwen3moe.cpp`) builds each layer from the
    `*_exps` tensors and always renormalises the chosen weights, whatever the original
    `norm_topk_prob` was; the file records neither.
    """
    if meta.get(EXPERT_SHARED_COUNT):
        raise meta.error(f"{meta.key(EXPERT_SHARED_COUNT)} > 0: Qwen3-MoE has no shared experts")
    return {
        **_qwen3_fields(meta),
        "num_experts": int(meta.require(EXPERT_COUNT)),
        "num_experts_per_tok": int(meta.require(EXPERT_USED_COUNT)),
        "moe_intermediate_size": _expert_width(meta),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _expert_width(meta: GGUFMetadata) -> int:
    """`expert_feed_forward_length`, else the width of layer 0's down experts (E, hidden, width)."""
    width = meta.get(EXPERT_FEED_FORWARD_LENGTH)
    if width is not None:
        return int(width)
    shape = meta.tensor_shapes.get("blk.0.ffn_down_exps.weight")
    if shape is None:
        raise meta.error(f"it has neither {meta.key(EXPERT_FEED_FORWARD_LENGTH)} nor blk.0.ffn_down_exps")
    return shape[-1]


def _gemma3_fields(meta: GGUFMetadata) -> dict:
    """Gemma 3: head_dim, the attention scale, window and layer pattern, both rope kinds, soft-cap."""
    head = _head_dim(meta)
    window = int(meta.get(SLIDING_WINDOW, 0) or 0)
    local_base = float(meta.get(ROPE_FREQ_BASE_SWA, GEMMA3_LOCAL_BASE))
    fields = {
        **head,
        "query_pre_attn_scalar": _gemma3_query_scalar(meta, head.get("head_dim")),
        "sliding_window": window or None,
        "layer_types": _gemma3_layer_types(meta, window),
        "rope_parameters": {
            FULL: _rope(meta),
            # llama.cpp's Gemma 3 never scales the local layers' rope.
            SLIDING: {"rope_type": "default", "rope_theta": local_base},
        },
    }
    if meta.get(FINAL_LOGIT_SOFTCAPPING):
        fields["final_logit_softcapping"] = float(meta.get(FINAL_LOGIT_SOFTCAPPING))
    return fields


def _gemma3_query_scalar(meta: GGUFMetadata, head_dim: int | None) -> int:
    """query_pre_attn_scalar, which the file does not store.

    llama-model.cpp scales queries by 1/sqrt(hidden / heads) for the 27B (62 layers)
    and by 1/sqrt(head_dim) for the others, as Google's gemma_pytorch config does (and
    as the released configs say: 168 for the 27B, 256 = head_dim for the rest).
    """
    if int(meta.require(BLOCK_COUNT)) == GEMMA3_27B_LAYERS:
        return int(meta.require(EMBEDDING_LENGTH)) // int(meta.require(HEAD_COUNT))
    return int(head_dim or meta.require(KEY_LENGTH))


def _gemma3_layer_types(meta: GGUFMetadata, window: int) -> list[str]:
    """Each layer's attention kind as llama.cpp runs it.

    No window: every layer global. Else `attention.sliding_window_pattern`, one flag
    per layer (true = sliding) or a period n (every n-th layer global), default 6.
    """
    num_layers = int(meta.require(BLOCK_COUNT))
    if not window:
        return [FULL] * num_layers
    pattern = meta.get(SLIDING_WINDOW_PATTERN, GEMMA3_SWA_PERIOD)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise meta.error(f"{meta.key(SLIDING_WINDOW_PATTERN)}: {len(pattern)} flags, {num_layers} layers")
        return [SLIDING if flag else FULL for flag in pattern]
    if int(pattern) < 1:
        raise meta.error(f"{meta.key(SLIDING_WINDOW_PATTERN)} = {pattern} is not a period of layers")
    return [SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers)]


def _phi3_fields(meta: GGUFMetadata) -> dict:
    """Phi-3: partial rotary, LongRoPE (factor tensors), original context, sliding window.

    As llama.cpp's `Phi3MiniModel` writes them: `rope.dimension_count` is
    int(partial_rotary_factor * hidden) // heads, a window of 0 means none (Phi-4).
    """
    head_dim = int(meta.require(EMBEDDING_LENGTH)) // int(meta.require(HEAD_COUNT))
    rotary_dim = int(meta.get(ROPE_DIMENSION_COUNT, head_dim))
    partial = rotary_dim / head_dim
    if int(head_dim * partial) != rotary_dim:
        raise meta.error(f"{meta.key(ROPE_DIMENSION_COUNT)} = {rotary_dim} is no part of head_dim {head_dim}")
    original = meta.get(ROPE_SCALING_ORIG_CTX_LEN)
    # Phi-3's only scaling is LongRoPE, told by its factor tensors (no rope.scaling.type).
    rope = {"rope_type": "default", "partial_rotary_factor": partial}
    rope.update(_longrope(meta, rotary_dim, original))
    if meta.get(ROPE_FREQ_BASE) is not None:
        rope["rope_theta"] = float(meta.get(ROPE_FREQ_BASE))
    fields = {"rope_parameters": rope, "sliding_window": int(meta.get(SLIDING_WINDOW, 0) or 0) or None}
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    return fields


def _longrope(meta: GGUFMetadata, rotary_dim: int, original: int | None) -> dict:
    """LongRoPE rope_parameters from the factor tensors; {} for a file without them.

    The attention factor is written only where the file's `rope.scaling.attn_factor`
    is not transformers' default sqrt(1 + ln(s) / ln(original)), s = context / original
    (llama.cpp's converter writes exactly that default).

    Raises
    ------
    ModelLoadError
        For one factor tensor without the other, a list not rotary_dim / 2 long, or
        factors without `rope.scaling.original_context_length`.
    """
    factors = meta.rope_factors
    if not factors:
        return {}
    if set(factors) != set(ROPE_FACTOR_TENSORS):
        raise meta.error(f"of the LongRoPE factors it has only {[ROPE_FACTOR_TENSORS[k] for k in factors]}")
    for key, values in factors.items():
        if len(values) != rotary_dim // 2:
            raise meta.error(
                f"{ROPE_FACTOR_TENSORS[key]} has {len(values)} factors; rotary dim {rotary_dim} "
                f"needs {rotary_dim // 2}"
            )
    if original is None:
        raise meta.error(f"LongRoPE factors without {meta.key(ROPE_SCALING_ORIG_CTX_LEN)}")
    rope = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original)}
    attn_factor = meta.get(ROPE_SCALING_ATTN_FACTOR)
    scale = int(meta.require(CONTEXT_LENGTH)) / int(original)
    default = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
    if attn_factor is not None and not math.isclose(attn_factor, default, rel_tol=1e-5):
        rope["attention_factor"] = float(attn_factor)
    return rope


def _mixtral_config(meta: GGUFMetadata) -> dict:
    """The whole config.json of a Mixtral file (general.architecture "llama" with experts).

    llama.cpp's `LlamaModel` writes Mixtral: the llama keys, `expert_count`,
    `expert_used_count`; `feed_forward_length` is the experts' width; rope on whole heads.
    """
    hidden, heads = int(meta.require(EMBEDDING_LENGTH)), int(meta.require(HEAD_COUNT))
    # llama.cpp's n_embd_head_k; rope.dimension_count (n_rot) defaults to it.
    head_dim = int(meta.get(KEY_LENGTH) or hidden // heads)
    if int(meta.get(ROPE_DIMENSION_COUNT, head_dim)) != head_dim:
        raise meta.error(
            f"{meta.key(ROPE_DIMENSION_COUNT)} = {meta.get(ROPE_DIMENSION_COUNT)} != head_dim {head_dim}: "
            "Mixtral rotates whole heads"
        )
    return {
        "architectures": [MIXTRAL],
        "model_type": "mixtral",
        "dtype": "float32",
        "hidden_act": "silu",
        "vocab_size": _vocab_size(meta),
        "hidden_size": hidden,
        "intermediate_size": int(meta.get(EXPERT_FEED_FORWARD_LENGTH) or meta.require(FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(meta.require(BLOCK_COUNT)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(HEAD_COUNT_KV, heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.require(CONTEXT_LENGTH)),
        "rms_norm_eps": float(meta.require(RMS_EPS)),
        # llama.cpp's default base when the file has none.
        "rope_parameters": {"rope_theta": 10_000.0, **_rope(meta)},
        "num_local_experts": int(meta.require(EXPERT_COUNT)),
        "num_experts_per_tok": int(meta.require(EXPERT_USED_COUNT)),
        "sliding_window": int(meta.get(SLIDING_WINDOW, 0) or 0) or None,
        # llama.cpp writes no output tensor for a tied head.
        "tie_word_embeddings": "output.weight" not in meta.tensor_shapes,
        **_token_ids(meta),
    }


def _vocab_size(meta: GGUFMetadata) -> int:
    """`{arch}.vocab_size`, else the token list's length, else the embedding's rows."""
    if meta.get(VOCAB_SIZE) is not None:
        return int(meta.get(VOCAB_SIZE))
    if meta.num_tokens is not None:
        return meta.num_tokens
    if "token_embd.weight" not in meta.tensor_shapes:
        raise meta.error(f"it has no {meta.key(VOCAB_SIZE)}, token list nor token_embd.weight")
    return meta.tensor_shapes["token_embd.weight"][0]


_FAMILY_FIELDS: dict[str, Callable[[GGUFMetadata], dict]] = {
    "LlamaForCausalLM": _llama_fields,
    "Qwen3ForCausalLM": _qwen3_fields,
    "Qwen3MoeForCausalLM": _qwen3_moe_fields,
    "Gemma3ForCausalLM": _gemma3_fields,
    "Phi3ForCausalLM": _phi3_fields,
    MIXTRAL: _mixtral_config,
}

