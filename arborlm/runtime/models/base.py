"""What every model family provides to the runtime (`CausalLM`).

`model_loader.load_model` builds the class `registry.model_class` names, fills it
with `load_weights`, and the model runner calls `forward` once per step. A new
family is one module in this package that meets this protocol plus one entry in
`registry.MODELS`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from arborlm.kernels.cpu_ops import LayerOps
    from arborlm.runtime.forward_batch_info import ForwardBatch, LogitsOutput
    from arborlm.runtime.layers.attention.base import AttentionBackend


class CausalLM(Protocol):
    """A decoder-only LM over the paged KV pools (an `nn.Module`)."""

    def __init__(
        self, config, dtype: torch.dtype, device: torch.device, attn_backend: AttentionBackend,
        ops: LayerOps | None = None,
    ):
        """Build the layers with uninitialised weights.

        Parameters
        ----------
        config: the transformers config of the checkpoint.
        dtype, device: of weights and activations.
        attn_backend: shared by every layer; the model calls its
            `init_forward_metadata` once per step before the first layer.
        ops: norm / activation / rotary / linear implementations (`kernels.cpu_ops.layer_ops`).

        Raises
        ------
        ModelLoadError
            For a config this implementation does not cover (e.g. a rope_type).
        """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's Hugging Face-named weights in, then prepack linears.

        Raises
        ------
        ModelLoadError
            For an unknown name, a shape mismatch, or a weight left unloaded.
        """

    def forward(self, forward_batch: ForwardBatch) -> LogitsOutput:
        """One EXTEND or DECODE step: writes the new tokens' K/V into
        `forward_batch.token_to_kv_pool` and returns float32 logits at each request's
        last new token (and at every new token when `return_full_logits`)."""
