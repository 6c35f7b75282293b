"""Tracing: run a program's Python body without a model and record what it appends.

The arguments not given become placeholders (`SglArgument`) and every `gen` /
`select` result a placeholder too, so the body runs to its end or to the first
place that needs a real value (a branch on a generated word, `s.fork`, a
method call on an argument). What was recorded is a `TracedProgram`: its
nodes (text, argument-dependent text, roles, generations) and its **prefix**,
the text every run of the program starts with whatever its arguments: the
constant text and role markers before the first argument or generation.

`run_batch` prefills that prefix once (``max_new_tokens=0``) before launching
its items, so each item's first request starts from a radix-cache hit instead
of every item computing the shared prefix at the same time.

After SGLang's ``sglang/lang/tracer.py`` (``extract_prefix_by_tracing``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from arborlm.chat_template import ChatTemplate
from arborlm.frontend_lang.ir import (
    ROLES,
    SglConstantText,
    SglExpr,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
    flatten,
    role_block,
    to_expr,
)


class StopTracing(Exception):
    """The traced body needed a value that only a run can give."""


@dataclass(frozen=True)
class TraceNode:
    """One recorded step.

    kind: "text" (constant), "argument" (text of a program argument or a
    generated variable), "role_begin", "role_end", "gen", "select",
    "var_scope_begin", "var_scope_end".
    value: the text, the argument or variable name, the role, or the variable name.
    """

    kind: str
    value: str | None

    def __str__(self) -> str:
        """SGLang-like: ``Constant('Q: ')``, ``Argument('question')``, ``Gen('answer')``, ``RoleBegin(user)``."""
        name = "".join(part.capitalize() for part in self.kind.split("_"))
        name = "Constant" if name == "Text" else name
        return f"{name}({self.value!r})" if self.kind in ("text", "argument", "gen", "select") \
            else f"{name}({self.value})"


@dataclass(frozen=True)
class TraceGraphNode:
    """One traced node as a graph vertex (SGLang's ``SglExpr`` with ``node_id`` and ``prev_node``):
    `prev_node` is the node recorded before it, None for the first."""

    node: TraceNode
    node_id: int
    prev_node: TraceGraphNode | None

    def print_graph_dfs(self) -> str:
        """The graph up to this node, dependencies first, one line a node: ``%3 = %2 + Gen('answer')``
        (SGLang's format; the text is returned, as SGLang's, not printed)."""
        lines, node = [], self
        while node is not None:  # a traced program is a chain, so its DFS is the chain in order
            prev = "" if node.prev_node is None else f"%{node.prev_node.node_id} + "
            lines.append(f"%{node.node_id} = {prev}{node.node}\n")
            node = node.prev_node
        return "".join(reversed(lines))

    def __str__(self) -> str:
        return str(self.node)


@dataclass
class TracedProgram:
    """What tracing recorded.

    nodes: the steps in order.
    prefix: the text before the first argument-dependent or generated part.
    complete: whether the body ran to its end (False: it stopped at `stop_reason`).
    """

    nodes: list[TraceNode] = field(default_factory=list)
    prefix: str = ""
    complete: bool = True
    stop_reason: str | None = None

    @property
    def last_node(self) -> TraceGraphNode | None:
        """The last recorded node, linked to those before it (SGLang's ``tracer.last_node``);
        None when nothing was recorded."""
        node = None
        for i, traced in enumerate(self.nodes):
            node = TraceGraphNode(traced, i, node)
        return node

    def print_graph(self) -> None:
        """Print the traced graph, one node a line (SGLang's ``CompiledFunction.print_graph``)."""
        if self.last_node is not None:
            print(self.last_node.print_graph_dfs(), end="")


class SglArgument(SglExpr):
    """A placeholder for a program argument or a generated value during tracing.

    It turns into a unique marker inside text (`str`, f-strings, `+` with str),
    which the tracer recognises; anything else needs the real value and stops tracing.
    """

    def __init__(self, name: str, marker: str):
        self.name = name
        self.marker = marker

    def __str__(self) -> str:
        return self.marker

    def __format__(self, spec: str) -> str:
        return self.marker

    def __add__(self, other: Any) -> Any:
        if isinstance(other, str):
            return self.marker + other
        return super().__add__(other)

    def __radd__(self, other: Any) -> Any:
        if isinstance(other, str):
            return other + self.marker
        return super().__radd__(other)

    def __getattr__(self, attr: str) -> Any:
        raise StopTracing(f"{attr!r} of {self.name!r} needs its value")

    def __bool__(self) -> bool:
        raise StopTracing(f"a condition on {self.name!r} needs its value")

    def __eq__(self, other: Any) -> bool:
        raise StopTracing(f"a comparison with {self.name!r} needs its value")

    def __len__(self) -> int:
        raise StopTracing(f"len({self.name!r}) needs its value")

    def __iter__(self):
        raise StopTracing(f"iterating {self.name!r} needs its value")

    def __getitem__(self, key: Any) -> Any:
        raise StopTracing(f"indexing {self.name!r} needs its value")

    __hash__ = object.__hash__


class TracerProgramState:
    """A `ProgramState` stand-in that records instead of running."""

    def __init__(self, chat_template: ChatTemplate):
        self.chat_template = chat_template
        self.nodes: list[TraceNode] = []
        self.markers: dict[str, str] = {}  # marker -> argument or variable name
        self._tag = uuid.uuid4().hex[:8]

    def placeholder(self, name: str) -> SglArgument:
        marker = f"\x00{self._tag}:{len(self.markers)}\x00"
        self.markers[marker] = name
        return SglArgument(name, marker)

    def __iadd__(self, other: Any) -> TracerProgramState:
        for leaf in flatten(to_expr(other)):
            self._record(leaf)
        return self

    def _record(self, leaf: Any) -> None:
        if isinstance(leaf, SglConstantText):
            self._record_text(leaf.value)
        elif isinstance(leaf, SglArgument):
            self.nodes.append(TraceNode("argument", leaf.name))
        elif isinstance(leaf, SglGen):
            self.nodes.append(TraceNode("gen", leaf.name))
        elif isinstance(leaf, SglSelect):
            self.nodes.append(TraceNode("select", leaf.name))
        elif isinstance(leaf, SglRoleBegin):
            self.nodes.append(TraceNode("role_begin", leaf.role))
        elif isinstance(leaf, SglRoleEnd):
            self.nodes.append(TraceNode("role_end", leaf.role))
        elif isinstance(leaf, SglVarScopeBegin):
            self.nodes.append(TraceNode("var_scope_begin", leaf.name))
        elif isinstance(leaf, SglVarScopeEnd):
            self.nodes.append(TraceNode("var_scope_end", leaf.name))
        else:
            raise StopTracing(f"cannot trace a {type(leaf).__name__}")

    def _record_text(self, text: str) -> None:
        """Split `text` at placeholder markers into constant and argument nodes."""
        while text:
            hits = [(text.find(m), m) for m in self.markers if m in text]
            if not hits:
                self.nodes.append(TraceNode("text", text))
                return
            pos, marker = min(hits)
            if pos:
                self.nodes.append(TraceNode("text", text[:pos]))
            self.nodes.append(TraceNode("argument", self.markers[marker]))
            text = text[pos + len(marker):]

    # ---- the ProgramState surface ---------------------------------------------------

    def system(self, expr: Any = None):
        return self._role(ROLES[0], expr)

    def user(self, expr: Any = None):
        return self._role(ROLES[1], expr)

    def assistant(self, expr: Any = None):
        return self._role(ROLES[2], expr)

    def _role(self, role: str, expr: Any):
        if expr is None:
            return self._scope(SglRoleBegin(role), SglRoleEnd(role))
        self += role_block(role, expr)
        return None

    def var_scope(self, name: str):
        return self._scope(SglVarScopeBegin(name), SglVarScopeEnd(name))

    @contextlib.contextmanager
    def _scope(self, begin, end) -> Iterator[None]:
        self._record(begin)
        yield
        self._record(end)

    def __getitem__(self, name: str) -> SglArgument:
        return self.placeholder(name)

    get_var = __getitem__

    def set_var(self, name: str, value: Any) -> None:
        raise StopTracing("set_var")

    def fork(self, *args: Any, **kwargs: Any):
        raise StopTracing("fork")

    def __getattr__(self, attr: str) -> Any:
        raise StopTracing(f"s.{attr}")


def trace_program(func, arguments: dict[str, Any], arg_names: list[str], chat_template: ChatTemplate) -> TracedProgram:
    """Run `func` on a tracer; arguments missing from `arguments` become placeholders."""
    tracer = TracerProgramState(chat_template)
    kwargs = {name: arguments[name] if name in arguments else tracer.placeholder(name) for name in arg_names}
    traced = TracedProgram()
    try:
        func(tracer, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure on a placeholder ends the trace there
        traced.complete = False
        traced.stop_reason = f"{type(e).__name__}: {e}"
    traced.nodes = tracer.nodes
    traced.prefix = constant_prefix(tracer.nodes, chat_template)
    return traced


def constant_prefix(nodes: list[TraceNode], chat_template: ChatTemplate) -> str:
    """The text of the leading constant nodes: text and role markers up to the first argument or generation."""
    parts = []
    for node in nodes:
        if node.kind == "text":
            parts.append(node.value)
        elif node.kind == "role_begin":
            parts.append(chat_template.prefix(node.value))
        elif node.kind == "role_end":
            parts.append(chat_template.suffix(node.value))
        elif node.kind in ("var_scope_begin", "var_scope_end"):
            continue
        else:
            break
    return "".join(parts)
