"""Workloads of the serving benchmark: what each simulated client sends.

A workload is an endless, seeded stream of `Session`s. A session is one client's
script: a generator that yields a `Call` (chat messages and sampling limits),
receives the text the server answered, and yields the next call, so dependent
calls (the turns of a conversation, the steps of an agent) see the real output
of the ones before them. Single-call workloads are sessions of one call.

- `random`: one user message of a length drawn from [input_len * range_ratio,
  input_len] tokens, an output length drawn likewise; `ignore_eos`.
- `shared-prefix`: `num_groups` system prompts of `system_len` tokens; each
  request is one of them plus its own `question_len`-token question (the RAG
  case); groups are interleaved in shuffled rounds; `ignore_eos`.
- `multi-turn`: conversations of `num_turns` user turns of `question_len`
  tokens; each turn's history holds the answers the server gave; `ignore_eos`.
- `json`: an extraction request whose answer must follow one of three JSON
  schemas (sent as `response_format`); ends where the grammar ends.
- `agent`: a ReAct loop of `agent_steps` dependent calls after one shared
  `system_len`-token system prompt that lists the tools; each call stops at
  "Observation:", and the client appends an observation of `observation_len`
  tokens before the next.

Prompts are made of English words (they tokenize like text), sized in tokens by
`TextMaker` with the model's tokenizer. Sizes are approximate; the token counts
reported come from the server's usage fields.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

WORKLOADS = ("random", "shared-prefix", "multi-turn", "json", "agent")

WORDS = (
    "the river town woke slowly under a pale autumn sky fishermen pulled their boats onto "
    "gravel bank while baker opened shutters and set out trays of warm bread children ran "
    "along old stone wall counting barges that drifted past with loads timber coal grain "
    "at station clerk checked timetable wrote arrivals on small blackboard answered "
    "questions about mountain line which had been closed for repairs since spring floods "
    "washed away part embankment engineers arrived every morning measured the slope argued "
    "over drawings drank strong coffee in cafe near bridge market square filled with carts "
    "apples pears cabbages honey wool traders shouted prices in three languages teacher "
    "led her class to museum where model of first steam engine stood behind glass"
).split()

Message = dict[str, str]


class TokenCounter(Protocol):
    """Counts the tokens of a text (the model's tokenizer, or a stand-in in tests)."""

    def __call__(self, text: str) -> int: ...


@dataclass(frozen=True)
class Call:
    """One request of a session.

    messages: the chat messages ({"role", "content"}), system first.
    max_tokens: the output limit.
    ignore_eos: keep generating past EOS up to `max_tokens` (fixed-length outputs).
    json_schema: the schema the answer must follow, or None.
    stop: stop strings.
    """

    messages: tuple[Message, ...]
    max_tokens: int
    ignore_eos: bool = False
    json_schema: dict[str, Any] | None = None
    stop: tuple[str, ...] = ()


Script = Generator[Call, str, None]


@dataclass(frozen=True)
class Session:
    """One client's script: `start()` returns a fresh generator of its calls
    (send each answer's text to get the next call)."""

    workload: str
    num_calls: int
    start: Callable[[], Script]


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes of every workload, in tokens (see the module docstring for their meaning)."""

    name: str
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.5
    num_groups: int = 4
    system_len: int = 512
    question_len: int = 48
    num_turns: int = 4
    agent_steps: int = 3
    observation_len: int = 48

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r} is not one of {', '.join(WORKLOADS)}")
        for name in ("input_len", "output_len", "num_groups", "system_len", "question_len",
                     "num_turns", "agent_steps", "observation_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ValueError(f"range_ratio must be in [0, 1], got {self.range_ratio}")

    @property
    def calls_per_session(self) -> int:
        return {"multi-turn": self.num_turns, "agent": self.agent_steps}.get(self.name, 1)


@dataclass
class TextMaker:
    """Word text of about `num_tokens` tokens under `count`.

    The words-per-token ratio is measured once on a sample; each text is then
    corrected once against its real count, which lands within a few tokens.
    """

    count: TokenCounter
    rng: random.Random
    _tokens_per_word: float = field(default=0.0, init=False)

    def words(self, num_words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, num_words)))

    def text(self, num_tokens: int) -> str:
        if not self._tokens_per_word:
            sample = self.words(400)
            self._tokens_per_word = max(0.1, self.count(sample) / 400)
        num_words = max(1, round(num_tokens / self._tokens_per_word))
        text = self.words(num_words)
        excess = self.count(text) - num_tokens
        if excess > 0:
            parts = text.split(" ")
            text = " ".join(parts[: max(1, len(parts) - math.ceil(excess / self._tokens_per_word))])
        elif excess < 0:
            text += " " + self.words(math.ceil(-excess / self._tokens_per_word))
        return text


def _drawn(rng: random.Random, length: int, ratio: float) -> int:
    """A length drawn uniformly from [length * ratio, length] (at least 1)."""
    return rng.randint(max(1, int(length * ratio)), max(1, length))


def _system(content: str) -> Message:
    return {"role": "system", "content": content}


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


def _assistant(content: str) -> Message:
    return {"role": "assistant", "content": content or "(no answer)"}


# ---- random ------------------------------------------------------------------


def _random_sessions(spec: WorkloadSpec, maker: TextMaker, rng: random.Random) -> Iterator[Session]:
    while True:
        call = Call((_user(maker.text(_drawn(rng, spec.input_len, spec.range_ratio))),),
                    _drawn(rng, spec.output_len, spec.range_ratio), ignore_eos=True)
        yield _one_call(spec.name, call)


def _one_call(workload: str, call: Call) -> Session:
    def script() -> Script:
        yield call

    return Session(workload, 1, script)


# ---- shared prefix -------------------------------------------------------------


def _shared_prefix_sessions(spec: WorkloadSpec, maker: TextMaker, rng: random.Random) -> Iterator[Session]:
    prompts = [f"You are assistant number {g}. Use the documents below to answer.\n" + maker.text(spec.system_len)
               for g in range(spec.num_groups)]
    for _ in itertools.count():
        for g in rng.sample(range(spec.num_groups), spec.num_groups):
            call = Call((_system(prompts[g]), _user(maker.text(spec.question_len))), spec.output_len, ignore_eos=True)
            yield _one_call(spec.name, call)


# ---- multi-turn ----------------------------------------------------------------


def _multi_turn_sessions(spec: WorkloadSpec, maker: TextMaker, rng: random.Random) -> Iterator[Session]:
    while True:
        turns = [maker.text(spec.question_len) for _ in range(spec.num_turns)]

        def script(turns: list[str] = turns) -> Script:
            history: list[Message] = [_system("You are a helpful assistant.")]
            for turn in turns:
                history.append(_user(turn))
                answer = yield Call(tuple(history), spec.output_len, ignore_eos=True)
                history.append(_assistant(answer))

        yield Session(spec.name, spec.num_turns, script)


# ---- json ------------------------------------------------------------------------

_STRING = {"type": "string", "maxLength": 32}
JSON_SCHEMAS: tuple[dict[str, Any], ...] = (
    {"type": "object", "additionalProperties": False,
     "properties": {"name": _STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": _STRING, "interests": {"type": "array", "items": _STRING, "maxItems": 3}},
     "required": ["name", "age", "city", "interests"]},
    {"type": "object", "additionalProperties": False,
     "properties": {"product": _STRING, "price": {"type": "number"}, "in_stock": {"type": "boolean"},
                    "category": {"enum": ["food", "tools", "books", "clothes"]}},
     "required": ["product", "price", "in_stock", "category"]},
    {"type": "object", "additionalProperties": False,
     "properties": {"event": _STRING, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                    "place": _STRING, "attendees": {"type": "integer", "minimum": 0}},
     "required": ["event", "date", "place", "attendees"]},
)
_JSON_SYSTEM = "You extract facts from text. Answer with one JSON object that follows the schema, nothing else."


def _json_sessions(spec: WorkloadSpec, maker: TextMaker, rng: random.Random) -> Iterator[Session]:
    for i in itertools.count():
        schema = JSON_SCHEMAS[i % len(JSON_SCHEMAS)]
        fields = ", ".join(schema["properties"])
        user = f"Extract {fields} from this text as JSON.\nText: {maker.text(spec.question_len)}"
        yield _one_call(spec.name, Call((_system(_JSON_SYSTEM), _user(user)), spec.output_len, json_schema=schema))


# ---- agent -------------------------------------------------------------------------

_TOOLS = (
    ("search", "search(query: str) -> list of passages. Looks the query up in the document store."),
    ("calculator", "calculator(expression: str) -> number. Evaluates an arithmetic expression."),
    ("weather", "weather(city: str, date: str) -> forecast. The forecast for a city on a date."),
    ("calendar", "calendar(person: str) -> events. The next events in a person's calendar."),
)
_AGENT_FORMAT = (
    "Answer the question by thinking step by step and calling tools. Use this format:\n"
    "Thought: what to do next\nAction: the tool name\nAction Input: the tool's input\n"
    "Observation: the tool's result (given to you)\n... (repeat)\nFinal Answer: the answer\n"
)
AGENT_STOP = ("Observation:",)


def agent_system_prompt(maker: TextMaker, system_len: int) -> str:
    """The tools, the ReAct format, and tool documentation padded to about `system_len` tokens."""
    head = "You are an agent with these tools:\n" + "\n".join(f"- {d}" for _, d in _TOOLS) + "\n" + _AGENT_FORMAT
    pad = system_len - maker.count(head)
    return head + ("Tool documentation: " + maker.text(pad) if pad > 8 else "")


def _agent_sessions(spec: WorkloadSpec, maker: TextMaker, rng: random.Random) -> Iterator[Session]:
    system = agent_system_prompt(maker, spec.system_len)
    while True:
        question = "Question: " + maker.text(spec.question_len)
        observations = [f"Observation: ({rng.choice(_TOOLS)[0]}) " + maker.text(spec.observation_len)
                        for _ in range(spec.agent_steps - 1)]

        def script(question: str = question, observations: list[str] = observations) -> Script:
            history: list[Message] = [_system(system), _user(question)]
            for step in range(spec.agent_steps):
                answer = yield Call(tuple(history), spec.output_len, stop=AGENT_STOP)
                if step < len(observations):
                    last = step == len(observations) - 1
                    history += [_assistant(answer.strip()),
                                _user(observations[step] + ("\nNow give the Final Answer." if last else ""))]

        yield Session(spec.name, spec.agent_steps, script)


_BUILDERS = {
    "random": _random_sessions,
    "shared-prefix": _shared_prefix_sessions,
    "multi-turn": _multi_turn_sessions,
    "json": _json_sessions,
    "agent": _agent_sessions,
}


def iter_sessions(spec: WorkloadSpec, count: TokenCounter, seed: int) -> Iterator[Session]:
    """The endless, seeded stream of sessions of `spec` (the same seed gives the same prompts)."""
    rng = random.Random(seed)
    return _BUILDERS[spec.name](spec, TextMaker(count, random.Random(rng.random())), rng)
