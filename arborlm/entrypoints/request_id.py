"""A request id for every HTTP request: in the `X-Request-Id` response header, in the
message of a 500, and in the server log line that holds the 500's details.

The outermost of arborlm's middlewares (`http_server.create_app`), so that every
answer carries the header, the refusals of the other middlewares included. The id
is made here, never taken from the client (as OpenAI's `x-request-id`): a
client-chosen id could forge or flood log lines.
"""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"
_STATE_KEY = "arbor_request_id"


def new_request_id() -> str:
    """A fresh id, `req_` and 32 hex digits (the shape of OpenAI's)."""
    return f"req_{uuid.uuid4().hex}"


def request_id_of(conn: HTTPConnection) -> str | None:
    """The id `RequestIdMiddleware` gave this request; None outside it."""
    return conn.scope.get("state", {}).get(_STATE_KEY)


class RequestIdMiddleware:
    """Give each HTTP request an id (`request_id_of`) and send it as `X-Request-Id`.

    Parameters
    ----------
    app: the wrapped ASGI app.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        # scope["state"] is the request's own copy of the lifespan state (Starlette's request.state).
        scope.setdefault("state", {})[_STATE_KEY] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if HEADER not in headers:
                    headers.append(HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
