"""Refuse what a web page can make a visitor's browser send to this server.

A page on any site can make the browser send requests to `http://127.0.0.1:30000`
without the user knowing. Three checks stop that:

- **DNS rebinding** (a page whose own name, say `evil.example`, is made to resolve
  to 127.0.0.1, so that its scripts read the answers as same-origin): while the
  server is bound to a loopback address it answers only requests whose `Host`
  is a loopback name (localhost, 127.x.x.x, [::1], any port) or one of
  `allowed_hosts`; others get 400 `invalid_host`, as Django and Starlette's
  `TrustedHostMiddleware` answer them. `allowed_hosts` widens the list (and
  applies on any bind address); `*` turns the check off.
- **Cross-site requests** (CSRF): a request a browser marks
  `Sec-Fetch-Site: cross-site` gets 403 `cross_site_request` on every route
  but `/health` and `/metrics`. This covers what the next check cannot, such as
  `GET /flush_cache` from an `<img>` tag. Clients other than browsers do not
  send the header.
- **JSON bodies under a form's content type** (CSRF): a browser sends
  `text/plain`, `application/x-www-form-urlencoded`, `multipart/form-data` or
  no content type to another origin without asking it first (no CORS
  preflight). `require_json` answers those with 415 before a route parses a body;
  `application/json` (any parameters, such as `; charset=utf-8`) and
  `application/*+json` are accepted, and every client arborlm knows (the openai
  package, httpx's and requests' `json=`, SGLang's and arborlm's
  `RuntimeEndpoint`, bench_serving) sends `application/json`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from arborlm.entrypoints.auth import PUBLIC_PATHS
from arborlm.entrypoints.http_errors import APIError

LOOPBACK_NAMES = ("localhost",)


class HostPolicy:
    """Which `Host` header values the server answers.

    Parameters
    ----------
    allowed_hosts: patterns accepted besides the loopback names (lower case;
        `*` for any, `*.suffix` for any name under suffix, `[v6]` for an IPv6
        address); None for none.
    binds_loopback: the server listens on a loopback address only.
    """

    def __init__(self, allowed_hosts: Iterable[str] | None, binds_loopback: bool):
        self.patterns = tuple(allowed_hosts or ())
        # Only a loopback server is checked by default: one bound to a public address is
        # reached under whatever names point at it.
        self.enabled = "*" not in self.patterns and (binds_loopback or bool(self.patterns))

    def allows(self, host_header: str | None) -> bool:
        """True when a request with this `Host` header may be answered."""
        if not self.enabled:
            return True
        name = host_name(host_header or "")
        if not name:
            return False
        return is_loopback_name(name) or any(_matches(name, p) for p in self.patterns)


def host_name(host_header: str) -> str:
    """The name of a `Host` header, lower case, without the port: "[::1]:80" → "[::1]"."""
    value = host_header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end != -1 else ""
    return value.rsplit(":", 1)[0] if ":" in value else value


def is_loopback_name(name: str) -> bool:
    """localhost, or a loopback address literal (127.0.0.0/8, [::1])."""
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("*."):
        return name.endswith(pattern[1:])
    return name == pattern


class BrowserGuardMiddleware:
    """400 `invalid_host` for a `Host` that `policy` refuses; 403 `cross_site_request` for a
    browser's cross-site request to a route outside `auth.PUBLIC_PATHS`.

    Parameters
    ----------
    app: the wrapped ASGI app.
    policy: the accepted `Host` values.
    """

    def __init__(self, app: ASGIApp, policy: HostPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        host = _header(scope, b"host")
        if not self.policy.allows(host):
            shown = repr(host[:100]) if host is not None else "(none)"
            return APIError(400, f"the Host header {shown} is not a name this server answers to; start it "
                                 "with --allowed-hosts to add one", code="invalid_host")
        if _header(scope, b"sec-fetch-site") == "cross-site" and scope["path"] not in PUBLIC_PATHS:
            return APIError(403, "a browser request from another site is refused (Sec-Fetch-Site: cross-site)",
                            code="cross_site_request")
        return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def is_json_media_type(content_type: str | None) -> bool:
    """True for `application/json` or `application/<x>+json`, with any parameters."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def require_json(request: Request) -> None:
    """Refuse a body that is not declared JSON, before it is parsed.

    Raises
    ------
    APIError: 415 `unsupported_media_type`.
    """
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type):
        given = f"'{content_type}'" if content_type else "none"
        raise APIError(415, f"the request body must be JSON sent as 'Content-Type: application/json' "
                            f"(the request's content type: {given})", code="unsupported_media_type")
