"""A ReAct agent: think, pick a tool, call it with JSON arguments, observe, repeat.

Each step the model writes a `Thought`, picks an `Action` with `select` (every
tool name scored in one request behind the cached conversation), then writes
the tool's arguments with `gen(json_schema=...)`, so the call always parses
and matches that tool's schema. Python runs the tool (a calculator that
evaluates arithmetic through `ast`, never `eval`, and a lookup over a small
local document set) and appends the result as an `Observation`. The loop ends
on the `final_answer` tool or after `max_steps`. The questions run as one
`run_batch`, so their steps decode together. Run: `python examples/agents/react_agent.py`.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema

import arborlm as sgl

# ---- tools ----------------------------------------------------------------------------

DOCUMENTS = {
    "Eiffel Tower": "The Eiffel Tower in Paris is 330 metres tall and was completed in 1889.",
    "Mount Everest": "Mount Everest is the highest mountain on Earth, 8849 metres above sea level.",
    "Python": "The Python programming language was first released by Guido van Rossum in 1991.",
    "Speed of light": "Light travels at 299792 kilometres per second in a vacuum.",
    "Moon": "The Moon is on average 384400 kilometres away from the Earth.",
    "Great Wall": "The Great Wall of China is about 21196 kilometres long.",
}

TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "calculator": {
        "type": "object",
        "properties": {"expression": {"type": "string", "pattern": r"^[0-9.+*/() -]{1,40}$"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    "lookup": {
        "type": "object",
        "properties": {"query": {"type": "string", "pattern": r"^[A-Za-z ]{1,30}$"}},
        "required": ["query"],
        "additionalProperties": False,
    },
    "final_answer": {
        "type": "object",
        "properties": {"answer": {"type": "string", "minLength": 1, "maxLength": 80}},
        "required": ["answer"],
        "additionalProperties": False,
    },
}

_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> float | int:
    """Evaluate `+ - * / // %` over numbers and parentheses by walking the `ast`.

    Raises
    ------
    ValueError: anything else (names, calls, powers, ...); ZeroDivisionError; SyntaxError.
    """
    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            return _BINARY_OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
            return _UNARY_OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    return walk(ast.parse(expression, mode="eval"))


def lookup(query: str) -> str:
    """The document sharing the most words with `query` (title words count twice)."""
    words = set(re.findall(r"[a-z]+", query.lower()))

    def overlap(title: str) -> int:
        return 2 * len(words & set(title.lower().split())) + len(words & set(re.findall(r"[a-z]+", DOCUMENTS[title].lower())))

    best = max(DOCUMENTS, key=overlap)
    return DOCUMENTS[best] if overlap(best) > 0 else "No document matches that query."


def run_tool(tool: str, arguments: dict[str, Any]) -> str:
    """The observation for one tool call; a tool's error is an observation too."""
    try:
        if tool == "calculator":
            value = calculate(arguments["expression"])
            return str(round(value, 6) if isinstance(value, float) else value)
        return lookup(arguments["query"])
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as e:
        return f"error: {type(e).__name__}: {e}"


# ---- the agent program -----------------------------------------------------------------

SYSTEM_PROMPT = """You answer questions step by step with tools.
Tools:
- calculator: evaluates arithmetic. Arguments: {"expression": "12 * (3 + 4)"}
- lookup: finds a fact in the library. Arguments: {"query": "Eiffel Tower"}
- final_answer: gives the answer and ends. Arguments: {"answer": "..."}
Every step: a Thought, an Action (a tool name), then the Arguments as JSON.
The user replies with the tool's Observation.

Example:
Question: How many days are there in 3 weeks?
Thought: I need to multiply 3 by 7, as a week has 7 days.
Action: calculator
Arguments: {"expression": "3 * 7"}
Observation: 21
Thought: I need to give the result as the answer.
Action: final_answer
Arguments: {"answer": "21 days"}

Example:
Question: How tall is Mount Everest?
Thought: I need to look up Mount Everest in the library.
Action: lookup
Arguments: {"query": "Mount Everest"}
Observation: Mount Everest is the highest mountain on Earth, 8849 metres above sea level.
Thought: I need to give the height I found as the answer.
Action: final_answer
Arguments: {"answer": "8849 metres"}"""


@sgl.function
def react(s, question, max_steps, thought_tokens=24):
    s += sgl.system(SYSTEM_PROMPT)
    s += sgl.user(f"Question: {question}")
    for step in range(max_steps):
        with s.assistant():
            # "I need to" steers a small model towards naming a tool rather than guessing a result.
            s += "Thought: I need to" + sgl.gen(f"thought_{step}", max_tokens=thought_tokens, stop=["\n"])
            s += "\nAction: " + sgl.select(f"tool_{step}", choices=list(TOOL_SCHEMAS))
            tool = s[f"tool_{step}"]
            s += "\nArguments: " + sgl.gen(f"args_{step}", json_schema=TOOL_SCHEMAS[tool], max_tokens=48)
        if tool == "final_answer":
            break
        try:
            arguments = json.loads(s[f"args_{step}"])
        except json.JSONDecodeError as e:  # only arguments cut by max_tokens can get here
            observation = f"error: the arguments are not JSON ({e})"
        else:
            observation = run_tool(tool, arguments)
        s[f"observation_{step}"] = observation
        s += sgl.user(f"Observation: {observation}")


# ---- running it -------------------------------------------------------------------------


@dataclass
class Step:
    thought: str
    tool: str
    arguments_text: str
    arguments: dict[str, Any] | None  # None when the text is not valid JSON for the tool's schema
    observation: str | None  # None for final_answer


@dataclass
class Episode:
    question: str
    steps: list[Step] = field(default_factory=list)
    answer: str | None = None
    stopped_by: str = "step_limit"  # or "final_answer"


def episode_of(question: str, state) -> Episode:
    """Read the steps back from the program's variables."""
    episode = Episode(question)
    step = 0
    while f"tool_{step}" in state:
        tool, text = state[f"tool_{step}"], state[f"args_{step}"]
        try:
            arguments = json.loads(text)
            jsonschema.validate(arguments, TOOL_SCHEMAS[tool])
        except (json.JSONDecodeError, jsonschema.ValidationError):
            arguments = None
        observation = state[f"observation_{step}"] if f"observation_{step}" in state else None
        thought = "I need to" + state[f"thought_{step}"].rstrip()
        episode.steps.append(Step(thought, tool, text, arguments, observation))
        if tool == "final_answer":
            episode.stopped_by = "final_answer"
            episode.answer = arguments["answer"] if arguments else text
        step += 1
    return episode


QUESTIONS = [
    "Use the calculator: what is 17 * 23 + 4?",
    "Look it up: in which year was the Python programming language first released?",
]


def main(backend=None, *, model: str | None = None, questions: list[str] | None = None,
         max_steps: int = 3, thought_tokens: int = 24) -> list[Episode]:
    """Run the agent on every question; print and return each episode's steps.

    `backend`: an `arborlm.Engine` or DSL backend; None starts an Engine on `model`.
    """
    if backend is None:
        start = time.perf_counter()
        with sgl.Engine(model=model) as engine:
            print(f"engine ready in {time.perf_counter() - start:.1f} s\n")
            return main(engine, questions=questions, max_steps=max_steps, thought_tokens=thought_tokens)
    questions = QUESTIONS if questions is None else questions
    start = time.perf_counter()
    # Greedy with a mild repetition penalty: a 135M model loops without it.
    states = react.run_batch([{"question": q, "max_steps": max_steps, "thought_tokens": thought_tokens}
                              for q in questions],
                             backend=backend, temperature=0, repetition_penalty=1.1)
    episodes = []
    for question, state in zip(questions, states):
        if state.error() is not None:
            raise state.error()
        episode = episode_of(question, state)
        episodes.append(episode)
        print(f"=== {question}")
        for i, step in enumerate(episode.steps):
            print(f"[{i}] Thought: {step.thought}\n    Action: {step.tool} {step.arguments_text}")
            if step.observation is not None:
                print(f"    Observation: {step.observation}")
        print(f"--- stopped by {episode.stopped_by} after {len(episode.steps)} steps; answer: {episode.answer}\n")
    print(f"{len(questions)} episodes in {time.perf_counter() - start:.1f} s")
    return episodes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-steps", type=int, default=3)
    args = parser.parse_args()
    main(model=args.model, max_steps=args.max_steps)
