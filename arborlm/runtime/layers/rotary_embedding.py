"""Rotary position embedding (RoPE): the cos/sin tables and their frequencies.

Built once per model from the Hugging Face config (`rope_theta`, `rope_scaling` /
`rope_parameters`, `partial_rotary_factor`) by `get_rope`; each step takes a
`RotaryStep` of its positions, which `apply_rotary_` applies to q and k
(`LayerOps.rotary_`, a native kernel on the CPU, over the rotated dims). Frequencies
follow transformers' `modeling_rope_utils` (default, linear, llama3, longrope).
Two variants: `RotaryEmbedding` (one table) and `LongRotaryEmbedding` (Phi-3's
LongRoPE: a short and a long table, chosen per request by its length).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import LayerOps, RotaryStep

if TYPE_CHECKING:
    from arborlm.runtime.forward_batch_info import ForwardBatch

# rope_type names of Phi-3's LongRoPE ("su" is its name in older configs).
LONGROPE_TYPES = ("longrope", "su")


def rope_parameters(config, layer_type: str | None = None) -> tuple[float, dict]:
    """`(rope_theta, scaling)` from a transformers 5 `rope_parameters` dict or the older
    `rope_theta` / `rope_scaling` attributes; `scaling["rope_type"]` defaults to "default".

    `layer_type` ("full_attention", "sliding_attention") picks its entry of a
    `rope_parameters` nested by layer type (transformers 5's Gemma 3); without such
    an entry the flat parameters are returned.
    """
    nested = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(nested.get(layer_type), dict):
        params = dict(nested[layer_type])
    else:
        params = {**(getattr(config, "rope_scaling", None) or {}), **nested}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    params.setdefault("rope_type", params.get("type", "default"))
    return theta, params


def rotary_dim_of(config, head_dim: int, scaling: dict) -> int:
    """The rotated dims of a head: `int(head_dim * partial_rotary_factor)` (transformers'
    rule; the factor is in `rope_parameters` in transformers 5, on the config before)."""
    factor = scaling.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return int(head_dim * (factor or 1.0))


def rotary_inv_freq(theta: float, scaling: dict, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies `(rotary_dim // 2,)` float32, with linear or llama3 scaling.

    Raises
    ------
    ModelLoadError
        For a rope_type other than default, linear, llama3 (LongRoPE is
        `longrope_inv_freqs`).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError(
        f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, {', '.join(LONGROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling (transformers `_compute_llama3_parameters`)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class LongRopeFrequencies(NamedTuple):
    """LongRoPE's two frequency sets: `short`, `long` (rotary_dim // 2,) float32, the
    cos/sin multiplier `attention_factor`, and the pretraining length
    `original_max_positions` past which a request takes the long set."""

    short: torch.Tensor
    long: torch.Tensor
    attention_factor: float
    original_max_positions: int


def longrope_inv_freqs(config, theta: float, scaling: dict, rotary_dim: int) -> LongRopeFrequencies:
    """Phi-3's LongRoPE frequencies (transformers `_compute_longrope_parameters`).

    Each set is `1 / (factor_i * theta ** (2i / rotary_dim))` with the config's
    `short_factor` / `long_factor` lists. The pretraining length is the config's
    `original_max_position_embeddings` (Phi-3 keeps it beside `rope_scaling`, and
    transformers gives it priority), the attention factor
    `sqrt(1 + ln(s) / ln(original))` for `s = max_position_embeddings / original`
    unless the config sets `attention_factor` (or `factor` for `s`).

    Raises
    ------
    ModelLoadError
        When a factor list is missing or not `rotary_dim // 2` long.
    """
    original = int(
        getattr(config, "original_max_position_embeddings", None)
        or scaling.get("original_max_position_embeddings")
        or config.max_position_embeddings
    )
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    sets = []
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if values is None or len(values) != rotary_dim // 2:
            raise ModelLoadError(f"rope_scaling {key} must list {rotary_dim // 2} numbers, got {values!r}")
        sets.append(1.0 / (torch.tensor(values, dtype=torch.float32) * theta**exponent))
    return LongRopeFrequencies(sets[0], sets[1], float(attention_factor), original)


def cos_sin_tables(
    inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `(cos, signed_sin)` tables `(max_positions, 2 * len(inv_freq))`, both
    times `attention_factor`, sin with `rotate_half`'s sign (its first half negated)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # (max_positions, rotary_dim)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    half = inv_freq.shape[0]
    return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to `max_positions`, precomputed once.

    Parameters
    ----------
    config: the transformers config (rope fields, `partial_rotary_factor`).
    head_dim: the head width; the first `rotary_dim` dims of each head rotate.
    max_positions: table length.
    dtype, device: of the tables.
    params: `(rope_theta, scaling)` overriding `rope_parameters(config)` (per layer
        type in Gemma 3).

    Buffers `cos`, `sin`: (max_positions, rotary_dim) in `dtype`. `step(...)` gives
    the step's `RotaryStep`, which `apply_rotary_` applies to q and k (Hugging Face's
    `rotate_half` layout). The sin table carries `rotate_half`'s sign, so the
    rotation is a roll and two products instead of slices, a negation and a concat,
    with bit-identical results (negation is exact).

    Raises
    ------
    ModelLoadError
        For an unsupported rope_type (see `rotary_inv_freq`).
    """

    def __init__(
        self, config, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device,
        params: tuple[float, dict] | None = None,
    ):
        super().__init__()
        theta, scaling = params if params is not None else rope_parameters(config)
        self.rotary_dim = rotary_dim_of(config, head_dim, scaling)
        cos, sin = cos_sin_tables(rotary_inv_freq(theta, scaling, self.rotary_dim), max_positions)
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def step(self, positions: torch.Tensor, forward_batch: ForwardBatch | None = None) -> RotaryStep:
        """The rotary inputs of a step; positions (num_tokens,) int64 (`forward_batch`
        is not needed: one table serves every request)."""
        return RotaryStep(positions, self.cos, self.sin)


class LongRotaryEmbedding(nn.Module):
    """Phi-3's LongRoPE (`rope_type` "longrope" / "su"): short and long tables.

    Parameters as `RotaryEmbedding`. Buffers `cos`, `sin`: (2 * max_positions,
    rotary_dim), the short-factor table then the long-factor one, both times the
    attention factor (see `longrope_inv_freqs`).

    transformers picks one set per forward call, by its largest position: the long
    set once the sequence is longer than `original_max_position_embeddings`. Here
    each request's tokens of a step use the long set when the request's length
    after the step exceeds it — the same choice for one request, and per request
    in a batch (vLLM and SGLang decide per batch). K/V already in the pool keep the
    rotation they were stored with, as in transformers' cache: a prompt prefilled
    in chunks, or found in the prefix cache, may hold short-set keys below that
    length.

    Raises
    ------
    ModelLoadError
        For missing or mis-sized factor lists.
    """

    def __init__(
        self, config, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device,
        params: tuple[float, dict] | None = None,
    ):
        super().__init__()
        theta, scaling = params if params is not None else rope_parameters(config)
        self.rotary_dim = rotary_dim_of(config, head_dim, scaling)
        freqs = longrope_inv_freqs(config, theta, scaling, self.rotary_dim)
        self.original_max_positions = freqs.original_max_positions
        self.max_positions = max_positions
        short = cos_sin_tables(freqs.short, max_positions, freqs.attention_factor)
        long = cos_sin_tables(freqs.long, max_positions, freqs.attention_factor)
        for name, short_table, long_table in zip(("cos", "sin"), short, long):
            table = torch.cat([short_table, long_table]).to(device=device, dtype=dtype)
            self.register_buffer(name, table, persistent=False)

    def step(self, positions: torch.Tensor, forward_batch: ForwardBatch) -> RotaryStep:
        """The rotary inputs of a step: positions (num_tokens,) int64, moved into the
        long table for the tokens of requests longer than the pretraining length."""
        if max(forward_batch.seq_lens_cpu) <= self.original_max_positions:
            return RotaryStep(positions, self.cos, self.sin)
        token_seq_lens = forward_batch.seq_lens
        if forward_batch.forward_mode.is_extend():
            token_seq_lens = torch.repeat_interleave(
                forward_batch.seq_lens, forward_batch.extend_seq_lens, output_size=positions.shape[0]
            )
        is_long = token_seq_lens > self.original_max_positions
        return RotaryStep(positions + is_long.to(positions.dtype) * self.max_positions, self.cos, self.sin)


def get_rope(
    config, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device,
    params: tuple[float, dict] | None = None,
) -> RotaryEmbedding | LongRotaryEmbedding:
    """The rotary embedding the config asks for (SGLang's `get_rope`): `LongRotaryEmbedding`
    for LongRoPE, else `RotaryEmbedding`; arguments as theirs.

    Raises
    ------
    ModelLoadError
        For an unsupported rope_type or malformed LongRoPE factors.
    """
    _, scaling = params if params is not None else rope_parameters(config)
    cls = LongRotaryEmbedding if scaling["rope_type"] in LONGROPE_TYPES else RotaryEmbedding
    return cls(config, head_dim, max_positions, dtype, device, params)


def apply_rotary_(ops: LayerOps, x: torch.Tensor, rotary: RotaryStep) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of every head of x by its token's position.

    x: (num_tokens, heads, head_dim), q's and/or k's heads; `rotary_dim` is the
    tables' width (`rotary.cos_table.shape[-1]`). Full-width rotary goes straight to
    `ops.rotary_` (in place on the CPU); partial rotary (Phi-3.5/4-mini's
    `partial_rotary_factor`) rotates the leading dims and leaves the rest, as
    transformers' Phi-3 `apply_rotary_pos_emb` does, writing them back into x.
    Returns the rotated tensor (x itself for partial rotary).
    """
    rotary_dim = rotary.cos_table.shape[-1]
    if rotary_dim == x.shape[-1]:
        return ops.rotary_(x, rotary)
    x[..., :rotary_dim] = ops.rotary_(x[..., :rotary_dim], rotary)
    return x
