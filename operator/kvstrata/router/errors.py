"""The one OpenAI error shape every refusal and failure of the router uses:
``{"error": {"message", "type", "param", "code"}}`` (as a JSON response, or as an SSE event once a
stream has started)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


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
