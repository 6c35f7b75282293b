"""The scheduler's watchdog (`runtime/watchdog.py`) and the front's reply timeout.

The watchdog is driven by fake loops, with a fake clock for its rule and real threads
for its timing: a loop stuck while it has work is reported within the timeout plus a
check interval; an idle loop and a loop that makes progress never are. The front's
`_ask` gives up after `reply_timeout_s` with `SchedulerTimeoutError` (HTTP 503), and a
late reply never answers a later question.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import zmq
import zmq.asyncio

from arborlm.cli import build_parser, server_args_from
from arborlm.entrypoints.http_errors import to_api_error
from arborlm.envs import Envs
from arborlm.errors import EngineDeadError, SchedulerTimeoutError
from arborlm.runtime.config import MAX_REPLY_TIMEOUT_S, ServerArgs
from arborlm.runtime.io_struct import GetInfoReq, InfoOut, ModelInfo
from arborlm.runtime.launcher import exit_reason
from arborlm.runtime.scheduler_process import PortArgs, Shutdown, event_loop
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.runtime.watchdog import WATCHDOG_EXIT_CODE, LoopProgress, Watchdog

TIMEOUT_S = 0.3
SLACK_S = 1.0  # a check interval (TIMEOUT_S / 4) plus scheduling delays on a busy 2-core machine


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


# ---- the rule, on a fake clock -------------------------------------------------


@pytest.mark.parametrize(
    ("began", "elapsed_s", "fires"),
    [
        (False, 1000.0, False),  # idle: waiting for messages is never a hang
        (True, 1.0, False),  # inside the timeout
        (True, 2.0, False),  # exactly the timeout
        (True, 2.5, True),  # past it
    ],
)
def test_check_fires_only_past_the_timeout_with_work(began, elapsed_s, fires):
    clock = FakeClock()
    progress = LoopProgress(clock)
    if began:
        progress.begin("step 7")
    else:
        progress.idle()
    clock.now_s += elapsed_s
    message = Watchdog(progress, 2.0, on_timeout=pytest.fail, describe=lambda: "3 requests running").check()
    assert (message is not None) == fires
    if fires:
        assert "watchdog_timeout=2 s" in message and "step 7" in message and "3 requests running" in message


def test_progress_restarts_the_clock():
    clock = FakeClock()
    progress = LoopProgress(clock)
    watchdog = Watchdog(progress, 2.0, on_timeout=pytest.fail)
    for step in range(10):  # ten 1.5 s steps: 15 s of work, none of them a hang
        progress.begin(f"step {step}")
        clock.now_s += 1.5
        assert watchdog.check() is None


def test_a_describe_that_fails_does_not_stop_the_report():
    clock = FakeClock()
    progress = LoopProgress(clock)
    progress.begin("step 1")
    clock.now_s += 5

    def broken() -> str:
        raise KeyError("num_running_reqs")

    message = Watchdog(progress, 2.0, describe=broken).check()
    assert message is not None and "could not be read" in message


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan")])
def test_watchdog_needs_a_positive_timeout(timeout_s):
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(LoopProgress(), timeout_s)


# ---- the thread, with fake loops -------------------------------------------------


class Fired:
    """An `on_timeout` that records when, and with what line, the watchdog fired."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.at_s: float | None = None
        self.message: str | None = None

    def __call__(self, message: str) -> None:
        self.at_s, self.message = time.monotonic(), message
        self.event.set()


def _watch(progress: LoopProgress) -> tuple[Watchdog, Fired]:
    fired = Fired()
    watchdog = Watchdog(progress, TIMEOUT_S, on_timeout=fired)
    watchdog.start()
    return watchdog, fired


def test_a_stuck_loop_is_reported_within_timeout_plus_slack():
    progress = LoopProgress()
    watchdog, fired = _watch(progress)
    release = threading.Event()

    def loop() -> None:
        for step in range(5):
            progress.begin(f"step {step}")
            time.sleep(0.01)
        progress.begin("step 5")
        release.wait()  # the step that never returns (until the test ends)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        assert fired.event.wait(TIMEOUT_S + SLACK_S + 1.0), "the watchdog never fired"
        stuck_at = progress.current.started_s
        assert TIMEOUT_S <= fired.at_s - stuck_at <= TIMEOUT_S + SLACK_S
        assert "step 5" in fired.message
    finally:
        release.set()
        watchdog.stop()
        thread.join(5)


def test_an_idle_loop_never_fires():
    progress = LoopProgress()
    progress.begin("step 0")
    progress.idle()  # the step finished; the loop waits for messages
    watchdog, fired = _watch(progress)
    try:
        assert not fired.event.wait(4 * TIMEOUT_S)
    finally:
        watchdog.stop()


def test_a_loop_making_progress_never_fires():
    progress = LoopProgress()
    watchdog, fired = _watch(progress)
    try:
        deadline = time.monotonic() + 4 * TIMEOUT_S
        step = 0
        while time.monotonic() < deadline:  # steps of a third of the timeout, back to back
            progress.begin(f"step {step}")
            step += 1
            time.sleep(TIMEOUT_S / 3)
        assert not fired.event.is_set()
    finally:
        watchdog.stop()


class ScriptedSocket:
    """A receive socket whose `poll` answers come from a script; it records what the loop's
    progress said at each poll (the loop only polls when it has no work)."""

    def __init__(self, progress: LoopProgress, polls: list[bool], messages: list[list]) -> None:
        self.progress, self.polls, self.batches = progress, polls, messages
        self.seen_at_poll: list[object] = []
        self.pending: list = []

    def poll(self, timeout_ms: int) -> bool:
        self.seen_at_poll.append(self.progress.current)
        ready = self.polls.pop(0)
        if ready:
            self.pending = self.batches.pop(0)
        return ready

    def recv_pyobj(self, flags: int):
        if not self.pending:
            raise zmq.Again()
        return self.pending.pop(0)


class IdleScheduler:
    """Never has work; answers nothing."""

    def has_work(self) -> bool:
        return False

    def handle(self, message) -> None:
        return None


def test_the_event_loop_reports_idle_waits_and_its_steps():
    progress = LoopProgress()
    sock = ScriptedSocket(progress, polls=[False, True, False, True], messages=[["hello"], [Shutdown()]])
    steps_seen: list[str] = []

    def step() -> list:
        steps_seen.append(progress.current.what)
        return []

    event_loop(IdleScheduler(), sock, send_sock=None, parent_pid=os.getppid(), progress=progress, step=step)
    assert sock.seen_at_poll == [None] * 4  # waiting for messages is idle, never a hang
    assert steps_seen == ["step 0 (with the messages received before it)"]


def test_the_front_names_a_watchdog_exit():
    assert "watchdog" in exit_reason(WATCHDOG_EXIT_CODE)
    assert "watchdog" not in exit_reason(-9)
    assert exit_reason(-9).startswith("the scheduler process exited (code -9)")


# ---- configuration -----------------------------------------------------------------


def test_watchdog_timeout_field():
    assert ServerArgs().scheduler.watchdog_timeout == 300.0  # SGLang's default
    assert ServerArgs().scheduler.reply_timeout_s == MAX_REPLY_TIMEOUT_S
    short = ServerArgs.from_kwargs(watchdog_timeout=2)
    assert short.scheduler.reply_timeout_s == 2  # waiting past the watchdog is pointless
    cli = server_args_from(build_parser().parse_args(["serve", "--watchdog-timeout", "2.5"]))
    assert cli.scheduler.watchdog_timeout == 2.5


@pytest.mark.parametrize("value", [0, -3.0, float("nan")])
def test_watchdog_timeout_must_be_positive(value):
    with pytest.raises(ValueError, match="watchdog_timeout"):
        ServerArgs.from_kwargs(watchdog_timeout=value)


@pytest.mark.parametrize(("value", "expected"), [("", None), ("0", 0), ("12", 12)])
def test_hang_hook_variable(value, expected):
    assert Envs.from_environ({"ARBORLM_TEST_HANG_AFTER_STEPS": value}).test_hang_after_steps == expected


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_hang_hook_variable_must_be_a_count(value):
    with pytest.raises(ValueError, match="ARBORLM_TEST_HANG_AFTER_STEPS"):
        Envs.from_environ({"ARBORLM_TEST_HANG_AFTER_STEPS": value})


# ---- the front's reply timeout --------------------------------------------------------

MODEL_INFO = ModelInfo(checkpoint="fake", architecture="LlamaForCausalLM", dtype="float32", device="cpu",
                       vocab_size=100, context_length=64, max_total_tokens=256, max_running_requests=4,
                       eos_token_ids=(2,))


class FakeScheduler:
    """The scheduler's end of the two sockets, answering only when told to."""

    def __init__(self, port_args: PortArgs) -> None:
        self.context = zmq.asyncio.Context()
        self.recv_sock = self.context.socket(zmq.PULL)
        self.recv_sock.connect(port_args.scheduler_input)
        self.send_sock = self.context.socket(zmq.PUSH)
        self.send_sock.connect(port_args.scheduler_output)

    async def receive(self):
        return await asyncio.wait_for(self.recv_sock.recv_pyobj(), 5)

    async def answer(self, info: dict) -> None:
        await self.send_sock.send_pyobj(InfoOut(info))

    def close(self) -> None:
        self.context.destroy(linger=0)


def _run_with_manager(tmp_path, body) -> None:
    """Run `body(manager, scheduler)` on a fresh loop, a manager on IPC sockets under `tmp_path`."""
    port_args = PortArgs(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    server_args = ServerArgs.from_kwargs(watchdog_timeout=TIMEOUT_S)

    async def main() -> None:
        manager = TokenizerManager(server_args, MODEL_INFO, None, port_args)
        manager.start()
        scheduler = FakeScheduler(port_args)
        try:
            await body(manager, scheduler)
        finally:
            scheduler.close()
            manager.close()

    asyncio.run(main())


def test_an_unanswered_ask_times_out_and_its_late_reply_goes_nowhere(tmp_path):
    async def body(manager: TokenizerManager, scheduler: FakeScheduler) -> None:
        started = time.monotonic()
        with pytest.raises(SchedulerTimeoutError, match="did not answer"):
            await manager.get_info()
        assert TIMEOUT_S <= time.monotonic() - started <= TIMEOUT_S + SLACK_S
        assert isinstance(await scheduler.receive(), GetInfoReq)
        await scheduler.answer({"late": True})  # the reply to the question given up on

        second = asyncio.create_task(manager.get_info())
        assert isinstance(await scheduler.receive(), GetInfoReq)
        await scheduler.answer({"fresh": True})
        info = await asyncio.wait_for(second, 5)
        assert info.get("fresh") and "late" not in info

    _run_with_manager(tmp_path, body)


def test_a_scheduler_death_fails_every_waiting_ask(tmp_path):
    async def body(manager: TokenizerManager, scheduler: FakeScheduler) -> None:
        asks = [asyncio.create_task(manager.get_info()) for _ in range(2)]
        await asyncio.sleep(0.05)
        manager.fail_all("the scheduler process exited (code -9)")
        for ask in asks:
            with pytest.raises(EngineDeadError):
                await ask
        with pytest.raises(EngineDeadError):
            await manager.flush_cache()

    _run_with_manager(tmp_path, body)


def test_a_reply_timeout_is_an_openai_style_503():
    error = to_api_error(SchedulerTimeoutError("the scheduler did not answer in 2 s"))
    body = error.body()["error"]
    assert error.status == 503 and body["code"] == "scheduler_timeout" and body["type"] == "server_error"
