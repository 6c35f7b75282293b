"""Owns the model and its memory: sizes and allocates the KV pools, runs forward steps.

The scheduler hands it a `ForwardBatch` and gets logits back; sampling happens
in the scheduler with `sampling.Sampler`. Pool sizes come from
`max_total_tokens` or a fraction of free memory.

Under tensor parallelism (`tp_size` > 1) every rank has one: it loads that rank's
shards and holds that rank's K/V heads in pools of the same slots as rank 0's
(the smallest size any rank's memory allows). Rank 0's broadcasts each step to the
others before its own forward (`distributed/step_sync.py`).
"""

from __future__ import annotations

import logging
import os

import torch

from arborlm.radix_cache.memory_pool import (
    ReqToTokenPool,
    TokenToKVPool,
    TokenToKVPoolAllocator,
    kv_cache_torch_dtype,
)
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.distributed.communication import all_reduce_min, barrier
from arborlm.runtime.distributed.parallel_state import ParallelState
from arborlm.runtime.distributed.step_sync import StepBroadcaster
from arborlm.runtime.forward_batch_info import ForwardBatch, LogitsOutput
from arborlm.runtime.io_struct import ModelInfo
from arborlm.runtime.model_loader import (
    load_model,
    resolve_checkpoint,
    resolve_dtype,
    resolve_quantization,
    set_cpu_threads,
)

logger = logging.getLogger(__name__)

# Request rows beyond max_running_requests; rows are taken at admission only.
EXTRA_REQ_ROWS = 4
# Keep the CPU KV pool modest by default: the model shares the machine's RAM.
MAX_DEFAULT_CPU_TOKENS = 1 << 17


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_device(name: str) -> torch.device:
    """The device `--device` names: "auto" is cuda when torch sees one, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    """Loads the model and the pools described by `server_args`.

    parallel: this process's tensor-parallel rank (`distributed.init_parallel_state`); None
        for a single rank. With tp_size > 1 a GGUF file is dequantized at load (the
        shards are float) and rank 0 gets a `step_broadcaster`.

    Raises
    ------
    ModelLoadError
        When the model path is missing or its architecture unsupported.
    ValueError
        With tp_size > 1: an architecture served on one rank only, or head / MLP sizes the
        ranks do not divide (naming tp_size and the size).
    """

    def __init__(self, server_args: ServerArgs, parallel: ParallelState | None = None):
        self.server_args = server_args
        self.device = resolve_device(server_args.model.device) if parallel is None else parallel.device
        self.parallel = parallel if parallel is not None else ParallelState(device=self.device)
        if self.device.type == "cpu":
            set_cpu_threads()  # this process's cores: a data-parallel worker's or rank's slice (`cpu_binding`)
        self.dtype = resolve_dtype(server_args.model.dtype, self.device)
        self.kv_dtype = kv_cache_torch_dtype(server_args.cache.kv_cache_dtype, self.dtype)
        quantization = server_args.model.quantization
        if self.parallel.is_parallel and quantization is None:
            quantization = "none"  # tensor-parallel layers shard float weights
        gguf_file = resolve_quantization(server_args.model.model_path, quantization)
        self.quantization = "gguf" if gguf_file is not None else (quantization or "none")
        checkpoint = self._resolve_checkpoint_once(gguf_file is None)
        loaded = load_model(
            checkpoint, self.dtype, self.device, server_args.model.attention_backend,
            cpu_kernels=not server_args.model.disable_cpu_kernels, gguf_file=gguf_file,
            quantization=quantization, kv_cache_dtype=server_args.cache.kv_cache_dtype,
            is_embedding=server_args.model.is_embedding, parallel=parallel,
        )
        self.model, self.hf_config, self.checkpoint = loaded.model, loaded.hf_config, loaded.checkpoint
        self.architecture = loaded.architecture
        self.step_broadcaster = (StepBroadcaster(self.parallel)
                                 if self.parallel.is_parallel and self.parallel.tp_rank == 0 else None)
        self._init_pools()

    def _resolve_checkpoint_once(self, weights: bool):
        """`resolve_checkpoint`; with several ranks rank 0 goes first (a GGUF file is converted
        once into the shared cache) and the others then find the converted folder."""
        path = self.server_args.model.model_path
        if self.parallel.tp_rank > 0:
            barrier(self.parallel)
        checkpoint = resolve_checkpoint(path, weights=weights)
        if self.parallel.is_parallel and self.parallel.tp_rank == 0:
            barrier(self.parallel)
        return checkpoint

    def _init_pools(self) -> None:
        cfg = self.hf_config
        num_kv_heads = self.parallel.kv_head_range(cfg.num_key_value_heads).size  # this rank's
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        max_total_tokens = self.server_args.cache.max_total_tokens
        if max_total_tokens is None:
            per_token = TokenToKVPool.bytes_per_token(cfg.num_hidden_layers, num_kv_heads, head_dim, self.kv_dtype)
            budget = _available_memory_bytes(self.device) * self.server_args.cache.mem_fraction
            max_total_tokens = int(budget // per_token)
            if self.device.type == "cpu":
                max_total_tokens = min(max_total_tokens, MAX_DEFAULT_CPU_TOKENS)
        # Slot indices are rank 0's on every rank: every pool has the size the smallest memory allows.
        max_total_tokens = all_reduce_min(self.parallel, max_total_tokens)
        model_len = getattr(cfg, "max_position_embeddings", 4096)
        context_length = self.server_args.model.context_length or model_len
        if context_length > model_len:
            raise ValueError(
                f"context_length={context_length} is longer than the model's "
                f"max_position_embeddings={model_len}"
            )
        # A request must fit in the pool on its own.
        self.context_length = min(context_length, max_total_tokens)
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = self.server_args.scheduler.max_running_requests
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + EXTRA_REQ_ROWS, self.context_length + 4, self.device
        )
        self.token_to_kv_pool = TokenToKVPool(
            max_total_tokens, cfg.num_hidden_layers, num_kv_heads, head_dim, self.kv_dtype, self.device
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens)
        logger.info(
            "model %s (%s, %s on %s); KV pool %d tokens, context %d",
            self.checkpoint, cfg.architectures, self.dtype, self.device, max_total_tokens, self.context_length,
        )

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def eos_token_ids(self, tokenizer) -> tuple[int, ...]:
        """EOS ids from the model config, its generation config (if any) and the tokenizer."""
        from transformers import GenerationConfig

        try:
            generation_eos = GenerationConfig.from_pretrained(str(self.checkpoint)).eos_token_id
        except OSError:  # no generation_config.json in the checkpoint
            generation_eos = None
        ids: set[int] = set()
        for source in (self.hf_config.eos_token_id, generation_eos, getattr(tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return tuple(sorted(ids))

    def model_info(self, tokenizer) -> ModelInfo:
        return ModelInfo(
            checkpoint=str(self.checkpoint),
            architecture=self.architecture,
            dtype=str(self.dtype).replace("torch.", ""),
            device=str(self.device),
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            max_total_tokens=self.max_total_tokens,
            max_running_requests=self.max_running_requests,
            eos_token_ids=self.eos_token_ids(tokenizer),
            quantization=self.quantization,
        )

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsOutput:
        """Run one extend or decode step; logits are float32.

        On rank 0 of several, the other ranks are sent the step first (RuntimeError when one is gone);
        a forward that then raises leaves the ranks out of step, and the broadcaster is marked failed.
        """
        if self.step_broadcaster is None:
            return self.model.forward(forward_batch)
        self.step_broadcaster.send_forward(forward_batch)
        try:
            return self.model.forward(forward_batch)
        except Exception as e:
            self.step_broadcaster.mark_failed(f"rank 0's forward raised {type(e).__name__} midway")
            raise
