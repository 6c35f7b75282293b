"""`SamplingParams`: how one request samples and when it stops (SGLang's field names).

The TokenizerManager builds and verifies one per request; it crosses zmq to the
scheduler, so it stays a plain picklable dataclass. `sampling` turns a batch of
them into tensors and samples.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from arborlm.errors import InvalidRequestError

# Most samples one request may ask for (OpenAI's routes cap n at 128 too); more would flood the scheduler.
MAX_N = 128

# Temperatures below this sample greedily, as SGLang and vLLM do (`_SAMPLING_EPS`): dividing the
# logits by a positive temperature that underflows float32 (1e-40) would give inf - inf = NaN.
SAMPLING_EPS = 1e-5
# The repetition penalty the sampler applies is clamped to this range: logits divided by a penalty
# near 0 overflow to inf. Requests may ask for any positive value; the docs say it is clamped.
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2

_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "n")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "json_schema_lenient",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request samples and when it stops; field names and defaults as SGLang's.

    ``temperature=0`` means greedy; ``top_k=-1`` means no top-k filter. ``stop``
    strings end the request when they appear in the decoded text (trimmed from
    the output unless ``no_stop_trim``); ``stop_token_ids`` end it on those ids.
    Call `verify` before use; `from_dict` builds one from a JSON body.

    At most one of ``json_schema`` (a schema object or its JSON text;
    ``"$$ANY$$"`` for any JSON value), ``regex``, ``ebnf`` (GBNF, root rule
    ``root``) and ``structural_tag`` constrains the output. A schema keyword
    no backend enforces is refused unless ``json_schema_lenient``, in which
    case it is dropped from the grammar and the output is still validated
    against the full schema when it finishes.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # OpenAI's logit_bias: token id (int, or its decimal text as JSON keys are) -> bias in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # Grammar constraints (at most one; see `arborlm.constrained`).
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict | None = None
    json_schema_lenient: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request body's ``sampling_params`` mapping.

        Raises
        ------
        InvalidRequestError
            If ``d`` is not a mapping or names a field that does not exist; the
            message lists the unknown names and the valid ones.
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise InvalidRequestError(
                f"sampling_params must be an object, got {type(d).__name__}", "sampling_params"
            )
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in d if k not in valid)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {unknown}; valid ones are {valid}",
                unknown[0],
            )
        return cls(**d)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax at each step (temperature below
        `SAMPLING_EPS`, 0 included, or top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def normalized(self) -> SamplingParams:
        """A copy with ``stop`` as a list (empty when None) and ``stop_token_ids`` as a list."""
        stop = self.stop
        stop_list = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        bias = dict(self._logit_bias_items()) or None
        return dataclasses.replace(self, stop=stop_list, stop_token_ids=ids, logit_bias=bias)

    def _logit_bias_items(self) -> list[tuple[int, float]]:
        """``logit_bias`` as (token id, bias) pairs; call after the type check."""
        return [(int(k), float(v)) for k, v in (self.logit_bias or {}).items()]

    def verify(self, vocab_size: int) -> None:
        """Check every field's type and range.

        Raises
        ------
        InvalidRequestError
            Naming the first offending field in ``param`` and the accepted range.
        """
        self._verify_types()
        checks = (
            ("max_new_tokens", self.max_new_tokens >= 0, ">= 0"),
            ("temperature", 0 <= self.temperature < math.inf, ">= 0 and finite"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "-1 (off) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty < math.inf, "> 0 and finite"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens,
             f"in [0, max_new_tokens={self.max_new_tokens}]"),
            ("n", 1 <= self.n <= MAX_N, f"in [1, {MAX_N}]"),
        )  # fmt: skip
        for name, ok, accepted in checks:
            if not ok:  # NaN fails every comparison, so it is rejected here too
                raise InvalidRequestError(
                    f"{name} must be {accepted}, got {getattr(self, name)!r}", name
                )
        for token_id, bias in self._logit_bias_items():
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"logit_bias names token {token_id}, outside the vocabulary [0, {vocab_size})", "logit_bias"
                )
            if not -100 <= bias <= 100:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
        for token_id in self.stop_token_ids or ():
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids contains {token_id}, outside the vocabulary [0, {vocab_size})",
                    "stop_token_ids",
                )

    def _verify_types(self) -> None:
        def bad(name: str, expected: str) -> InvalidRequestError:
            value = getattr(self, name)
            return InvalidRequestError(
                f"{name} must be {expected}, got {type(value).__name__} {value!r}", name
            )

        for name in _INT_FIELDS:
            if not _is_int(getattr(self, name)):
                raise bad(name, "an integer")
        for name in _FLOAT_FIELDS:
            if not _is_number(getattr(self, name)) or math.isnan(getattr(self, name)):
                raise bad(name, "a number")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a boolean")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an integer or null")
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise bad("stop", "a string or a list of strings")
        if any(s == "" for s in ([stop] if isinstance(stop, str) else stop or ())):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        for name in ("regex", "ebnf"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise bad(name, "a string")
        for name in ("json_schema", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (str, dict, bool)):
                raise bad(name, "a JSON object or its text")
        given = [n for n in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(self, n) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one grammar constraint, got {given}", given[1])
        if self.logit_bias is not None and not _is_logit_bias(self.logit_bias):
            raise bad("logit_bias", "an object of token id -> number")
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids)
        ):
            raise bad("stop_token_ids", "a list of integers")


def _is_logit_bias(value: Any) -> bool:
    def is_id(key: Any) -> bool:
        return _is_int(key) or (isinstance(key, str) and key.isascii() and key.isdigit())

    return isinstance(value, dict) and all(
        is_id(k) and _is_number(v) and not math.isnan(v) for k, v in value.items()
    )
