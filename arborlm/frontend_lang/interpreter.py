"""Runs a program: the `ProgramState` that `s += ...` appends to.

Text and role markers are appended locally; each `gen` sends the whole text so
far to the backend, appends the generated text and stores it as a variable with
its meta info (cached tokens included, so the prefix reuse is visible).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from arborlm.frontend_lang.backend.base_backend import BaseBackend
from arborlm.frontend_lang.ir import (
    ROLES,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    to_expr,
)


class ProgramState:
    """The state of one running program: its text, chat messages and variables.

    Parameters
    ----------
    backend: where `gen` calls go.
    default_sampling: sampling fields applied to every `gen` unless it sets them.
    """

    def __init__(self, backend: BaseBackend, default_sampling: dict[str, Any] | None = None):
        self.backend = backend
        self.default_sampling = dict(default_sampling or {})
        self.chat_template = backend.get_chat_template()
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, dict[str, Any]] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0

    # ---- appending ----------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        self._execute(to_expr(other))
        return self

    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglConstantText):
            self.text_ += expr.value
        elif isinstance(expr, SglExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        else:
            raise TypeError(f"unsupported expression {type(expr).__name__}")

    def _execute_gen(self, expr: SglGen) -> None:
        sampling = {**self.default_sampling, **expr.sampling}
        text, meta = self.backend.generate(self.text_, sampling)
        self.text_ += text
        if expr.name is not None:
            self.variables[expr.name] = text
            self.meta_info[expr.name] = meta

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} opened inside role {self.cur_role!r}; close it first")
        self.cur_role = role
        self.text_ += self.chat_template.prefix(role)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} closed while {self.cur_role!r} is open")
        content = self.text_[self.cur_role_begin_pos:]
        self.messages_.append({"role": role, "content": content})
        self.text_ += self.chat_template.suffix(role)
        self.cur_role = None

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._role_begin(role)
        yield
        self._role_end(role)

    def system(self, expr: Any = None):
        """`s.system("...")` appends a system block; `with s.system():` opens one."""
        return self._role(ROLES[0], expr)

    def user(self, expr: Any = None):
        return self._role(ROLES[1], expr)

    def assistant(self, expr: Any = None):
        return self._role(ROLES[2], expr)

    def _role(self, role: str, expr: Any):
        if expr is None:
            return self._role_scope(role)
        from arborlm.frontend_lang.ir import role_block

        self._execute(role_block(role, expr))
        return None

    # ---- reading ------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.variables[name]

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    def get_var(self, name: str) -> Any:
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """Meta info of the `gen` stored under `name` (prompt, completion and cached tokens...)."""
        return self.meta_info[name]

    def text(self) -> str:
        return self.text_

    def messages(self) -> list[dict[str, str]]:
        return list(self.messages_)

    def __repr__(self) -> str:
        return f"ProgramState({self.text_!r})"
