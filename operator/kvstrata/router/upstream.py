"""The proxy's HTTP/1.1 client to the engines: kept-alive connections per engine, each request written
in one piece, each response parsed by llhttp (``httptools``) as its bytes arrive.

Why not aiohttp's client, which the router keeps for everything off the request path (load scrapes,
``/tokenize``, discovery): it cost about 66 µs of CPU per request. A bare aiohttp server relaying to
nginx took 115 µs per request through ``ClientSession`` and 49 µs through this (measured with
`make bench-proxy`'s load). The data path needs little of a general client: no cookies, redirects,
proxies, decompression or multipart; bytes out, then a status, headers and the body as it arrives.

What the proxy's failover tells apart (proxy.py):

- :class:`ConnectFailed`: no connection (refused, unreachable). Nothing was sent; the engine is down.
- :class:`ConnectTimedOut`: no connection within the connect timeout. Nothing was sent; it may only be
  slow to accept.
- :class:`Disconnected`: the connection broke, or the response was not HTTP, before the response was
  whole. A kept-alive connection that the engine closed while idle is found out only by using it: when
  one ends before a single response byte, the request is sent again once on a new connection (the
  engine never read it: a server closes an idle connection, not one with a request in it).

Every other deadline is the caller's (``asyncio.timeout`` around the call): a cancelled request closes
its connection, since what is left of its response would arrive on it."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

# A response body buffered past this waits in the kernel (the connection stops reading) until the
# caller reads it: a slow client of a fast engine does not grow the router's memory.
_PAUSE_BYTES = 1 << 20


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """No connection to the engine (refused, unreachable): nothing was sent."""


class ConnectTimedOut(UpstreamError):
    """No connection within the connect timeout: nothing was sent."""


class Disconnected(UpstreamError):
    """The connection broke (or the answer was not HTTP) before the whole response arrived."""


@dataclass(frozen=True, slots=True)
class Origin:
    host: str
    port: int
    tls: bool

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return host if self.port == (443 if self.tls else 80) else f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Base:
    """An engine's base URL: where to connect, and the path its requests' paths go under."""

    origin: Origin
    prefix: str


def base_of(url: str) -> Base:
    """``http://10.0.0.7:8000`` or ``https://gateway.example/engine-a`` as a :class:`Base`."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return Base(Origin(parts.hostname, parts.port or (443 if tls else 80), tls), parts.path.rstrip("/"))


class Response:
    """One response: its status and headers once they are in, its body as it arrives."""

    __slots__ = (
        "_buffered", "_chunks", "_conn", "_done", "_error", "_released", "_slot", "_waiter", "headers", "status"
    )  # fmt: skip

    def __init__(self, conn: _Connection, status: int, headers: list[tuple[str, str]]) -> None:
        self._conn = conn
        self._slot: asyncio.Semaphore | None = None  # the pool's limit: freed on release
        self._released = False
        self.status = status
        self.headers = headers
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: Disconnected | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def content_length(self) -> int | None:
        for name, value in self.headers:
            if name.lower() == "content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    async def readany(self) -> bytes:
        """What arrived of the body since the last call (waits for some); b"" once it is all read.
        :class:`Disconnected` if the connection broke first."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: its connection goes back for reuse if the body was read to its end
        and the engine keeps it alive, else it is closed."""
        if self._released:
            return
        self._released = True
        self._conn.finished(self._done and self._error is None and not self._chunks)
        if self._slot is not None:
            self._slot.release()

    # --- from the connection ---------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_BYTES:
            self._conn.pause()
        self._wake()

    def _end(self, error: Disconnected | None = None) -> None:
        if error is not None and not self._done:
            self._error = error
        self._done = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One connection to one engine, one request at a time (httptools calls the ``on_*`` methods)."""

    def __init__(self, pool: Upstream, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.got_bytes = False  # of the current response
        self._head: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._headers: list[tuple[str, str]] = []
        self._complete = False
        self._paused = False
        self._no_body = False
        self._keep_alive = False

    # --- asyncio ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(Disconnected(f"not an HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.lost(self)
        response = self._response
        if exc is None and response is not None and not self._complete and _ends_at_close(response):
            self.on_message_complete()  # a body without a length ends when the connection does
        if not self._complete:
            why = f"connection lost: {exc!r}" if exc else "connection closed by the engine"
            self._broken(Disconnected(why))

    # --- httptools -------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("utf-8", "replace"), value.decode("utf-8", "replace")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # interim (a client's Expect: 100-continue is passed on): the answer follows
            self._headers = []
            return
        self._response = Response(self, status, self._headers)
        self._headers = []
        # Read now: once the message is complete the parser has moved on to the next one.
        self._keep_alive = self._parser.should_keep_alive()
        if self._head is not None and not self._head.done():
            self._head.set_result(self._response)
        if self._no_body:
            self.on_message_complete()

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._response is None or self._complete:
            return
        self._complete = True
        self._response._end()

    # --- the pool's side -------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes, no_body: bool) -> asyncio.Future[Response]:
        """Write a request; the future has its response once the status and headers are in."""
        assert self.transport is not None
        self._head = asyncio.get_running_loop().create_future()
        self._response, self._headers, self._complete, self._no_body = None, [], False, no_body
        self._keep_alive = False
        self.got_bytes = False
        self.transport.writelines((head, body) if body else (head,))
        return self._head

    def _broken(self, error: Disconnected) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        elif self._response is not None:
            self._response._end(error)

    def finished(self, whole: bool) -> None:
        """The caller is done with the response: reuse the connection if it can be."""
        self._head = self._response = None
        # After a HEAD the parser would read the next response as this one's body: not reused.
        if whole and not self.closed and not self._no_body and self._keep_alive:
            self.resume()
            self._pool.put_back(self)
        else:
            self.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Upstream:
    """Kept-alive connections to each engine, at most ``limit`` in use at once (0: no limit; a request
    past the limit waits for one)."""

    def __init__(self, *, connect_timeout: float, limit: int = 0, keepalive_seconds: float = 60.0) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_seconds = keepalive_seconds
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self._idle: dict[Origin, list[_Connection]] = {}
        self._bases: dict[str, Base] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def request(
        self, base_url: str, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        """Send a request to the engine at ``base_url`` and return its response once the status and
        headers are in. The caller reads the body and then calls :meth:`Response.release`."""
        base = self._bases.get(base_url)
        if base is None:
            base = self._bases[base_url] = base_of(base_url)
        origin = base.origin
        head = _request_head(method, base.prefix + path, origin, headers, len(body))
        no_body = method == "HEAD"
        if self._slots is not None:
            await self._slots.acquire()
        try:
            conn = self._take(origin)
            if conn is not None:
                try:
                    return await self._exchange(conn, head, body, no_body)
                except Disconnected:
                    if conn.got_bytes:
                        raise
                    # Closed by the engine while idle (it never read the request): once more, anew.
            return await self._exchange(await self._connect(origin), head, body, no_body)
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes, no_body: bool) -> Response:
        try:
            response = await conn.send(head, body, no_body)
        except BaseException:
            conn.close()  # cancelled or broken: what is left of the response would come on it
            raise
        response._slot = self._slots
        return response

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have been closed
            if not conn.closed and now - conn.idle_since < self.keepalive_seconds:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin), origin.host, origin.port, ssl=tls
                )
        except TimeoutError as exc:
            raise ConnectTimedOut(
                f"no connection to {origin.host}:{origin.port} within {self.connect_timeout:g}s"
            ) from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        return conn

    def idle(self) -> int:
        """Connections kept alive for reuse now."""
        return sum(len(conns) for conns in self._idle.values())

    # --- from connections ------------------------------------------------------------------------
    def put_back(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)

    def lost(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _ends_at_close(response: Response) -> bool:
    """Whether ``response``'s body has neither a length nor chunks: it ends when the connection closes."""
    if response.content_length is not None:
        return False
    coding = response.header("transfer-encoding")
    return coding is None or "chunked" not in coding.lower()


def _request_head(method: str, path: str, origin: Origin, headers: Mapping[str, str], length: int) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {origin.host_header}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if length or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {length}")
    # Header text as the server side decoded it (UTF-8, undecodable bytes escaped): the same bytes out.
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
