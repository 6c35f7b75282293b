"""Rotary position embedding (RoPE): the cos/sin tables and their frequencies.

Built once per model from the Hugging Face config (`rope_theta`, `rope_scaling` /
`rope_parameters`); each step takes a `RotaryStep` of its positions, which
`LayerOps.rotary_` applies to q and k together (a native kernel on the CPU).
Frequencies follow transformers' `modeling_rope_utils` (default, linear, llama3).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import RotaryStep


def rope_parameters(config) -> tuple[float, dict]:
    """`(rope_theta, scaling)` from a transformers 5 `rope_parameters` dict or the older
    `rope_theta` / `rope_scaling` attributes; `scaling["rope_type"]` defaults to "default"."""
    params = {**(getattr(config, "rope_scaling", None) or {}), **(getattr(config, "rope_parameters", None) or {})}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    params.setdefault("rope_type", params.get("type", "default"))
    return theta, params


def rotary_inv_freq(config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies `(head_dim // 2,)` float32, with linear or llama3 scaling.

    Raises
    ------
    ModelLoadError
        For a rope_type other than default, linear, llama3.
    """
    theta, scaling = rope_parameters(config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3")


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


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to `max_positions`, precomputed once.

    Buffers `cos`, `sin`: (max_positions, head_dim) in `dtype`. `step(positions)`
    gives the step's `RotaryStep`, which `LayerOps.rotary_` applies to q and k
    together (Hugging Face's `rotate_half` layout). The sin table carries
    `rotate_half`'s sign (its first half negated), so the rotation is a roll and two
    products instead of slices, a negation and a concat, with bit-identical results
    (negation is exact).

    Raises
    ------
    ModelLoadError
        For an unsupported rope_type (see `rotary_inv_freq`).
    """

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        inv_freq = rotary_inv_freq(config, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_positions, head_dim)
        self.register_buffer("cos", emb.cos().to(device=device, dtype=dtype), persistent=False)
        half = head_dim // 2
        signed_sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
        self.register_buffer("sin", signed_sin.to(device=device, dtype=dtype), persistent=False)

    def step(self, positions: torch.Tensor) -> RotaryStep:
        """The rotary inputs of a step; positions (num_tokens,) int64."""
        return RotaryStep(positions, self.cos, self.sin)
