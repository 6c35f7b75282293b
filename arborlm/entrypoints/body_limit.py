"""Refuse request bodies larger than `max_request_bytes` with 413, before a route reads them.

A pure ASGI middleware, outermost in the app: a `Content-Length` over the
limit is answered without calling the app; a chunked body (no length given)
is read here up to the limit and handed on whole (every route reads its body
whole anyway). Without a limit one client could make the server buffer a body
of any size in memory.

The refused body is read and dropped (up to `DRAIN_LIMIT_BYTES`) before the
answer, so that a client still sending it reads the 413 instead of a reset
connection; a body beyond that is cut off by closing the connection.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from arborlm.entrypoints.http_errors import APIError

DRAIN_LIMIT_BYTES = 256 * 1024 * 1024


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {max_bytes} bytes "
                         "(max_request_bytes)", code="request_too_large")


class BodyLimitMiddleware:
    """413 `request_too_large` for an HTTP request body over `max_bytes`.

    Parameters
    ----------
    app: the wrapped ASGI app.
    max_bytes: the largest body accepted, in bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(scope, receive, send, more_body=True)
            else:
                await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read the body here, within the limit, and replay it.
        chunks: list[bytes] = []
        received = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            more_body = message.get("more_body", False)
            if received > self.max_bytes:
                await self._refuse(scope, receive, send, more_body)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, more_body: bool) -> None:
        await _drain(receive, more_body)
        await too_large(self.max_bytes).response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive, more_body: bool) -> None:
    """Read and drop the rest of the body, up to `DRAIN_LIMIT_BYTES`."""
    dropped = 0
    while more_body and dropped < DRAIN_LIMIT_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        more_body = message.get("more_body", False)
