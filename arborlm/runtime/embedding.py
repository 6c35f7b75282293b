"""The model worker's embedding step (`--is-embedding`): hidden states pooled into one vector per request.

An embedding request is a prefill-only request (``max_new_tokens`` 0): the
scheduler admits and batches it like any prompt (chunked when long) and
finishes it once its prompt is in; no token is sampled. For each step the
`Embedder` runs the model's decoder and final norm over the step's new tokens
(`hidden_states`, ``(num_new_tokens, hidden_size)``) and pools each request's
rows as its `PoolingConfig` says. A prompt prefilled in several chunks is
pooled across them (the scheduler chunks one request at a time, so one
partial is kept). Embedding servers keep no prefix cache (mean and CLS pooling
need every token's hidden state, which a cached prefix does not give again),
so every prompt is computed whole.

The vector returned is float32 as a list of floats, not yet normalized: the
front truncates it to `dimensions` first, then normalizes (`pooling_config.normalized`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.forward_batch_info import ForwardBatch
from arborlm.runtime.pooling_config import PoolingConfig


@dataclass
class _Partial:
    """The pooling so far of the one request being prefilled in chunks."""

    rid: str
    total: torch.Tensor  # (hidden,) float32: the sum of rows (mean) or the first row (cls)
    count: int


class Embedder:
    """Pools hidden states per request (see the module docstring).

    Parameters
    ----------
    model: the loaded model; it must have ``hidden_states(forward_batch)``.
    pooling: the checkpoint's pooling.

    Raises
    ------
    ModelLoadError: a model family without `hidden_states`.
    """

    def __init__(self, model, pooling: PoolingConfig):
        if not callable(getattr(model, "hidden_states", None)):
            raise ModelLoadError(f"{type(model).__name__} cannot serve embeddings (--is-embedding): it has no "
                                 "hidden_states(); the Llama family (Llama, Qwen2/3, Mistral, Phi-3) has")
        self.model = model
        self.pooling = pooling
        self._partial: _Partial | None = None

    def forward(self, forward_batch: ForwardBatch, rids: list[str], prompt_lens: list[int]
                ) -> list[list[float] | None]:
        """One extend step: per request, its pooled vector when this step ends its prompt, else None.

        Parameters
        ----------
        forward_batch: an EXTEND step (`extend_prefix_lens_cpu`, `extend_seq_lens_cpu`).
        rids, prompt_lens: per request of the step, its id and its whole prompt's length.
        """
        hidden = self.model.hidden_states(forward_batch).float()  # (num_new_tokens, hidden)
        out: list[list[float] | None] = []
        offset = 0
        for rid, start, n, prompt_len in zip(rids, forward_batch.extend_prefix_lens_cpu,
                                              forward_batch.extend_seq_lens_cpu, prompt_lens):
            rows = hidden[offset:offset + n]
            offset += n
            vector = self._pool(rid, rows, start, start + n >= prompt_len)
            out.append(None if vector is None else vector.tolist())
        return out

    def _pool(self, rid: str, rows: torch.Tensor, start: int, last: bool) -> torch.Tensor | None:
        """This chunk's share of request `rid`'s vector; the vector once `last`."""
        if self.pooling.pooling == "last":
            return rows[-1] if last else None
        mean = self.pooling.pooling == "mean"
        part = rows.sum(0) if mean else rows[0]
        if start > 0 and self._partial is not None and self._partial.rid == rid:
            if mean:
                self._partial.total += part
                self._partial.count += rows.shape[0]
            part, count = self._partial.total, self._partial.count
        else:
            count = rows.shape[0]  # a first chunk; a partial of another (aborted) request is dropped
        if not last:
            self._partial = _Partial(rid, part.clone(), count)
            return None
        if self._partial is not None and self._partial.rid == rid:
            self._partial = None  # (a request finished in this step beside a chunked one keeps its partial)
        return part / count if mean else part

