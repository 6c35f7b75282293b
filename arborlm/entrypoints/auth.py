"""Bearer keys: who may call which route.

Two keys, both optional (`ServerConfig.api_key`, `admin_api_key`; SGLang's names
and rules):

| keys set      | user routes            | admin routes (flush_cache, abort_all) |
|---------------|------------------------|---------------------------------------|
| none          | anyone                 | anyone                                |
| api_key       | api_key                | api_key                               |
| admin_api_key | anyone                 | admin_api_key                         |
| both          | api_key, admin_api_key | admin_api_key                         |

`/health` and `/metrics` are open whatever the keys (probes and scrapers carry no
token), and so is every `OPTIONS` request. A missing or wrong key gets 401
`invalid_api_key`; the api_key on an admin route that needs the admin key gets
403 `insufficient_permissions`. Unlike SGLang, the admin key also opens the user
routes: an admin need not hold two keys.

`AuthMiddleware` checks the user routes and records the caller's `Role`; a route
that is an admin route calls `require_admin(request)` (abort_request is one only
with `abort_all`, which the middleware cannot see).

Keys are compared as bytes in constant time; a header that is not ASCII (which
`secrets.compare_digest` refuses as `str`) is a wrong key, not a 500.
"""

from __future__ import annotations

import enum
import secrets

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from arborlm.entrypoints.http_errors import APIError

# Open without a key: liveness probes and metric scrapers carry no token (as in SGLang).
PUBLIC_PATHS = ("/health", "/metrics")
_STATE_KEY = "arbor_role"


class Role(enum.IntEnum):
    """What a request may do, from the key it carries (higher may do more)."""

    NONE = 0  # user routes need a key and it has none that opens them
    OPEN = 1  # user routes are open and it proved nothing
    USER = 2  # it carries the api_key
    ADMIN = 3  # it may call admin routes


class KeyPolicy:
    """The server's keys and what each opens (the table of the module docstring).

    Parameters
    ----------
    api_key: the key of the user routes; None leaves them open.
    admin_api_key: the key of the admin routes; None lets whoever may call the
        user routes call them.
    """

    def __init__(self, api_key: str | None, admin_api_key: str | None):
        self._api_key = _ascii(api_key)
        self._admin_api_key = _ascii(admin_api_key)

    def role_of(self, authorization: bytes | None) -> Role:
        """The `Role` of a request whose `Authorization` header is `authorization` (raw bytes)."""
        token = bearer_token(authorization)
        is_admin = self._admin_api_key is not None and _same(token, self._admin_api_key)
        is_user = self._api_key is not None and _same(token, self._api_key)
        if is_admin or (self._admin_api_key is None and (is_user or self._api_key is None)):
            return Role.ADMIN
        if is_user:
            return Role.USER
        return Role.OPEN if self._api_key is None else Role.NONE


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of `Bearer <token>` (scheme case-insensitive, spaces around the token dropped)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


def _same(token: bytes | None, key: bytes) -> bool:
    return token is not None and secrets.compare_digest(token, key)


def _ascii(key: str | None) -> bytes | None:
    # ServerConfig refuses other keys; encoding here keeps the comparison on bytes.
    return None if key is None else key.encode("ascii")


def invalid_key() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


class AuthMiddleware:
    """401 `invalid_api_key` for a request below `Role.OPEN` to a route outside `PUBLIC_PATHS`;
    records every request's role for `require_admin`.

    Parameters
    ----------
    app: the wrapped ASGI app.
    policy: the server's keys.
    """

    def __init__(self, app: ASGIApp, policy: KeyPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        role = self.policy.role_of(_authorization(scope))
        scope.setdefault("state", {})[_STATE_KEY] = role
        exempt = scope["method"] == "OPTIONS" or scope["path"] in PUBLIC_PATHS
        if role < Role.OPEN and not exempt:
            await invalid_key().response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _authorization(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return value
    return None


def require_admin(conn: HTTPConnection) -> None:
    """Let the request through to an admin route only if its key allows it.

    Raises
    ------
    APIError: 401 `invalid_api_key` without the needed key (or outside
        `AuthMiddleware`); 403 `insufficient_permissions` for the api_key where
        the admin key is needed.
    """
    role = conn.scope.get("state", {}).get(_STATE_KEY, Role.NONE)
    if role >= Role.ADMIN:
        return
    if role == Role.USER:
        raise APIError(403, "this is an admin route: send the server's admin API key "
                            "('Authorization: Bearer <admin key>')", code="insufficient_permissions")
    raise invalid_key()
