"""Every runtime knob, in frozen dataclasses per concern composed into `ServerArgs`.

`ServerArgs.from_kwargs(**kw)` routes flat keyword arguments (as `Engine(**kw)` and
the CLI receive them) to the concern that owns each field. Each `__post_init__`
raises `ValueError` naming the field and the bad value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from arborlm.chat_template import BUILTIN_CHAT_TEMPLATES, is_template_file
from arborlm.constrained.registry import GRAMMAR_BACKEND_NAMES
from arborlm.runtime.config_checks import check_field as _check
from arborlm.runtime.config_checks import check_types as _check_types
from arborlm.runtime.layers.attention.names import ATTENTION_BACKEND_NAMES
from arborlm.runtime.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight formats served as stored (SGLang's --quantization names); "int8" quantizes a float
# checkpoint's linears per channel at load (SGLang: --torchao-config int8wo); "int4" per group of 32
# (int4wo-32 / int4wo-128: SGLang's --torchao-config names, that group size); "none" dequantizes.
QUANTIZATIONS = ("gguf", "int8", "int4", "int4wo-32", "int4wo-128", "none")
SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ATTENTION_BACKENDS = ATTENTION_BACKEND_NAMES  # one list, torch-free: runtime/layers/attention/names.py
# SGLang's --kv-cache-dtype values served (radix_cache/memory_pool.py KV_CACHE_DTYPES); auto = dtype.
KV_CACHE_DTYPE_NAMES = ("auto", "fp8_e5m2", "fp8_e4m3", "int8")
# --hicache-storage-backend values served (the host tier in a memory-mapped file).
HICACHE_STORAGE_BACKENDS = ("file",)
# The longest the front waits for a scheduler reply (seconds): Prometheus's default scrape timeout.
MAX_REPLY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and in what precision."""

    model_path: str | None = field(
        default=None, metadata={"help": "HF checkpoint folder or GGUF file; default SmolLM2-135M-Instruct"}
    )
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16"})
    context_length: int | None = field(
        default=None, metadata={"help": "max tokens per request (prompt + output); default from the model"}
    )
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    attention_backend: str = field(
        default="auto", metadata={"help": "auto (triton on CUDA, torch elsewhere) | triton | torch | reference"}
    )
    disable_cpu_kernels: bool = field(
        default=False,
        metadata={"help": "on the CPU, use torch ops instead of the C++ kernels (norm, SwiGLU, rotary, decode, sampling)"},
    )
    quantization: str | None = field(
        default=None,
        metadata={"help": "gguf: serve a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K tensors as stored (int8 kernels), "
                          "int8: weight-only int8, per output channel, quantized at load (torchao's int8wo), "
                          "int4 / int4wo-32 / int4wo-128: weight-only 4-bit, a scale and zero point per group of "
                          "32 / 32 / 128 inputs, quantized at load (torchao's int4wo), "
                          "none: dequantize to dtype; default gguf for a quantized GGUF file, else none "
                          "(SGLang's --quantization)"},
    )
    is_embedding: bool = field(
        default=False,
        metadata={"help": "serve an embedding model: /v1/embeddings and /encode, prefill only, pooling from its "
                          "sentence-transformers config (last token, normalized, without one); no generation"},
    )

    def __post_init__(self):
        _check_types(self)
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        _check(
            self.attention_backend in ATTENTION_BACKENDS, "attention_backend", self.attention_backend,
            f"one of {ATTENTION_BACKENDS}",
        )
        if self.attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            import torch

            _check(
                self.device != "cpu" and torch.cuda.is_available(), "attention_backend", self.attention_backend,
                "a backend this machine can run: triton needs a CUDA GPU (or TRITON_INTERPRET=1); use auto or torch",
            )
        _check(self.device in ("auto", "cpu", "cuda"), "device", self.device, "auto, cpu or cuda")
        _check(
            self.quantization in (None, *QUANTIZATIONS), "quantization", self.quantization,
            f"None or one of {QUANTIZATIONS}",
        )
        _check(
            self.quantization != "gguf" or self.model_path is None or self.model_path.endswith(".gguf"),
            "quantization", self.quantization,
            f"a .gguf model file (model_path={self.model_path!r} is not one); use quantization='none' or leave it unset",
        )
        if self.device == "cuda":
            import torch

            _check(torch.cuda.is_available(), "device", self.device, "a device this machine has (no CUDA GPU here)")
        _check(
            self.context_length is None or self.context_length > 0,
            "context_length", self.context_length, "a positive integer",
        )


@dataclass(frozen=True)
class CacheConfig:
    """KV memory pools and the radix cache."""

    max_total_tokens: int | None = field(
        default=None, metadata={"help": "KV pool size in tokens; default from mem_fraction"}
    )
    mem_fraction: float = field(
        default=0.1, metadata={"help": "fraction of free device memory given to the KV pool"}
    )
    page_size: int = field(default=1, metadata={"help": "tokens per radix-cache page"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "turn prefix sharing off"})
    kv_cache_dtype: str = field(
        default="auto",
        metadata={"help": "KV pool storage: auto (the model dtype) | fp8_e5m2 | fp8_e4m3 | int8 (one byte per "
                          "value, int8 with a scale per token and head: about twice the tokens of bf16; attention "
                          "reads it upcast)"},
    )
    enable_hierarchical_cache: bool = field(
        default=False,
        metadata={"help": "keep radix nodes evicted from the KV pool in a host tier and load them back on a "
                          "prefix hit instead of recomputing them (SGLang's HiCache)"},
    )
    hicache_ratio: float = field(
        default=2.0, metadata={"help": "host tier size as a multiple of the KV pool's tokens"}
    )
    hicache_size: int = field(
        default=0, metadata={"help": "host tier size in GB (10^9 bytes); overrides hicache_ratio when > 0"}
    )
    hicache_storage_backend: str | None = field(
        default=None,
        metadata={"help": "where the host tier lives: host memory when unset (pinned on CUDA) | file "
                          "(a memory-mapped temporary file, which may be larger than RAM)"},
    )

    def __post_init__(self):
        _check_types(self)
        _check(
            self.max_total_tokens is None or self.max_total_tokens > 0,
            "max_total_tokens", self.max_total_tokens, "a positive integer",
        )
        _check(0 < self.mem_fraction <= 1, "mem_fraction", self.mem_fraction, "a value in (0, 1]")
        _check(self.page_size >= 1, "page_size", self.page_size, "an integer >= 1")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPE_NAMES, "kv_cache_dtype", self.kv_cache_dtype,
               f"one of {KV_CACHE_DTYPE_NAMES}")
        _check(not (self.kv_cache_dtype == "int8" and self.enable_hierarchical_cache), "kv_cache_dtype",
               self.kv_cache_dtype, "not int8 with enable_hierarchical_cache (the host tier does not copy its scales)")
        _check(self.hicache_ratio > 0, "hicache_ratio", self.hicache_ratio, "a value > 0")
        _check(self.hicache_size >= 0, "hicache_size", self.hicache_size, "GB >= 0 (0: use hicache_ratio)")
        _check(self.hicache_storage_backend in (None, *HICACHE_STORAGE_BACKENDS), "hicache_storage_backend",
               self.hicache_storage_backend, f"unset or one of {HICACHE_STORAGE_BACKENDS}")
        _check(not (self.enable_hierarchical_cache and self.disable_radix_cache), "enable_hierarchical_cache",
               self.enable_hierarchical_cache, "False when disable_radix_cache is set (the tiers hold radix nodes)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission, batching and preemption."""

    max_running_requests: int = field(default=64, metadata={"help": "max requests decoding together"})
    max_prefill_tokens: int = field(default=4096, metadata={"help": "token budget of one prefill batch"})
    chunked_prefill_size: int = field(
        default=2048, metadata={"help": "prompts longer than this are prefilled in chunks; -1 disables"}
    )
    schedule_policy: str = field(default="lpm", metadata={"help": "lpm | fcfs | dfs-weight"})
    enable_mixed_chunk: bool = field(
        default=True,
        metadata={"help": "running requests decode their next token inside each prefill step "
                          "instead of waiting for it (SGLang's --enable-mixed-chunk)"},
    )
    init_new_token_ratio: float = field(
        default=0.7, metadata={"help": "initial share of max_new_tokens reserved at admission"}
    )
    min_new_token_ratio: float = field(default=0.1, metadata={"help": "floor of that share"})
    new_token_ratio_decay: float = field(
        default=0.001, metadata={"help": "how much the share falls each decode step without retraction"}
    )
    random_seed: int = field(default=0, metadata={"help": "seed for requests that give none"})
    max_queued_requests: int | None = field(
        default=None,
        metadata={"help": "requests accepted beyond max_running_requests (counted at the front); "
                          "more are refused (HTTP 503); default unbounded"},
    )
    watchdog_timeout: float = field(
        default=300.0,
        metadata={"help": "seconds the scheduler's loop may go without progress while it has work before its "
                          "watchdog ends the scheduler process (the server then stops); SGLang's name and default"},
    )

    def __post_init__(self):
        _check_types(self)
        _check(self.max_running_requests >= 1, "max_running_requests", self.max_running_requests, ">= 1")
        _check(self.max_prefill_tokens >= 1, "max_prefill_tokens", self.max_prefill_tokens, ">= 1")
        _check(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
            "chunked_prefill_size", self.chunked_prefill_size, "-1 or >= 1",
        )
        _check(
            self.schedule_policy in SCHEDULE_POLICIES,
            "schedule_policy", self.schedule_policy, f"one of {SCHEDULE_POLICIES}",
        )
        _check(
            0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1,
            "init_new_token_ratio", self.init_new_token_ratio,
            "0 <= min_new_token_ratio <= init_new_token_ratio <= 1",
        )
        _check(
            self.max_queued_requests is None or self.max_queued_requests >= 0,
            "max_queued_requests", self.max_queued_requests, "None or >= 0",
        )
        _check(self.watchdog_timeout > 0, "watchdog_timeout", self.watchdog_timeout, "> 0 seconds")

    @property
    def reply_timeout_s(self) -> float:
        """Seconds the front waits for the scheduler's answer to an info or flush request.

        The answer comes between two steps, so a long wait means a long step; past
        `watchdog_timeout` the watchdog ends the scheduler anyway, so waiting longer
        is pointless, and /metrics must answer within a scrape's timeout (10 s).
        """
        return min(self.watchdog_timeout, MAX_REPLY_TIMEOUT_S)


GRAMMAR_BACKENDS = GRAMMAR_BACKEND_NAMES  # one list, torch-free: constrained/registry.py


@dataclass(frozen=True)
class GrammarConfig:
    """Grammar-constrained decoding (see `arborlm.constrained`)."""

    # auto: xgrammar for every schema it takes, llguidance for the rest; the only choice with
    # JSONSchemaBench coverage >= 0.98 in every sub-dataset (docs/structured_output.md).
    grammar_backend: str = field(default="auto", metadata={"help": " | ".join(GRAMMAR_BACKENDS)})
    grammar_compile_timeout: float = field(
        default=60.0, metadata={"help": "seconds a request may wait for its grammar to compile"}
    )
    # Safe on by default: grammars that could force endless text (`root ::= "a" root`), on
    # which xgrammar's forced-text search never ends, are refused when compiled.
    disable_jump_forward: bool = field(
        default=False, metadata={"help": "do not append the tokens a grammar forces without decoding"}
    )

    def __post_init__(self):
        _check_types(self)
        _check(
            self.grammar_backend in GRAMMAR_BACKENDS,
            "grammar_backend", self.grammar_backend, f"one of {GRAMMAR_BACKENDS}",
        )
        _check(self.grammar_compile_timeout > 0, "grammar_compile_timeout", self.grammar_compile_timeout, "> 0")


# SGLang's --tool-call-parser and --reasoning-parser names (one list each: the formats in
# entrypoints/openai/tool_parsers/registry.py and reasoning_parser.py are keyed by these).
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "mistral", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek-r1")


@dataclass(frozen=True)
class ChatConfig:
    """How `/v1/chat/completions` renders prompts and reads answers (see docs/tool_calls.md)."""

    chat_template: str | None = field(
        default=None,
        metadata={"help": "a Jinja chat template file, or a built-in name ("
                          + " | ".join(BUILTIN_CHAT_TEMPLATES) + "), used instead of the tokenizer's; "
                          "default the tokenizer's own"},
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={"help": "tool-call format: " + " | ".join(TOOL_CALL_PARSERS)
                          + "; default the one the chat template renders (hermes when none)"},
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={"help": "split the model's thinking into reasoning_content: " + " | ".join(REASONING_PARSERS)
                          + "; default off"},
    )

    def __post_init__(self):
        _check_types(self)
        _check(
            self.chat_template is None or self.chat_template in BUILTIN_CHAT_TEMPLATES
            or is_template_file(self.chat_template),
            "chat_template", self.chat_template,
            f"a readable Jinja file or one of {BUILTIN_CHAT_TEMPLATES}",
        )
        _check(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            "tool_call_parser", self.tool_call_parser, f"None or one of {TOOL_CALL_PARSERS}",
        )
        _check(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            "reasoning_parser", self.reasoning_parser, f"None or one of {REASONING_PARSERS}",
        )


# A Host pattern: "*", a name or IPv4 address, "*.suffix", or a bracketed IPv6 address.
_HOST_PATTERN = re.compile(r"\*|(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*|\[[0-9a-f:.]+\]")


def _check_key(name: str, key: str | None) -> None:
    """A bearer key must survive an HTTP header: printable ASCII, no surrounding spaces (which
    the header parser strips, so such a key could never match)."""
    if key is None:
        return
    ok = key != "" and key.isascii() and key.isprintable() and key == key.strip()
    # The value itself stays out of the message: it is a secret.
    _check(ok, name, "<redacted>", "a non-empty key of printable ASCII characters without surrounding spaces "
                                   "(HTTP headers carry ASCII)")


def _host_pattern(host: str) -> str:
    """`host` lower-cased, a bare IPv6 address bracketed as the Host header writes it.

    Raises
    ------
    ValueError: not a name, address, "*" or "*.suffix" (a port is not part of it).
    """
    pattern = host.strip().lower()
    with contextlib.suppress(ValueError):
        pattern = f"[{ipaddress.IPv6Address(pattern)}]"
    _check(_HOST_PATTERN.fullmatch(pattern) is not None, "allowed_hosts", host,
           "host names without a port: 'box.lan', '10.0.0.5', '[fd00::1]', '*.example.com' or '*'")
    return pattern


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front (used by `arborlm serve`)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=30000, metadata={"help": "port to bind"})
    # repr=False: a logged or printed ServerArgs must not show the keys.
    api_key: str | None = field(
        default=None, repr=False,
        metadata={"help": "require 'Authorization: Bearer <key>' on every route but /health and /metrics; "
                          "--api-key-file or ARBORLM_API_KEY keep it out of `ps`", "secret": True},
    )
    admin_api_key: str | None = field(
        default=None, repr=False,
        metadata={"help": "bearer token for the admin routes (flush_cache, abort_all): when set, only it opens "
                          "them; unset, api_key holders may use them (as in SGLang); --admin-api-key-file or "
                          "ARBORLM_ADMIN_API_KEY keep it out of `ps`", "secret": True},
    )
    allowed_hosts: tuple[str, ...] | None = field(
        default=None,
        metadata={"help": "Host header names accepted besides localhost, 127.0.0.1 and [::1] (any port), "
                          "e.g. 'box.lan *.example.com'; '*' accepts any; other names get 400. "
                          "Default: loopback names only when host is a loopback address, any name otherwise"},
    )
    enable_cache_report: bool = field(
        default=False,
        metadata={"help": "report each request's cached prompt tokens (usage.prompt_tokens_details, "
                          "meta_info.cached_tokens); they tell one client which prompts others sent"},
    )
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    served_model_name: str | None = field(
        default=None,
        metadata={"help": "model name the OpenAI API reports and accepts (besides 'default'); "
                          "default the model path, or SmolLM2-135M-Instruct"},
    )
    # 32 MiB holds a full-context prompt as token ids many times over, and big schemas and batches.
    max_request_bytes: int = field(
        default=32 * 1024 * 1024,
        metadata={"help": "largest request body accepted, in bytes; larger ones get 413"},
    )

    def __post_init__(self):
        if isinstance(self.allowed_hosts, (list, str)):  # Engine(allowed_hosts=[...]) or one name
            hosts = [self.allowed_hosts] if isinstance(self.allowed_hosts, str) else self.allowed_hosts
            object.__setattr__(self, "allowed_hosts", tuple(hosts))
        _check_types(self)
        _check_key("api_key", self.api_key)
        _check_key("admin_api_key", self.admin_api_key)
        _check(self.admin_api_key is None or self.admin_api_key != self.api_key, "admin_api_key", "<redacted>",
               "a key other than api_key (the same key would make every api_key holder an admin)")
        if self.allowed_hosts is not None:
            object.__setattr__(self, "allowed_hosts", tuple(_host_pattern(h) for h in self.allowed_hosts))
        _check(0 <= self.port < 65536, "port", self.port, "0..65535")
        _check(self.max_request_bytes >= 1, "max_request_bytes", self.max_request_bytes, ">= 1")
        _check(
            self.log_level in LOG_LEVELS, "log_level", self.log_level, f"one of {LOG_LEVELS}",
        )

    @property
    def binds_loopback(self) -> bool:
        """True when `host` is localhost or a loopback address (only this machine can connect)."""
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


# sglang-router's load-balancing policies (`--policy` of `python -m sglang_router.launch_router`).
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


# The most tensor-parallel ranks one server starts (one process per rank on this machine).
MAX_TP_SIZE = 64


@dataclass(frozen=True)
class ParallelConfig:
    """Data and tensor parallelism: workers behind SGLang's router, one model split over ranks.

    Data parallelism runs several scheduler workers behind `sglang-router`; tensor
    parallelism splits one model over `tp_size` ranks (`arborlm/runtime/distributed/`)."""

    tp_size: int = field(
        default=1,
        metadata={"help": "tensor-parallel ranks: attention heads, MLP columns and the vocabulary split over "
                          "this many processes joined by torch.distributed (gloo on CPU, NCCL on CUDA); "
                          "the model's num_attention_heads must be divisible by it"},
    )
    dp_size: int = field(
        default=1,
        metadata={"help": "number of data-parallel workers (each a full copy of the model with its own KV "
                          "pool and radix cache) behind sglang-router on the one public port; >1 needs "
                          "`pip install arborlm[router]`"},
    )
    router_policy: str = field(
        default="cache_aware",
        metadata={"help": f"how the router picks a worker with --dp-size > 1: one of {ROUTER_POLICIES} "
                          "(cache_aware: the worker whose cache holds the longest prefix, unless load is "
                          "unbalanced)"},
    )
    # sglang-router's cache_aware knobs under SGLang's `--router-*` names (defaults are its own).
    router_cache_threshold: float = field(
        default=0.3,
        metadata={"help": "cache_aware: the least fraction of a request's text a worker's prefix tree must "
                          "match for the request to go there (else the worker with the smallest tree)"},
    )
    router_balance_abs_threshold: int = field(
        default=64,
        metadata={"help": "cache_aware: route to the least-loaded worker instead when the busiest holds more "
                          "than this many requests above the least loaded (and the relative threshold holds)"},
    )
    router_balance_rel_threshold: float = field(
        default=1.5,
        metadata={"help": "cache_aware: ... and the busiest holds more than this times the least loaded's "
                          "requests"},
    )

    def __post_init__(self):
        _check_types(self)
        _check(1 <= self.tp_size <= MAX_TP_SIZE, "tp_size", self.tp_size, f"1..{MAX_TP_SIZE}")
        _check(0.0 <= self.router_cache_threshold <= 1.0, "router_cache_threshold", self.router_cache_threshold,
               "between 0 and 1")
        _check(self.router_balance_abs_threshold >= 0, "router_balance_abs_threshold",
               self.router_balance_abs_threshold, ">= 0")
        _check(self.router_balance_rel_threshold >= 1.0, "router_balance_rel_threshold",
               self.router_balance_rel_threshold, ">= 1")
        _check(1 <= self.dp_size <= 64, "dp_size", self.dp_size, "1..64")
        _check(self.tp_size == 1 or self.dp_size == 1, "tp_size", self.tp_size,
               "1 when dp_size > 1 (data-parallel workers with several tensor-parallel ranks each are not "
               "supported)")
        _check(self.router_policy in ROUTER_POLICIES, "router_policy", self.router_policy,
               f"one of {ROUTER_POLICIES}")


def _check_tensor_parallel(args: ServerArgs) -> None:
    """Refuse, naming the field, what the tensor-parallel path does not cover (`tp_size` > 1)."""
    tp = args.parallel.tp_size
    if tp == 1:
        return
    unsupported = (
        ("quantization", args.model.quantization, args.model.quantization in (None, "none"),
         "None or 'none' (tensor parallelism shards float weights; GGUF files are dequantized at load)"),
        ("enable_hierarchical_cache", args.cache.enable_hierarchical_cache, not args.cache.enable_hierarchical_cache,
         "False (the host KV tier copies rank 0's pool only)"),
        ("kv_cache_dtype", args.cache.kv_cache_dtype, args.cache.kv_cache_dtype == "auto", "'auto'"),
        ("is_embedding", args.model.is_embedding, not args.model.is_embedding,
         "False (embedding servers run on one rank)"),
        ("speculative_algorithm", args.speculative.speculative_algorithm,
         args.speculative.speculative_algorithm != "STANDALONE", "not STANDALONE (the draft model is not sharded)"),
    )
    for name, value, ok, expected in unsupported:
        _check(ok, name, value, f"{expected} with tp_size={tp}")


# Options that only act with another one: (concern, field, the concern's field it needs, what it needs).
_DEPENDENT_OPTIONS = (
    *(("parallel", name, "dp_size > 1", lambda args: args.parallel.dp_size > 1)
      for name in ("router_policy", "router_cache_threshold", "router_balance_abs_threshold",
                   "router_balance_rel_threshold")),
    *(("cache", name, "enable_hierarchical_cache", lambda args: args.cache.enable_hierarchical_cache)
      for name in ("hicache_size", "hicache_ratio", "hicache_storage_backend")),
)


def ignored_options(args: ServerArgs) -> list[str]:
    """One message per option set away from its default that has no effect, because the
    option it needs is not set (`router_policy` without `dp_size > 1`, a `hicache_*`
    option without `enable_hierarchical_cache`). SGLang warns in such cases; the CLI logs these.
    """
    messages = []
    for concern, name, needs, active in _DEPENDENT_OPTIONS:
        config = getattr(args, concern)
        default = next(f.default for f in fields(config) if f.name == name)
        value = getattr(config, name)
        if value != default and not active(args):
            flag = "--" + needs.split()[0].replace("_", "-")
            messages.append(f"{name}={value!r} is ignored: it needs {needs} ({flag})")
    return messages


@dataclass(frozen=True)
class ServerArgs:
    """All runtime settings, one concern per member."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        _check_tensor_parallel(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from flat keyword arguments (`dtype="float32"`, `max_total_tokens=4096`).

        `model=` is accepted as an alias of `model_path`.

        Raises
        ------
        TypeError
            For a keyword that no concern owns (the message lists the valid ones).
        ValueError
            For a value out of range (from the concern's `__post_init__`).
        """
        if "model" in kwargs:
            model = kwargs.pop("model")
            if model is not None and kwargs.get("model_path") not in (None, model):
                raise TypeError(f"model={model!r} and model_path={kwargs['model_path']!r} name different "
                                "checkpoints: give one of them")
            if model is not None or "model_path" not in kwargs:
                kwargs["model_path"] = model
        if isinstance(kwargs.get("model_path"), os.PathLike):
            kwargs["model_path"] = os.fspath(kwargs["model_path"])
        groups: dict[str, dict[str, Any]] = {}
        for member in fields(cls):
            names = {f.name for f in fields(member.default_factory)}
            groups[member.name] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        if kwargs:
            raise TypeError(
                f"unknown server argument(s) {sorted(kwargs)}; valid: {sorted(cls.field_names())}"
            )
        return cls(**{m.name: m.default_factory(**groups[m.name]) for m in fields(cls)})

    @classmethod
    def field_names(cls) -> list[str]:
        """Every flat field name, in declaration order."""
        return [f.name for m in fields(cls) for f in fields(m.default_factory)]

    def replace(self, **kwargs: Any) -> ServerArgs:
        """A copy with some flat fields changed."""
        flat = {f.name: getattr(getattr(self, m.name), f.name)
                for m in fields(self) for f in fields(m.default_factory)}
        flat.update(kwargs)
        return ServerArgs.from_kwargs(**flat)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict of every field, secrets included (see `public_dict`)."""
        return {k: v for m in fields(self) for k, v in dataclasses.asdict(getattr(self, m.name)).items()}

    def public_dict(self) -> dict[str, Any]:
        """`to_dict` with every secret that is set (the API keys) shown as "<redacted>"
        (for /get_server_info and logs)."""
        secret = {f.name for m in fields(self) for f in fields(m.default_factory) if f.metadata.get("secret")}
        return {k: "<redacted>" if k in secret and v is not None else v for k, v in self.to_dict().items()}
