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
import re
import threading
from collections.abc import Iterable
from typing import Any

from arborlm.chat_template import ChatTemplate
from arborlm.frontend_lang.backend.base_backend import (
    BaseBackend,
    StreamChunk,
    UnsupportedByBackendError,
)
from arborlm.frontend_lang.global_config import global_config
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
from arborlm.frontend_lang.literals import complete_literal, strip_number_end
from arborlm.frontend_lang.select import select_choice
from arborlm.frontend_lang.speculative import (
    SPEC_MAX_NUM_TRIES,
    ChatTerm,
    Speculation,
    SpeculationMismatch,
    can_speculate,
    match_terms,
    speculated_meta,
    stop_strings,
)

_END = object()
# Request fields, not sampling fields, that `run(...)` may give as defaults for every gen (SGLang's).
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


class StreamExecutor:
    """Executes one program state's expressions in order on a worker thread.

    Parameters
    ----------
    backend: where `gen` and `select` go.
    default_sampling: sampling fields applied to every `gen` unless it sets them.
    stream: generate with `backend.stream`, so `text_iter` sees text as it arrives.
    chat_template: role markers; the backend's when None.
    num_api_spec_tokens: turn on API speculative execution with this many tokens
        generated ahead (`speculative.py`); None: off.
    """

    def __init__(self, backend: BaseBackend, default_sampling: dict[str, Any] | None = None, stream: bool = False,
                 chat_template: ChatTemplate | None = None, num_api_spec_tokens: int | None = None):
        self.backend = backend
        self.default_sampling = dict(default_sampling or {})
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens
        self.speculation = Speculation()
        self.spec_terms: list[ChatTerm] | None = None  # the assistant turn being collected (chat speculation)
        self._spec_sampling: dict[str, Any] = {}  # the sampling of that turn's first gen
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
            self._fill(expr.value)
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

    def _fill(self, text: str) -> None:
        """Program text: collected inside a speculated chat turn, else consumed from the speculation and appended."""
        if self.spec_terms is not None:
            self.spec_terms.append(ChatTerm(text=text))
            return
        self.speculation.fill(text)
        self._append(text)

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
        sampling = {**global_config.detokenize_options(), **self.default_sampling, **expr.sampling}
        options = {**{k: sampling.pop(k) for k in LOGPROB_FIELDS if sampling.get(k) is not None}, **expr.logprobs}
        for k in LOGPROB_FIELDS:
            sampling.pop(k, None)
        if self.spec_terms is not None:
            self._collect_spec_gen(expr, sampling, options)
            return
        if self.num_api_spec_tokens and not self.stream and can_speculate(sampling, options, expr.stop_regex):
            if self._speculated_gen(expr, sampling):
                return
        if self.backend.uses_chat_messages and self.cur_role == "assistant":
            options["messages"] = self._chat_messages()
        self.speculation.fill("")  # a gen made on its own request ends any speculation
        if expr.stop_regex:
            self._gen_until_regex(expr, sampling, options)
        elif self.stream:
            self._consume(expr, self.backend.stream(self.text_, sampling, **options))
        else:
            text, meta = self.backend.generate(self.text_, sampling, **options)
            self.backend.token_usage.add(meta)
            if expr.dtype is not None:
                text = strip_number_end(expr.dtype, text)
                text += complete_literal(expr.dtype, text)
            self._append(text)
            self._set_gen_var(expr, text, meta)

    def _consume(self, expr: SglGen, chunks: Iterable[StreamChunk],
                 cut: list[re.Pattern] | None = None) -> None:
        """Append a streamed generation as it arrives (the variable grows with it); with `cut`,
        stop at the first match of a pattern in the generated text, keep the text up to the
        match's end and close the stream, which aborts the request."""
        pieces, meta, matched = "", {}, None
        try:
            for chunk in chunks:
                if chunk.meta_info is not None:
                    meta = chunk.meta_info
                new = chunk.text
                if cut:
                    end, matched = _first_match(cut, pieces + new)
                    if matched is not None:
                        new = (pieces + new)[len(pieces):end]
                with self.cond:
                    pieces += new
                    self.text_ += new
                    if expr.name is not None:
                        self.variables[expr.name] = pieces
                        self.meta_info[expr.name] = meta
                    self.cond.notify_all()
                if matched is not None:
                    break
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        if matched is not None:
            meta = {**meta, "finish_reason": {"type": "stop", "matched": matched}}
        self.backend.token_usage.add(meta)
        if expr.dtype is not None:  # a literal cut short is closed after what was streamed
            closing = complete_literal(expr.dtype, pieces)
            pieces += closing
            self._append(closing)
        self._set_gen_var(expr, pieces, meta)

    def _gen_until_regex(self, expr: SglGen, sampling: dict[str, Any], options: dict[str, Any]) -> None:
        """A gen with `stop_regex`: streamed (whatever `stream` says) and cut where a pattern first matches."""
        patterns = [re.compile(p) for p in expr.stop_regex]
        self._consume(expr, self.backend.stream(self.text_, sampling, **options), patterns)

    # ---- API speculative execution ------------------------------------------------------

    def _speculated_gen(self, expr: SglGen, sampling: dict[str, Any]) -> bool:
        """Serve a gen from the speculation, making one speculative request when it is empty.

        False when the speculation cannot tell where this gen ends (then it runs on its own request).
        """
        stops = stop_strings(sampling)
        text = self.speculation.take(stops)
        meta = speculated_meta(stops)
        if text is None:
            request = {k: v for k, v in sampling.items() if k != "stop"}
            request["max_new_tokens"] = max(int(sampling.get("max_new_tokens") or 0), self.num_api_spec_tokens)
            out, meta = self.backend.generate(self.text_, request)
            self.backend.token_usage.add(meta)
            self.speculation.reset(out, meta)
            text = self.speculation.take(stops)
            if text is None:
                self.speculation.fill("")
                return False
        self._append(text)
        self._set_gen_var(expr, text, meta)
        return True

    def _collect_spec_gen(self, expr: SglGen, sampling: dict[str, Any], options: dict[str, Any]) -> None:
        """A gen inside a speculated assistant turn: noted, generated when the turn ends."""
        if self.stream or options or expr.stop_regex or expr.reasoning_parser or any(
                sampling.get(k) is not None for k in ("regex", "json_schema", "ebnf")):
            raise UnsupportedByBackendError(
                "API speculative execution (num_api_spec_tokens) serves plain gens only: no stream, constraint, "
                "stop_regex, logprobs or separate_reasoning inside a speculated assistant turn", "num_api_spec_tokens")
        if not any(t.is_gen for t in self.spec_terms):
            self._spec_sampling = {k: v for k, v in sampling.items() if k not in ("stop", "max_new_tokens")}
        self.spec_terms.append(ChatTerm(name=expr.name, stops=stop_strings(sampling), is_gen=True))

    def _finish_spec_turn(self) -> None:
        """Generate the collected assistant turn in one chat completion and fill in its text and gens.

        Raises
        ------
        SpeculationMismatch: no completion followed the turn's text and gens in `SPEC_MAX_NUM_TRIES` tries.
        """
        terms, self.spec_terms = self.spec_terms, None
        texts, meta = [t.text for t in terms], None
        if any(t.is_gen for t in terms):
            request = {**self._spec_sampling, "max_new_tokens": self.num_api_spec_tokens}
            for _ in range(SPEC_MAX_NUM_TRIES):
                completion, meta = self.backend.generate(self.text_, request, messages=self._chat_messages())
                self.backend.token_usage.add(meta)
                texts = match_terms(terms, completion)
                if texts is not None:
                    break
            else:
                raise SpeculationMismatch(
                    f"the speculated assistant turn did not follow the program's text and gens in "
                    f"{SPEC_MAX_NUM_TRIES} tries (last completion: {completion[:200]!r})")
        first = True
        for term, text in zip(terms, texts, strict=True):
            self._append(text)
            if term.is_gen:
                self._set_var(term.name, text, meta if first else speculated_meta(term.stops))
                first = False

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
        self.speculation.fill("")
        decision = select_choice(self.backend, self.text_, expr.choices, expr.choices_method)
        self.backend.token_usage.add(decision.meta_info)
        self._append(decision.decision)
        self._set_var(expr.name, decision.decision, decision.meta_info)

    # ---- roles ----------------------------------------------------------------------

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} opened inside role {self.cur_role!r}; close it first")
        self.cur_role = role
        self._fill(self.chat_template.prefix(role))
        self.cur_role_begin_pos = len(self.text_)
        if self.num_api_spec_tokens and role == "assistant" and self.backend.uses_chat_messages:
            self.spec_terms, self._spec_sampling = [], {}

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} closed while {self.cur_role!r} is open")
        if self.spec_terms is not None:
            self._finish_spec_turn()
        content = self.text_[self.cur_role_begin_pos:]
        self.messages_.append({"role": role, "content": content})
        self._fill(self.chat_template.suffix(role))
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
        if self.spec_terms is not None:
            raise UnsupportedByBackendError("fork inside a speculated assistant turn: close the turn first",
                                            "num_api_spec_tokens")
        if size > 1 and self.text_:
            self.backend.token_usage.add(self.backend.prefill(self.text_))
        forks = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.default_sampling, self.stream, self.chat_template,
                                   self.num_api_spec_tokens)
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


def _first_match(patterns: list[re.Pattern], text: str) -> tuple[int, str | None]:
    """(end of the earliest match of any pattern in `text`, that pattern's text), or (-1, None)."""
    best = None
    for pattern in patterns:
        m = pattern.search(text)
        if m is not None and (best is None or (m.start(), m.end()) < (best[0].start(), best[0].end())):
            best = (m, pattern.pattern)
    return (best[0].end(), best[1]) if best else (-1, None)
