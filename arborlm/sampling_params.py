"""`SamplingParams`: how one request samples and when it stops (SGLang's field names).

The TokenizerManager builds and verifies one per request; it crosses zmq to the
scheduler, so it stays a plain picklable dataclass. `sampling` turns a batch of
them into tensors and samples.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from arborlm.errors import InvalidRequestError

# Most samples one request may ask for (OpenAI's routes cap n at 128 too); more would flood the scheduler.
MAX_N = 128
# Most top logprobs per token, on every route: OpenAI's cap for chat `top_logprobs` and vLLM's
# `max_logprobs` default. Each one is a (logprob, id) pair per token kept for the whole output.
MAX_TOP_LOGPROBS = 20
# Stop strings: every decoded token is checked against each one, and the text that could start
# one is held back, so the work per token grows with their count times their length. OpenAI takes
# 4; vLLM and SGLang set no limit, and the stop lists of real clients (eval harnesses, agent
# frameworks, chat templates' end markers) stay well within these.
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256  # characters
# Stop token ids: a model's special tokens (Llama 3 reserves 256) fit.
MAX_STOP_TOKEN_IDS = 256
# logit_bias entries: the sampler adds each one per row and step in a Python loop
# (`sampling.apply_logit_bias`), so their count is capped. OpenAI's reference states no number;
# 1024 holds every use seen (banning a word list, forcing a label set) with room to spare.
MAX_LOGIT_BIAS_ENTRIES = 1024
# Integer fields are int64 on the way to the sampler's tensors (and OpenAI's `seed` is one).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A logit_bias key is a token id's decimal text: an int64 has at most 19 digits.
_MAX_TOKEN_ID_DIGITS = 19
# A message shows at most this much of a bad value (a prompt of token ids, a 4000-digit integer).
_MAX_SHOWN_CHARS = 80

# Temperatures below this sample greedily, as SGLang and vLLM do (`_SAMPLING_EPS`): dividing the
# logits by a positive temperature that underflows float32 (1e-40) would give inf - inf = NaN.
SAMPLING_EPS = 1e-5
# The repetition penalty the sampler applies is clamped to this range: logits divided by a penalty
# near 0 overflow to inf. Requests may ask for any positive value; the docs say it is clamped.
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
# The largest float32: the sampler divides float32 logits by the temperature, and one that
# rounds to inf there turns a masked (-inf) logit into NaN (-inf / inf).
MAX_FLOAT32 = 3.4028234663852886e38

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


def _is_int64(value: Any) -> bool:
    return _is_int(value) and INT64_MIN <= value <= INT64_MAX


def _is_float_like(value: Any) -> bool:
    """A number that is not NaN and converts to a float (an int beyond 1e308 does not: OverflowError)."""
    if not _is_number(value):
        return False
    try:
        return not math.isnan(value)
    except OverflowError:
        return False


def shown(value: Any) -> str:
    """`repr(value)` for an error message, cut to `_MAX_SHOWN_CHARS`.

    An integer of more than 4300 digits has no text (Python refuses to make it: ValueError),
    so a value holding one is described instead.
    """
    if _is_int(value) and value.bit_length() > 4 * _MAX_SHOWN_CHARS:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    try:
        text = repr(value)
    except ValueError:
        return f"a {type(value).__name__} holding an integer of thousands of digits"
    return text if len(text) <= _MAX_SHOWN_CHARS else text[:_MAX_SHOWN_CHARS - 3] + "..."


def _is_schema_wrapper(value: Any) -> bool:
    """True for OpenAI's ``response_format.json_schema`` object ({name, schema, strict}) given
    where a schema belongs: as a schema it constrains nothing (neither ``name`` nor ``schema``
    is a JSON Schema keyword), so the output would be free JSON."""
    if isinstance(value, str):
        if '"schema"' not in value:
            return False
        try:
            value = json.loads(value)
        except ValueError:
            return False  # the grammar reports the broken text
    return (isinstance(value, dict) and isinstance(value.get("schema"), dict)
            and set(value) <= {"name", "description", "schema", "strict"})


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
    # The output opens with free reasoning: {"begin": "<think>" ("" when the prompt opened it),
    # "end": "</think>", "separator": "\n\n"}; the grammar constraint applies after it
    # (`runtime/reasoning_grammar.py`). No effect without a constraint.
    reasoning: dict[str, str] | None = None

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
        self._verify_stops()
        self._verify_constraint()
        checks = (
            ("max_new_tokens", self.max_new_tokens >= 0, ">= 0"),
            ("temperature", 0 <= self.temperature <= MAX_FLOAT32, ">= 0 and finite in float32"),
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
                    f"{name} must be {accepted}, got {shown(getattr(self, name))}", name
                )
        self._verify_token_ids(vocab_size)

    def _verify_token_ids(self, vocab_size: int) -> None:
        """`logit_bias` (at most `MAX_LOGIT_BIAS_ENTRIES` entries) and `stop_token_ids` name tokens
        of the vocabulary."""
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}",
                "logit_bias",
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
                    f"stop_token_ids contains {shown(token_id)}, outside the vocabulary [0, {vocab_size})",
                    "stop_token_ids",
                )

    def _bad_type(self, name: str, expected: str) -> InvalidRequestError:
        value = getattr(self, name)
        return InvalidRequestError(f"{name} must be {expected}, got {type(value).__name__} {shown(value)}", name)

    def _verify_types(self) -> None:
        """Each field has its type; integers fit int64, numbers a float (then `verify` checks ranges)."""
        for name in _INT_FIELDS:
            if not _is_int(getattr(self, name)):
                raise self._bad_type(name, "an integer")
            if not _is_int64(getattr(self, name)):
                raise self._bad_type(name, "an integer in [-2**63, 2**63)")
        for name in _FLOAT_FIELDS:
            if not _is_float_like(getattr(self, name)):
                raise self._bad_type(name, "a number")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise self._bad_type(name, "a boolean")
        if self.seed is not None and not _is_int64(self.seed):
            raise self._bad_type("seed", "an integer in [-2**63, 2**63) or null")
        problem = None if self.logit_bias is None else _logit_bias_problem(self.logit_bias)
        if problem is not None:
            raise InvalidRequestError(problem, "logit_bias")

    def _verify_stops(self) -> None:
        """Stop strings: non-empty, at most `MAX_STOP_STRINGS` of at most `MAX_STOP_LEN` characters;
        stop token ids: at most `MAX_STOP_TOKEN_IDS` integers."""
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise self._bad_type("stop", "a string or a list of strings")
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if any(s == "" for s in stops):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"give at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            longest = max(len(s) for s in stops)
            raise InvalidRequestError(
                f"stop strings may have at most {MAX_STOP_LEN} characters, got one of {longest}", "stop"
            )
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids)):
            raise self._bad_type("stop_token_ids", "a list of integers")
        if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"give at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}", "stop_token_ids"
            )

    def _verify_constraint(self) -> None:
        """At most one grammar constraint, of its type, and a schema that is one."""
        for name in ("regex", "ebnf"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise self._bad_type(name, "a string")
        for name in ("json_schema", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (str, dict, bool)):
                raise self._bad_type(name, "a JSON object or its text")
        self._verify_reasoning()
        given = [n for n in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(self, n) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one grammar constraint, got {given}", given[1])
        if _is_schema_wrapper(self.json_schema):
            raise InvalidRequestError(
                "json_schema holds OpenAI's response_format.json_schema object ({name, schema, strict}), "
                "not a schema; as one it would allow any JSON. Send the schema itself as json_schema, or "
                'the object as response_format={"type": "json_schema", "json_schema": ...}',
                "json_schema",
            )


    def _verify_reasoning(self) -> None:
        """`reasoning`: an object of strings `begin`, `end` (not empty) and `separator`."""
        value = self.reasoning
        if value is None:
            return
        ok = (isinstance(value, dict) and set(value) <= {"begin", "end", "separator"}
              and all(isinstance(v, str) and len(v) <= MAX_STOP_LEN for v in value.values()) and value.get("end"))
        if not ok:
            raise self._bad_type("reasoning", 'an object {"begin": str, "end": non-empty str, "separator": str} '
                                              f"of at most {MAX_STOP_LEN} characters each")


def _logit_bias_problem(value: Any) -> str | None:
    """What is wrong with a ``logit_bias`` (token id, an int64 or its decimal text as JSON keys
    are -> a number), naming the first bad entry; None when nothing is."""
    if not isinstance(value, dict):
        return f"logit_bias must be an object of token id -> number, got {type(value).__name__} {shown(value)}"
    for key, bias in value.items():
        if isinstance(key, str):
            ok = key.isascii() and key.isdigit() and len(key) <= _MAX_TOKEN_ID_DIGITS
        else:
            ok = _is_int64(key) and not isinstance(key, bool)
        if not ok:
            return f"logit_bias keys must be token ids (non-negative integers), got {shown(key)}"
        if not _is_float_like(bias):
            return f"logit_bias[{shown(key)}] must be a number, got {type(bias).__name__} {shown(bias)}"
    return None
