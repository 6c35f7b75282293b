"""Rank 0 tells the other tensor-parallel ranks what to run, one message per step.

One scheduler (rank 0's) decides every step and allocates every KV slot. Before its own
forward, rank 0 broadcasts the step's `ForwardBatch` tensors and metadata as a `ForwardStep`
(CPU tensors, pickled over the gloo group), with the `req_to_token` rows the step reads, so
that each rank's copy of that table (and so its paged attention over its own heads' K/V)
matches rank 0's. The other ranks rebuild the batch on their own pools and run the same
forward; their collectives pair with rank 0's. `KeepAlive` goes out when rank 0 has sent
nothing for `KEEP_ALIVE_S` (an idle server), so a waiting rank never reaches the group's
timeout; `ShutdownRanks` ends their loops. SGLang's ranks each run a scheduler fed by a
`broadcast_pyobj` of the requests; here only the batch travels, the bookkeeping stays on rank 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from arborlm.runtime.distributed.communication import broadcast_object
from arborlm.runtime.distributed.parallel_state import ParallelState
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

# Rank 0 broadcasts a keep-alive when it has sent nothing for this long (seconds).
KEEP_ALIVE_S = 5.0


@dataclass
class ForwardStep:
    """One step's `ForwardBatch` as it travels to the other ranks (CPU tensors, int64 unless said).

    req_to_token_rows: (batch_size, max(seq_lens)) int32, `req_to_token[req_pool_indices, :max(seq_lens)]`
        of rank 0 after its scheduler wrote the step's slots.
    The other fields are `ForwardBatch`'s of the same name.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    return_full_logits: bool
    req_to_token_rows: torch.Tensor

    @classmethod
    def from_batch(cls, fb: ForwardBatch) -> ForwardStep:
        """The message of `fb` (rank 0), its tensors copied to the CPU."""
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, : max(fb.seq_lens_cpu, default=0)]
        return cls(
            fb.forward_mode, fb.input_ids.cpu(), fb.positions.cpu(), fb.req_pool_indices.cpu(), fb.seq_lens.cpu(),
            fb.out_cache_loc.cpu(), fb.extend_prefix_lens.cpu(), fb.extend_seq_lens.cpu(), list(fb.seq_lens_cpu),
            list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu), fb.return_full_logits, rows.cpu(),
        )

    def to_batch(self, req_to_token_pool, token_to_kv_pool) -> ForwardBatch:
        """The step on this rank's pools: the rows written into its `req_to_token`, tensors on its device."""
        device = token_to_kv_pool.device
        width = self.req_to_token_rows.shape[1]
        rows = self.req_pool_indices.to(req_to_token_pool.req_to_token.device)
        req_to_token_pool.req_to_token[rows, :width] = self.req_to_token_rows.to(req_to_token_pool.req_to_token.device)
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=int(self.req_pool_indices.shape[0]),
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            req_pool_indices=self.req_pool_indices.to(device),
            seq_lens=self.seq_lens.to(device),
            out_cache_loc=self.out_cache_loc.to(device),
            extend_prefix_lens=self.extend_prefix_lens.to(device),
            extend_seq_lens=self.extend_seq_lens.to(device),
            seq_lens_cpu=self.seq_lens_cpu,
            extend_prefix_lens_cpu=self.extend_prefix_lens_cpu,
            extend_seq_lens_cpu=self.extend_seq_lens_cpu,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            return_full_logits=self.return_full_logits,
        )


@dataclass
class KeepAlive:
    """Rank 0 is alive and idle."""


@dataclass
class ShutdownRanks:
    """Rank 0 is stopping: the other ranks leave their loops."""


StepMessage = ForwardStep | KeepAlive | ShutdownRanks


class StepBroadcaster:
    """Rank 0's side: sends each step (`send_forward`), keep-alives and the shutdown.

    Every method raises RuntimeError (from torch.distributed) when another rank is gone;
    after that, or after `mark_failed`, `failure` says why and the server cannot go on: the
    ranks' collectives would no longer pair (they would hang, or mix one step's data with
    another's), so `keep_alive` raises and rank 0's process ends (fail-stop).
    """

    def __init__(self, parallel: ParallelState):
        if parallel.tp_rank != 0:
            raise ValueError(f"StepBroadcaster runs on rank 0, not tp_rank={parallel.tp_rank}")
        self.parallel = parallel
        self.failure: str | None = None
        self._last_sent = time.monotonic()

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def mark_failed(self, reason: str) -> None:
        """Record that the group is out of step (e.g. rank 0's forward raised after the broadcast)."""
        self.failure = self.failure or reason

    def send_forward(self, forward_batch: ForwardBatch) -> None:
        """Tell the other ranks to run `forward_batch` (call right before rank 0's own forward)."""
        self._send(ForwardStep.from_batch(forward_batch))

    def keep_alive(self) -> None:
        """Broadcast a `KeepAlive` when nothing went out for `KEEP_ALIVE_S` (call once per loop iteration).

        Raises
        ------
        RuntimeError
            When an earlier broadcast failed or this one does: a rank is gone.
        """
        if self.failed:
            raise RuntimeError(f"tensor parallelism cannot go on: {self.failure}")
        if time.monotonic() - self._last_sent >= KEEP_ALIVE_S:
            self._send(KeepAlive())

    def shutdown(self) -> None:
        """Tell the other ranks to exit; a failure is logged, not raised (they may be gone already)."""
        if self.failed:
            return
        try:
            self._send(ShutdownRanks())
        except RuntimeError as e:
            logger.warning("could not tell the tensor-parallel ranks to stop: %s", e)

    def _send(self, message: StepMessage) -> None:
        try:
            broadcast_object(self.parallel, message)
        except RuntimeError as e:
            self.mark_failed(f"a broadcast to the other ranks failed ({e})")
            raise
        self._last_sent = time.monotonic()


def receive_step(parallel: ParallelState) -> StepMessage:
    """A rank > 0: wait for rank 0's next message (RuntimeError when rank 0 is gone or the
    group's timeout passes)."""
    return broadcast_object(parallel)
