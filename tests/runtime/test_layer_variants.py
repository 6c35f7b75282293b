"""The layer variants Gemma 3 and Phi-3 brought: gated activations, the unit-offset
RMSNorm, partial rotary and LongRoPE, each against transformers' own code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import LayerOps, layer_ops
from arborlm.runtime.forward_batch_info import ForwardMode
from arborlm.runtime.layers.activation import SUPPORTED_ACTIVATIONS, gated_activation
from arborlm.runtime.layers.layernorm import RMSNorm, prepare_norms
from arborlm.runtime.layers.rotary_embedding import (
    LongRotaryEmbedding,
    RotaryEmbedding,
    apply_rotary_,
    get_rope,
    rope_parameters,
)

OPS = {"torch": LayerOps(), "native": layer_ops("cpu")}


# ---------------------------------------------------------------- activations


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu", "silu"])
def test_gated_activation_matches_transformers(name):
    from transformers.activations import ACT2FN

    gate_up = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(0)) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(gated_activation(name, LayerOps())(gate_up), ACT2FN[name](gate) * up)


def test_silu_keeps_the_native_kernel():
    ops = OPS["native"]
    assert gated_activation("silu", ops) == ops.silu_and_mul


def test_unknown_activation_names_the_supported_ones():
    with pytest.raises(ModelLoadError, match="'relu2'") as info:
        gated_activation("relu2", LayerOps())
    assert all(name in str(info.value) for name in SUPPORTED_ACTIVATIONS)


# ---------------------------------------------------------------- unit-offset RMSNorm


def gemma_norm(dim: int, dtype, ops) -> tuple[RMSNorm, torch.nn.Module]:
    """Ours and transformers' Gemma 3 norm with the same random weight."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    theirs = Gemma3RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(1)) * 0.3)
    theirs = theirs.to(dtype)
    ours = RMSNorm(dim, 1e-6, dtype, torch.device("cpu"), ops, unit_offset=True)
    ours.weight.data.copy_(theirs.weight)
    prepare_norms(ours)
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ops", sorted(OPS))
def test_unit_offset_norm_matches_gemma3(dtype, ops):
    ours, theirs = gemma_norm(48, dtype, OPS[ops])
    x = torch.randn(7, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    residual = torch.randn(7, 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    atol = 1e-6 if dtype == torch.float32 else 0.0  # bf16: one rounding of the same float32 value
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=atol, rtol=0)
        normed, summed = ours(x, residual.clone())
        torch.testing.assert_close(summed, residual + x, atol=0, rtol=0)
        torch.testing.assert_close(normed, theirs(residual + x), atol=atol, rtol=0)


def test_unit_offset_scale_is_float32():
    ours, _ = gemma_norm(16, torch.bfloat16, LayerOps())
    assert ours.scale.dtype == torch.float32
    torch.testing.assert_close(ours.scale, 1.0 + ours.weight.float(), atol=0, rtol=0)


def test_plain_norm_has_no_offset():
    norm = RMSNorm(8, 1e-6, torch.float32, torch.device("cpu"), LayerOps())
    norm.weight.data.fill_(2.0)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-6))


# ---------------------------------------------------------------- rotary


def phi3_config(**rope):
    from transformers import Phi3Config

    g = torch.Generator().manual_seed(4)
    params = {
        "rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
        "short_factor": (1 + torch.rand(6, generator=g)).tolist(),
        "long_factor": (1 + 8 * torch.rand(6, generator=g)).tolist(), **rope,
    }
    return Phi3Config(
        hidden_size=96, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        original_max_position_embeddings=64, rope_parameters=params,
    )


def hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Phi-3 cos/sin (num_tokens, rotary_dim) for positions of one sequence."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = Phi3RotaryEmbedding(config)
    return tuple(t[0] for t in rope(torch.zeros(1, dtype=torch.float32), positions[None]))


@pytest.mark.parametrize("seq_len", [40, 100], ids=["short", "long"])
@pytest.mark.parametrize("ops", sorted(OPS))
def test_partial_longrope_matches_phi3(seq_len, ops):
    """Rotating a request's q/k heads equals transformers' `apply_rotary_pos_emb` with
    the cos/sin of the factor set its length picks."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = phi3_config()
    rope = get_rope(config, 24, 512, torch.float32, torch.device("cpu"))
    assert isinstance(rope, LongRotaryEmbedding) and rope.rotary_dim == 12
    positions = torch.arange(seq_len, dtype=torch.int64)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, seq_lens=torch.tensor([seq_len]), seq_lens_cpu=[seq_len],
        extend_seq_lens=torch.tensor([seq_len]),
    )
    qk = torch.randn(seq_len, 6, 24, generator=torch.Generator().manual_seed(5))
    cos, sin = hf_cos_sin(config, positions)
    q_want, _ = apply_rotary_pos_emb(qk.transpose(0, 1)[None], qk.transpose(0, 1)[None], cos[None], sin[None])
    got = apply_rotary_(OPS[ops], qk.clone(), rope.step(positions, batch))
    torch.testing.assert_close(got, q_want[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_longrope_picks_the_set_per_request():
    """In one step, a request of 100 tokens takes the long table, one of 30 the short."""
    rope = get_rope(phi3_config(), 24, 512, torch.float32, torch.device("cpu"))
    extend = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, seq_lens=torch.tensor([100, 30]), seq_lens_cpu=[100, 30],
        extend_seq_lens=torch.tensor([2, 3]),
    )
    positions = torch.tensor([98, 99, 27, 28, 29])
    assert rope.step(positions, extend).positions.tolist() == [610, 611, 27, 28, 29]
    decode = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([65, 64]), seq_lens_cpu=[65, 64],
        extend_seq_lens=torch.tensor([1, 1]),
    )
    assert rope.step(torch.tensor([64, 63]), decode).positions.tolist() == [576, 63]


@pytest.mark.parametrize("rope_type, cls", [
    ("longrope", LongRotaryEmbedding), ("su", LongRotaryEmbedding), ("default", RotaryEmbedding),
])
def test_get_rope_dispatches_on_rope_type(rope_type, cls):
    config = SimpleNamespace(max_position_embeddings=128, original_max_position_embeddings=32)
    scaling = {"rope_type": rope_type, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    assert type(get_rope(config, 8, 128, torch.float32, torch.device("cpu"), params=(100.0, scaling))) is cls


def test_unsupported_rope_type_lists_the_supported_ones():
    with pytest.raises(ModelLoadError, match="'yarn' is not supported; supported: .*longrope"):
        get_rope(SimpleNamespace(), 8, 16, torch.float32, torch.device("cpu"), params=(1e4, {"rope_type": "yarn"}))


def test_rope_parameters_of_a_layer_type():
    config = SimpleNamespace(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    })
    assert rope_parameters(config, "full_attention") == (1e6, {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1e6})
    assert rope_parameters(config, "sliding_attention")[0] == 1e4
