"""The gated activations of a decoder's feed-forward block: `act(gate) * up`.

`GatedMLP` (`layers/mlp.py`) projects the hidden states to the fused gate/up
output `(num_tokens, 2 * intermediate_size)` and hands it to the function
`gated_activation` picks from the config's `hidden_act` / `hidden_activation`:
SwiGLU (Llama, Qwen2, Mistral, Phi-3) keeps its one native CPU kernel
(`LayerOps.silu_and_mul`); GeGLU (Gemma's `gelu_pytorch_tanh`) is plain torch.
Names follow transformers' `ACT2FN`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import LayerOps

GatedActivation = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation: `gelu_tanh(gate) * up`.

    gate_up: (num_tokens, 2 * inter), gate first (any float dtype);
    returns (num_tokens, inter) in its dtype. transformers' `gelu_pytorch_tanh`
    (`GELUTanh`, i.e. `F.gelu(x, approximate="tanh")`), as Gemma 1-3 use it.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the exact (erf) GELU: `gelu(gate) * up`; shapes as `gelu_tanh_and_mul`
    (transformers' `gelu`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


# transformers' names that mean SiLU; the rest of `_TORCH` have no native kernel.
_SILU_NAMES = ("silu", "swish")
_TORCH: dict[str, GatedActivation] = {"gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu": gelu_and_mul}
SUPPORTED_ACTIVATIONS: tuple[str, ...] = (*_SILU_NAMES, *_TORCH)


def gated_activation(name: str, ops: LayerOps) -> GatedActivation:
    """The `act(gate) * up` function for the config's activation name.

    SiLU goes to `ops.silu_and_mul` (one native kernel on the CPU); the others are
    torch ops on any device.

    Raises
    ------
    ModelLoadError
        For a name outside `SUPPORTED_ACTIVATIONS`, naming it and the supported ones.
    """
    if name in _SILU_NAMES:
        return ops.silu_and_mul
    if name in _TORCH:
        return _TORCH[name]
    raise ModelLoadError(f"activation {name!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
