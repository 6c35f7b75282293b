"""What a program sees as `s`: `ProgramState` and the `ProgramStateGroup` of a fork.

`s += expr` queues the expression on the state's `StreamExecutor`
(`interpreter.py`); reads (`s["x"]`, `s.text()`, `s.messages()`) wait for the
results they need. Names and behaviour follow SGLang's ``ProgramState``.
"""

from __future__ import annotations

import asyncio
import contextlib
import linecache
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from arborlm.frontend_lang.interpreter import StreamExecutor
from arborlm.frontend_lang.ir import (
    ROLES,
    SglConstantText,
    SglExprList,
    SglRoleBegin,
    SglRoleEnd,
    SglVarScopeBegin,
    SglVarScopeEnd,
    role_block,
    to_expr,
)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def program_line() -> str | None:
    """``file:line (function): source`` of the innermost caller outside this package."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    source = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f"{code.co_filename}:{frame.f_lineno} ({code.co_name}): {source}"


class ProgramState:
    """The state of one running program: its text, chat messages and variables."""

    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor

    # ---- appending ------------------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(to_expr(other), program_line())
        return self

    def system(self, expr: Any = None):
        """`s.system("...")` appends a system block; `with s.system():` opens one."""
        return self._role(ROLES[0], expr)

    def user(self, expr: Any = None):
        return self._role(ROLES[1], expr)

    def assistant(self, expr: Any = None):
        return self._role(ROLES[2], expr)

    def _role(self, role: str, expr: Any):
        if expr is None:
            return self._scope(SglRoleBegin(role), SglRoleEnd(role))
        self.stream_executor.submit(role_block(role, expr), program_line())
        return None

    def var_scope(self, name: str):
        """`with s.var_scope("x"):` stores the text appended inside the block as variable `x`."""
        return self._scope(SglVarScopeBegin(name), SglVarScopeEnd(name))

    @contextlib.contextmanager
    def _scope(self, begin, end) -> Iterator[None]:
        self.stream_executor.submit(begin, program_line())
        yield
        self.stream_executor.submit(end, program_line())

    @contextlib.contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator[ProgramState]:
        """`with s.copy() as c:` a fork of one that is joined when the block ends (SGLang's `copy`):
        what `c` generates does not enter `s`'s text; the variables `c` sets become
        one-item lists on `s` (``join("gather_variable")``)."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`size` copies of this state that continue independently (and concurrently).

        The copies inherit the text, messages, open role and variables; read their
        results as `forks[i]["x"]`, or gather them with `forks.join()`.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be a positive integer, got {size!r}")
        executors = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(e) for e in executors], self)

    # ---- reading --------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until everything appended so far has run."""
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        """The error that stopped the program, if any (`run_batch` keeps failed items' states)."""
        return self.stream_executor.error_

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.stream_executor.variables

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self.stream_executor._set_var(name, value, None)

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """Meta info of the `gen`/`select` stored under `name` (prompt, completion and cached tokens...)."""
        self.get_var(name)
        return self.stream_executor.meta_info[name]

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return list(self.stream_executor.messages_)

    # ---- streaming ------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The program's text (or one variable's) piece by piece as it is generated.

        Without `stream=True` in `run`, yields the whole text (or value) once.
        """
        if not self.stream_executor.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        sent = 0
        while True:
            piece, done = self._next_piece(var_name, sent)
            sent += len(piece)
            if piece:
                yield piece
            if done:
                break
        self.stream_executor.raise_error()

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`text_iter` for asyncio; with `return_meta_data`, yields ``(piece, meta_info)`` for a variable."""
        loop = asyncio.get_running_loop()
        if not self.stream_executor.stream:
            value = await loop.run_in_executor(None, lambda: self.text() if var_name is None else self.get_var(var_name))
            yield (value, self.stream_executor.meta_info.get(var_name)) if return_meta_data and var_name else value
            return
        sent = 0
        while True:
            piece, done = await loop.run_in_executor(None, self._next_piece, var_name, sent)
            sent += len(piece)
            if piece:
                if return_meta_data and var_name is not None:
                    yield piece, self.stream_executor.meta_info.get(var_name)
                else:
                    yield piece
            if done:
                break
        self.stream_executor.raise_error()

    def _next_piece(self, var_name: str | None, sent: int) -> tuple[str, bool]:
        """Wait for new text past `sent`; (new text, whether that source is complete)."""
        ex = self.stream_executor

        def current() -> str:
            return ex.text_ if var_name is None else str(ex.variables.get(var_name, ""))

        def complete() -> bool:
            if ex.error_ is not None or ex.is_finished:
                return True
            return var_name is not None and var_name in ex.done_vars

        with ex.cond:
            ex.cond.wait_for(lambda: len(current()) > sent or complete())
            return current()[sent:], complete()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The states of a `fork`: index them, iterate them, append to all, or `join` them back."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """What ``forks[i] += expr`` ends with: Python stores the branch back, which must be that branch.

        Raises
        ------
        TypeError: `value` is not branch `i` itself (a group's branches cannot be replaced).
        """
        if value is not self.states[i]:
            raise TypeError("a fork group's branches cannot be replaced; append to one with forks[i] += ...")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        """Append to every branch: an expression or text, a list (one item per branch) or ``f(i)``."""
        where = program_line()
        for i, state in enumerate(self.states):
            if isinstance(other, Callable) and not isinstance(other, type):
                item = other(i)
            elif isinstance(other, (list, tuple)):
                item = other[i]
            else:
                item = other
            state.stream_executor.submit(to_expr(item), where)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch and bring its results back to the parent.

        ``"gather_variable"``: each variable the branches set becomes a list on
        the parent (one value per branch), as do their meta infos.
        ``"concate_and_append"``: the text each branch added is appended to the parent.

        Raises
        ------
        The first branch's error; ValueError for an unknown mode.
        """
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        executors = [s.stream_executor for s in self.states]
        for ex in executors:
            ex.sync()
            ex.raise_error()
        dst = self.src_state
        if mode == "concate_and_append":
            added = [SglConstantText(ex.text_[ex.fork_start_text_pos:]) for ex in executors]
            dst.stream_executor.submit(SglExprList(added), program_line())
        else:
            dst.sync()
            names = list(dict.fromkeys(n for ex in executors for n in ex.assigned))
            for name in names:
                values = [ex.variables.get(name) for ex in executors]
                metas = [ex.meta_info.get(name) for ex in executors]
                dst.stream_executor._set_var(name, values, metas)
        for ex in executors:
            ex.end()
