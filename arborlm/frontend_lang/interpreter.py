"""Runs a program: the `StreamExecutor` behind each `ProgramState`.

`s += expr` hands the expression to the state's executor, a worker thread that
runs expressions in order: text and role markers are appended locally; each
`gen` sends the whole text so far to the backend and appends the answer; each
`select` scores its choices (`select.py`). The program's Python code runs on
ahead and blocks only where it reads a result (`s["x"]`, `s.text()`), so the
branches of a `fork` run concurrently and `run(stream=True)` can return at once.

An error inside the worker stops the executor: later expressions are skipped
and the error, annotated with the program line that submitted the expression,
is raised where the program reads a result, or by `run`.

After SGLang's ``sglang/lang/interpreter.py`` (``StreamExecutor``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from arborlm.chat_template import ChatTemplate
from arborlm.frontend_lang.backend.base_backend import BaseBackend
from arborlm.frontend_lang.ir import (
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
    flatten,
)
from arborlm.frontend_lang.select import select_choice

_END = object()


class StreamExecutor:
    """Executes one program state's expressions in order on a worker thread.

    Parameters
    ----------
    backend: where `gen` and `select` go.
    default_sampling: sampling fields applied to every `gen` unless it sets them.
    stream: generate with `backend.stream`, so `text_iter` sees text as it arrives.
    chat_template: role markers; the backend's when None.
    """

    def __init__(self, backend: BaseBackend, default_sampling: dict[str, Any] | None = None, stream: bool = False,
                 chat_template: ChatTemplate | None = None):
        self.backend = backend
        self.default_sampling = dict(default_sampling or {})
        self.stream = stream
        self.chat_template = chat_template or backend.get_chat_template()
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, dict[str, Any]] = {}
        self.done_vars: set[str] = set()  # variables whose final value is set
        self.assigned: list[str] = []  # variables set by this executor (not inherited from a fork's parent)
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.var_scopes: dict[str, int] = {}
        self.fork_start_text_pos = 0
        self.error_: BaseException | None = None
        self.is_finished = False
        self.children: list[StreamExecutor] = []
        self.cond = threading.Condition()
        self._pending = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="arborlm-program", daemon=True)
        self._thread.start()

    # ---- the worker -----------------------------------------------------------------

    def submit(self, expr: SglExpr, where: str | None = None) -> None:
        """Queue `expr`; `where` names the program line that appended it (for error messages)."""
        names = {e.name for e in flatten(expr) if isinstance(e, (SglGen, SglSelect, SglVarScopeEnd))}
        names |= {e.reasoning_name for e in flatten(expr) if isinstance(e, SglGen) and e.reasoning_parser}
        with self.cond:
            self._pending += 1
            self.done_vars -= names  # a name assigned again is read once the new value is there
        self._queue.put((expr, where))

    def end(self) -> None:
        """No more expressions: the worker finishes the queue and stops; so do the forks'."""
        self._queue.put(_END)
        for child in self.children:
            child.end()

    def sync(self) -> None:
        """Wait until every submitted expression has run (or one failed)."""
        with self.cond:
            self.cond.wait_for(lambda: self._pending == 0)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not _END:
            expr, where = item
            if self.error_ is None:
                try:
                    self._execute(expr)
                except BaseException as e:  # noqa: BLE001 - kept and raised where the program reads
                    if where:
                        e.add_note(f"in the program at {where}")
                    with self.cond:
                        self.error_ = e
            with self.cond:
                self._pending -= 1
                self.cond.notify_all()
        with self.cond:
            self.is_finished = True
            self.cond.notify_all()

    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglConstantText):
            self._append(expr.value)
        elif isinstance(expr, SglExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            self._execute_select(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self.var_scopes[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            self._set_var(expr.name, self.text_[self.var_scopes.pop(expr.name):], None)
        else:
            raise TypeError(f"unsupported expression {type(expr).__name__}")

    def _append(self, text: str) -> None:
        with self.cond:
            self.text_ += text
            self.cond.notify_all()

    def _set_var(self, name: str | None, value: Any, meta: dict[str, Any] | None) -> None:
        if name is None:
            return
        with self.cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta
            self.done_vars.add(name)
            if name not in self.assigned:
                self.assigned.append(name)
            self.cond.notify_all()

    # ---- gen and select -------------------------------------------------------------

    def _execute_gen(self, expr: SglGen) -> None:
        sampling = {**self.default_sampling, **expr.sampling}
        options = dict(expr.logprobs)
        if self.backend.uses_chat_messages and self.cur_role == "assistant":
            options["messages"] = self._chat_messages()
        if not self.stream:
            text, meta = self.backend.generate(self.text_, sampling, **options)
            self._append(text)
            self._set_gen_var(expr, text, meta)
            return
        prompt, pieces, meta = self.text_, [], {}
        for chunk in self.backend.stream(prompt, sampling, **options):
            with self.cond:
                pieces.append(chunk.text)
                self.text_ += chunk.text
                if chunk.meta_info is not None:
                    meta = chunk.meta_info
                if expr.name is not None:
                    self.variables[expr.name] = "".join(pieces)
                    self.meta_info[expr.name] = meta
                self.cond.notify_all()
        self._set_gen_var(expr, "".join(pieces), meta)

    def _set_gen_var(self, expr: SglGen, text: str, meta: dict[str, Any] | None) -> None:
        """The generated text under the gen's name; after `separate_reasoning`, the answer there and
        the thinking under `<name>_reasoning_content` (set first: a reader of the name sees both)."""
        if expr.reasoning_parser is None:
            self._set_var(expr.name, text, meta)
            return
        from arborlm.entrypoints.openai.reasoning_parser import output_reasoning

        reasoning, content = output_reasoning(expr.reasoning_parser, text)
        self._set_var(expr.reasoning_name, reasoning, None)
        self._set_var(expr.name, content, meta)

    def _chat_messages(self) -> list[dict[str, str]]:
        """The finished messages; refuses a partly written assistant turn (a chat API cannot continue one)."""
        if self.text_[self.cur_role_begin_pos:]:
            from arborlm.frontend_lang.backend.base_backend import UnsupportedByBackendError

            raise UnsupportedByBackendError(
                f"{type(self.backend).__name__} cannot continue an assistant message that already has text; "
                "put gen() first in the assistant turn", "messages")
        return list(self.messages_)

    def _execute_select(self, expr: SglSelect) -> None:
        if expr.temperature > 0:
            from arborlm.errors import InvalidRequestError

            raise InvalidRequestError("select scores its choices and picks the best; temperature must be 0",
                                      "temperature")
        decision = select_choice(self.backend, self.text_, expr.choices, expr.choices_method)
        self._append(decision.decision)
        self._set_var(expr.name, decision.decision, decision.meta_info)

    # ---- roles ----------------------------------------------------------------------

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} opened inside role {self.cur_role!r}; close it first")
        self.cur_role = role
        self._append(self.chat_template.prefix(role))
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} closed while {self.cur_role!r} is open")
        content = self.text_[self.cur_role_begin_pos:]
        self.messages_.append({"role": role, "content": content})
        self._append(self.chat_template.suffix(role))
        self.cur_role = None

    # ---- forks ----------------------------------------------------------------------

    def fork(self, size: int) -> list[StreamExecutor]:
        """`size` executors that continue from this one's current text, roles and variables.

        The parent's text is prefilled once first (a prefix hint), so every
        branch's first request starts from a cache hit instead of each branch
        computing the shared text at the same time.
        """
        self.sync()
        self.raise_error()
        if size > 1 and self.text_:
            self.backend.prefill(self.text_)
        forks = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.default_sampling, self.stream, self.chat_template)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.done_vars = set(self.done_vars)
            child.cur_role, child.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
            child.var_scopes = dict(self.var_scopes)
            child.fork_start_text_pos = len(self.text_)
            forks.append(child)
        self.children += forks
        return forks

    # ---- reading --------------------------------------------------------------------

    def raise_error(self) -> None:
        if self.error_ is not None:
            raise self.error_

    def get_var(self, name: str) -> Any:
        """The variable's final value, waiting for it; raises the executor's error if it failed first."""
        with self.cond:
            self.cond.wait_for(lambda: name in self.done_vars or self._pending == 0)
        if name not in self.done_vars:
            self.raise_error()
            raise KeyError(f"no variable {name!r} in the program (variables: {sorted(self.variables)})")
        return self.variables[name]
