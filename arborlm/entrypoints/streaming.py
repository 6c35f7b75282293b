"""Server-sent events and client disconnects.

A stream is `data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`, as both
SGLang's `/generate` and OpenAI's API send them. Requests of one call (a batch,
`n` choices) run concurrently and their chunks are merged as they come. A
client that goes away cancels its task; the cancellation reaches
`TokenizerManager.generate`, which aborts the request in the scheduler and so
frees its KV slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from arborlm.entrypoints.http_errors import APIError, to_api_error

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
_END = object()


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """A `text/event-stream` response; an error after the first event becomes an error event."""
    return StreamingResponse(
        _errors_as_events(events),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _errors_as_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield sse(to_api_error(e).body())
        yield SSE_DONE


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they arrive, tagged with the iterator's index.

    The first error of any iterator is raised here; leaving early (an error, the
    consumer closing or being cancelled) cancels every iterator still running.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def primed(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the stream's first item, so that errors known before it (a bad
    grammar, a full queue) become an HTTP error status instead of an error event.

    Returns an iterator over every item, the first included.
    """
    iterator = aiter(stream)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        first = _END

    async def rest() -> AsyncIterator[T]:
        try:
            if first is not _END:
                yield first
                async for item in iterator:
                    yield item
        finally:
            await iterator.aclose()

    return rest()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its requests) if the client disconnects first.

    Raises
    ------
    APIError: 499 `client_closed_request` after a disconnect (the answer goes nowhere;
        raising keeps the route from going on with a result nobody reads).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise APIError(499, "the client closed the request", code="client_closed_request")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
