"""Request bodies: read within a deadline and a size bound, and decompressed off the event loop.

The server runs with ``auto_decompress=False``: aiohttp would otherwise inflate a gzip body on the
event loop, unbounded (a 1 MB gzip bomb once cost 420 MB and froze the router for seconds). Here a
``gzip``/``deflate`` body is inflated in a thread, stopping at ``maxBodyBytes`` of output (413);
any other encoding is refused with 415. The decoded body is what the engine receives, without the
``Content-Encoding`` that no longer applies.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from kvstrata.router.requests import BadRequest

_GZIP = frozenset({"gzip", "x-gzip"})
DECODABLE = _GZIP | {"deflate"}


def _too_large(limit: int) -> BadRequest:
    return BadRequest(f"request body is larger than {limit} bytes", status=413, code="body_too_large")


def body_timeout(timeout: float) -> BadRequest:
    return BadRequest(f"the request body did not arrive within {timeout:g}s", status=408, code="body_timeout")


def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """``data`` decoded, at most ``limit`` bytes of it, or :class:`BadRequest` (400 or 413)."""
    if encoding in _GZIP:
        wbits = 16 + zlib.MAX_WBITS
    else:  # deflate means zlib-wrapped (RFC 9110), but some clients send raw deflate
        wbits = zlib.MAX_WBITS if data[:1] == b"\x78" else -zlib.MAX_WBITS
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as exc:
        raise BadRequest(
            f"request body is not valid {encoding} data: {exc}", code="invalid_content_encoding"
        ) from None
    if len(out) > limit or d.unconsumed_tail:
        raise _too_large(limit)
    if not d.eof or d.unused_data:
        raise BadRequest(
            f"request body is not a single complete {encoding} stream", code="invalid_content_encoding"
        )
    return out


def content_encoding(request: web.BaseRequest) -> str | None:
    """The body's encoding if it needs decoding; :class:`BadRequest` 415 if the router cannot."""
    value = request.headers.get("Content-Encoding", "").strip().lower()
    if not value or value == "identity":
        return None
    if value not in DECODABLE:
        raise BadRequest(
            f"Content-Encoding {value!r} is not supported; send the body as is, or gzip or deflate",
            status=415,
            code="unsupported_content_encoding",
        )
    return value


async def read_body(request: web.BaseRequest, *, limit: int, timeout: float) -> tuple[bytes, bool]:
    """(the body, decoded?) within ``timeout`` seconds (408) and ``limit`` bytes (413)."""
    encoding = content_encoding(request)
    try:
        if request.content.is_eof():  # usual for small bodies: all in already, no deadline to arm
            raw = await request.read()
        else:
            async with asyncio.timeout(timeout):
                raw = await request.read()
    except TimeoutError:
        raise body_timeout(timeout) from None
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    if encoding is None:
        return raw, False
    if len(raw) <= 1024:  # small: cheaper inline than a thread hop
        return inflate(raw, encoding, limit), True
    return await asyncio.get_running_loop().run_in_executor(None, inflate, raw, encoding, limit), True
