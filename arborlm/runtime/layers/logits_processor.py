"""From the last hidden states of a step to the `LogitsOutput` the model worker samples from.

Every causal LM computes its logits the same way around its own final norm and head
(SGLang's LogitsProcessor): in a decode step every row is a request's next token; in an
extend step only each request's last new token is, unless the step asked for the logits
of every token (prompt logprobs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from arborlm.runtime.forward_batch_info import ForwardBatch, LogitsOutput


def logits_output(
    hidden: torch.Tensor,
    forward_batch: ForwardBatch,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> LogitsOutput:
    """Logits at each request's next-token position, and at every new token when asked.

    Parameters
    ----------
    hidden: (num_new_tokens, hidden_size) in the model dtype, the decoder's output.
    forward_batch: the step (`forward_mode`, `extend_seq_lens_cpu`, `return_full_logits`).
    compute_logits: the model's final norm + head (+ soft-cap), rows -> (rows, vocab) float32;
        applied only to the rows needed.
    """
    if forward_batch.forward_mode.is_decode():
        full = compute_logits(hidden)
        return LogitsOutput(next_token_logits=full, full_logits=full if forward_batch.return_full_logits else None)
    last = torch.tensor(forward_batch.extend_seq_lens_cpu, device=hidden.device).cumsum(0) - 1
    if forward_batch.return_full_logits:
        full = compute_logits(hidden)
        return LogitsOutput(next_token_logits=full[last], full_logits=full)
    return LogitsOutput(next_token_logits=compute_logits(hidden[last]))
