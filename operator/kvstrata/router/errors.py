"""The one OpenAI error shape every refusal and failure of the router uses:
``{"error": {"message", "type", "param", "code"}}`` (as a JSON response, or as an SSE event once a
stream has started)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

# The proxy's name: the middleware lives here, out of the compiled modules (kvstrata/compiled.py),
# since aiohttp marks a middleware by setting an attribute on the function.
log = logging.getLogger("kvstrata.router.proxy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_error(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(
        error_body(status, message, code=code, param=param), status=status, headers=headers
    )


def sse_error(message: str, code: str) -> bytes:
    """The last event of a stream that broke after it started (the status line is long gone)."""
    return b"data: " + json.dumps(error_body(502, message, code=code)).encode() + b"\n\n"


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors raised outside the handlers' own checks (bad method, a bug) still reach the client in
    the OpenAI error shape, never as a traceback or an HTML page."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error(exc.status, exc.reason or "request failed", code=f"http_{exc.status}")
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return json_error(500, "internal router error (logged)", code="router_error")
