"""`SglFunction`: a prompt program and the ways to run it.

`run` runs one program on a state of its own; `run_batch` runs many on a
thread pool, after prefilling the prefix every item shares (found by tracing,
`tracer.py`); `trace` and `compile` expose that analysis.

After SGLang's ``sglang/lang/ir.py`` (``SglFunction``) and ``interpreter.py``
(``run_program``, ``run_program_batch``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from arborlm.chat_template import ChatTemplate
from arborlm.frontend_lang.api import resolve_backend
from arborlm.frontend_lang.backend.base_backend import BaseBackend
from arborlm.frontend_lang.global_config import global_config
from arborlm.frontend_lang.interpreter import LOGPROB_FIELDS, StreamExecutor
from arborlm.frontend_lang.program_state import ProgramState
from arborlm.frontend_lang.tracer import TracedProgram, TracerProgramState, trace_program
from arborlm.sampling_params import SamplingParams

# SGLang's `run` keyword names for program-wide sampling defaults → `SamplingParams` fields.
_RUN_SAMPLING_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# What `run` takes besides the program's parameters: sampling fields and the logprob options.
_RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | frozenset(LOGPROB_FIELDS)


def _check_sampling(sampling: dict[str, Any]) -> None:
    """Type-check program-wide sampling defaults (ranges that depend on the model, such as stop
    token ids within the vocabulary, are checked when a request is sent).

    Raises
    ------
    InvalidRequestError: naming the first field of the wrong type, or a bad stop list.
    """
    fields = {k: v for k, v in sampling.items() if k not in LOGPROB_FIELDS}
    params = SamplingParams.from_dict(fields)
    params._verify_types()  # the request-time checks, without the ones needing the vocabulary
    params._verify_stops()


class SglFunction:
    """A prompt program: a Python function whose first argument is the `ProgramState`.

    num_api_spec_tokens: API speculative execution's look-ahead in tokens (`speculative.py`), or None.
    """

    def __init__(self, func, bind_arguments: dict[str, Any] | None = None, num_api_spec_tokens: int | None = None):
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        self.num_api_spec_tokens = num_api_spec_tokens
        parameters = list(inspect.signature(func).parameters.values())
        if not parameters:
            raise TypeError(f"@function {func.__name__} must take the program state as its first argument")
        self.arg_names = [p.name for p in parameters[1:]]
        # Arguments a positional batch item may leave out: those with defaults (SGLang's `arg_defaults`).
        self.num_required_args = sum(1 for p in parameters[1:] if p.default is inspect.Parameter.empty)
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy with some arguments fixed.

        Raises
        ------
        TypeError: a name that is not one of the program's parameters.
        """
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no parameter(s) {unknown}")
        return SglFunction(self.func, {**self.bind_arguments, **kwargs}, self.num_api_spec_tokens)

    # ---- running --------------------------------------------------------------------

    def run(self, *args: Any, backend: Any = None, stream: bool = False, use_thread: bool = True,
            **kwargs: Any) -> ProgramState:
        """Run the program once and return its state.

        Keyword arguments that are not the program's parameters are sampling
        defaults for every `gen` (`temperature=0`, `max_new_tokens=64`). With
        `stream=True` the state returns at once and `state.text_iter()` follows
        the generation. `use_thread` is SGLang's: its False runs the expressions on the caller's
        thread; arborlm always runs them on the state's worker thread, which gives the same
        result (the keyword is accepted so that SGLang's programs run).

        Raises
        ------
        ValueError: no backend given and none set as default.
        TypeError: an unknown keyword (see `_split_kwargs`), `use_thread` not a bool.
        Whatever the program raises; an error inside a `gen` carries a note
        naming the program line that appended it.
        """
        if not isinstance(use_thread, bool):
            raise TypeError(f"use_thread must be a bool, got {type(use_thread).__name__} {use_thread!r}")
        program_kwargs, sampling = self._split_kwargs(kwargs)
        state = self._start(resolve_backend(backend), sampling, stream)
        try:
            self.func(state, *args, **{**self.bind_arguments, **program_kwargs})
        finally:
            state.stream_executor.end()
        if not stream:
            state.sync()
            state.stream_executor.raise_error()
            if global_config.verbosity >= 2:
                print(state.text())
        return state

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **sampling_kwargs: Any,
    ) -> list[ProgramState]:
        """Run the program once per item of `batch_kwargs`; the states in input order.

        Before the items start, the prefix they all share (from `trace`) is
        prefilled once, so every item starts from a cache hit. An item that
        fails does not stop the others: its state's `error()` holds the error.

        Parameters
        ----------
        batch_kwargs: one dict of program arguments per run, or one tuple (list) of
            positional arguments per run, in the program's parameter order (SGLang's two forms).
        num_threads: programs run at once; "auto" is max(96, 16 per CPU) capped at the batch size.
        progress_bar: show a tqdm bar of finished items.
        sampling_kwargs: sampling defaults for every `gen`, as in `run`.

        Raises
        ------
        ValueError: no backend; TypeError: an item is neither a dict nor a tuple of the
            program's positional arguments (or has too few or too many of them).
        """
        backend = resolve_backend(backend)
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(f"run_batch takes a list of argument dicts or tuples, got {type(batch_kwargs).__name__}")
        batch_kwargs = [self._as_kwargs(item, i) for i, item in enumerate(batch_kwargs)]
        for item in batch_kwargs:  # a misspelt argument fails the call, as in a plain Python call
            self._split_kwargs(item)
        if not batch_kwargs:
            return []
        _, sampling = self._split_kwargs(sampling_kwargs)
        if len(batch_kwargs) > 1 and global_config.enable_precache_with_tracing:
            self.prefill_prefix(backend, batch_kwargs)
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        num_threads = max(1, min(int(num_threads), len(batch_kwargs)))
        with ThreadPoolExecutor(num_threads, thread_name_prefix="arborlm-batch") as pool:
            futures = [pool.submit(self._run_item, backend, sampling, item) for item in batch_kwargs]
            if progress_bar:
                from tqdm import tqdm

                for _ in tqdm(as_completed(futures), total=len(futures), desc=self.func.__name__):
                    pass
            return [f.result() for f in futures]

    def _as_kwargs(self, item: Any, index: int) -> dict[str, Any]:
        """A batch item as keyword arguments: a dict as it is, a tuple of positional arguments by name."""
        if isinstance(item, dict):
            return item
        if isinstance(item, (list, tuple)):
            free = [n for n in self.arg_names if n not in self.bind_arguments]
            if not self.num_required_args - len(self.bind_arguments) <= len(item) <= len(free):
                raise TypeError(f"run_batch item {index} has {len(item)} positional arguments; "
                                f"{self.func.__name__}() takes {free}")
            return dict(zip(free, item, strict=False))
        raise TypeError(f"run_batch item {index} is a {type(item).__name__}: give a dict of arguments "
                        "or a tuple of positional arguments")

    def _run_item(self, backend: BaseBackend, sampling: dict[str, Any], item: dict[str, Any]) -> ProgramState:
        """One batch item; its error is kept in its state, not raised."""
        program_kwargs, item_sampling = self._split_kwargs(item)
        state = self._start(backend, {**sampling, **item_sampling}, False)
        try:
            self.func(state, **{**self.bind_arguments, **program_kwargs})
        except Exception as e:  # noqa: BLE001 - one failing item must not stop the batch
            state.sync()
            state.stream_executor.error_ = state.stream_executor.error_ or e
        finally:
            state.stream_executor.end()
        state.sync()
        return state

    def _start(self, backend: BaseBackend, sampling: dict[str, Any], stream: bool) -> ProgramState:
        return ProgramState(StreamExecutor(backend, sampling, stream, num_api_spec_tokens=self.num_api_spec_tokens))

    def _split_kwargs(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(program arguments, sampling defaults under `SamplingParams` names), checked now, when
        the program is called, not when a gen sends its request (which may be never).

        Raises
        ------
        TypeError: a keyword that is neither a program parameter nor a sampling field, named as
            Python names an unexpected keyword argument.
        InvalidRequestError: a sampling default of the wrong type (`max_new_tokens="x"`).
        """
        program = {k: v for k, v in kwargs.items() if k in self.arg_names}
        sampling = {_RUN_SAMPLING_ALIASES.get(k, k): v for k, v in kwargs.items() if k not in self.arg_names}
        unknown = [k for k in kwargs if k not in self.arg_names and _RUN_SAMPLING_ALIASES.get(k, k) not in _RUN_FIELDS]
        if unknown:
            raise TypeError(f"{self.func.__name__}() got an unexpected keyword argument {unknown[0]!r} (its "
                            f"parameters are {self.arg_names}; other keywords must be sampling parameters)")
        _check_sampling(sampling)
        return program, sampling

    # ---- tracing --------------------------------------------------------------------

    def trace(self, *, backend: Any = None, chat_template: ChatTemplate | None = None,
              **kwargs: Any) -> TracedProgram:
        """Record the program's nodes and constant prefix without running a model.

        Arguments given in `kwargs` (and bound ones) are used as values, the
        others become placeholders. Role markers come from `chat_template`, else
        from `backend` (or the default backend), else plain "Role: " markers.
        """
        if chat_template is None:
            try:
                chat_template = resolve_backend(backend).get_chat_template()
            except ValueError:
                chat_template = ChatTemplate.plain()
        return trace_program(self.func, {**self.bind_arguments, **kwargs}, self.arg_names, chat_template)

    def compile(self, *, backend: Any = None) -> CompiledFunction:
        """The program traced once for `backend`: `run` and `run_batch` reuse the trace's prefix."""
        backend = resolve_backend(backend)
        return CompiledFunction(self, backend, self.trace(backend=backend))

    def cache(self, backend: Any = None) -> dict[str, Any] | None:
        """Prefill the program's constant prefix (with its bound arguments) on `backend`, or the
        default one, so later runs start from a radix-cache hit (SGLang's ``SglFunction.cache``).

        Returns the prefill's meta info, or None when the program starts with no constant text.

        Raises
        ------
        ValueError: no backend given and none set as default.
        """
        return self.prefill_prefix(resolve_backend(backend))

    def prefill_prefix(self, backend: BaseBackend, batch_kwargs: list[dict[str, Any]] | None = None,
                       traced: TracedProgram | None = None) -> dict[str, Any] | None:
        """Prefill the text every run starts with (a prefix hint); its meta info, or None without one.

        The prefix is the traced constant prefix, extended to what all of
        `batch_kwargs` have in common when their arguments are given.
        """
        traced = traced or self.trace(backend=backend)
        prefix = traced.prefix
        if batch_kwargs:
            common = {k: v for k, v in batch_kwargs[0].items()
                      if k in self.arg_names and all(k in b and b[k] == v for b in batch_kwargs[1:])}
            if common:
                prefix = max(prefix, self.trace(backend=backend, **common).prefix, key=len)
        return backend.prefill(prefix) if prefix else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`f(...)` is `f.run(...)` (SGLang's shorthand: `f(question=..., temperature=0, stream=True)`);
        inside another program, `f(s, ...)` with that program's state runs `f` on the same state
        (a nested call) and returns what `f` returns."""
        if args and _is_state(args[0]):
            return self.func(*args, **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)


def _is_state(value: Any) -> bool:
    """A program state a nested call continues: a running one, or the tracer's stand-in."""
    return isinstance(value, (ProgramState, TracerProgramState))


class CompiledFunction:
    """A program traced for one backend: its nodes and prefix, and run / run_batch that use them."""

    def __init__(self, function: SglFunction, backend: BaseBackend, traced: TracedProgram):
        self.function = function
        self.backend = backend
        self.traced = traced

    @property
    def prefix(self) -> str:
        return self.traced.prefix

    @property
    def nodes(self):
        return self.traced.nodes

    @property
    def last_node(self):
        """The traced graph's last node (`tracer.TraceGraphNode`)."""
        return self.traced.last_node

    def print_graph(self) -> None:
        """Print the traced graph, one node a line (SGLang's ``CompiledFunction.print_graph``)."""
        self.traced.print_graph()

    def run(self, *args: Any, **kwargs: Any) -> ProgramState:
        kwargs.setdefault("backend", self.backend)
        return self.function.run(*args, **kwargs)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], **kwargs: Any) -> list[ProgramState]:
        kwargs.setdefault("backend", self.backend)
        return self.function.run_batch(batch_kwargs, **kwargs)
