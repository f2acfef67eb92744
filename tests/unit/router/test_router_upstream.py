"""The proxy's upstream client (router/upstream.py) against a real HTTP server on loopback: connections
kept alive and reused, found closed and replaced, bodies streamed in order, failures told apart, the
connection limit, and the same under uvloop (the router's loop)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop
from aiohttp import web

from kvstrata.router.upstream import ConnectFailed, Disconnected, Upstream, base_of


@dataclass
class Server:
    url: str = ""
    peers: list[object] = field(default_factory=list)  # the client's address of each request
    runner: web.AppRunner | None = None
    in_flight: int = 0
    most_in_flight: int = 0


async def _serve(keepalive: float = 75.0) -> Server:
    srv = Server()

    async def plain(request: web.Request) -> web.StreamResponse:
        srv.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        body = await request.read()
        resp = web.Response(body=b"echo:" + body, content_type="text/plain")
        resp.headers.add("Set-Cookie", "a=1")
        resp.headers.add("Set-Cookie", "b=2")
        return resp

    async def stream(request: web.Request) -> web.StreamResponse:
        srv.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(5):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def big(request: web.Request) -> web.StreamResponse:
        return web.Response(body=bytes(range(256)) * 16_384)  # 4 MiB, past the pause threshold

    async def die(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": "1000"})
        await resp.prepare(request)
        await resp.write(b"x" * 10)
        assert request.transport is not None
        request.transport.close()
        return resp

    async def slow(request: web.Request) -> web.StreamResponse:
        srv.in_flight += 1
        srv.most_in_flight = max(srv.most_in_flight, srv.in_flight)
        await asyncio.sleep(0.05)
        srv.in_flight -= 1
        return web.Response(text="slow")

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/plain", plain)
    app.router.add_route("HEAD", "/plain", plain)
    app.router.add_get("/stream", stream)
    app.router.add_get("/big", big)
    app.router.add_get("/die", die)
    app.router.add_get("/slow", slow)
    srv.runner = web.AppRunner(app, keepalive_timeout=keepalive)
    await srv.runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(srv.runner, sock)
    await site.start()
    srv.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    return srv


@pytest.fixture
async def server() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    made: list[Server] = []

    async def make(**kw: float) -> Server:
        made.append(await _serve(**kw))
        return made[-1]

    yield make
    for srv in made:
        assert srv.runner is not None
        await srv.runner.cleanup()


@pytest.fixture(name="up")
async def _upstream() -> AsyncIterator[Upstream]:
    client = Upstream(connect_timeout=2)
    yield client
    await client.close()


@contextlib.asynccontextmanager
async def _raw_engine(
    engine: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """An engine written byte by byte (asyncio streams): its base URL."""
    srv = await asyncio.start_server(engine, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    finally:
        srv.close()
        await srv.wait_closed()


async def _post(up: Upstream, url: str, body: bytes) -> tuple[int, bytes, list[tuple[str, str]]]:
    resp = await up.request(url, "POST", "/plain", {"Content-Type": "text/plain"}, body)
    try:
        return resp.status, await resp.read(), resp.headers
    finally:
        resp.release()


async def _sequential_requests_share_one_connection(server: Server) -> None:
    up = Upstream(connect_timeout=2)
    try:
        for i in range(20):
            status, body, _ = await _post(up, server.url, f"n{i}".encode())
            assert (status, body) == (200, f"echo:n{i}".encode())
        assert len(set(server.peers)) == 1  # one client port: one connection, kept alive
        resp = await up.request(server.url, "GET", "/stream", {}, b"")
        chunks = []
        while chunk := await resp.readany():
            chunks.append(chunk)
        resp.release()
        assert b"".join(chunks) == b"".join(f"data: {i}\n\n".encode() for i in range(5))
        assert len(chunks) > 1  # handed over as they came, not at the end
    finally:
        await up.close()


async def test_sequential_requests_share_one_connection_and_streams_arrive_in_order(
    server: Callable[..., Awaitable[Server]], up: Upstream
) -> None:
    await _sequential_requests_share_one_connection(await server())


def test_the_same_under_uvloop() -> None:
    """The router runs on uvloop, whose transports are not asyncio.Transport subclasses."""

    async def scenario() -> None:
        srv = await _serve()
        try:
            await _sequential_requests_share_one_connection(srv)
        finally:
            assert srv.runner is not None
            await srv.runner.cleanup()

    uvloop.run(scenario())


async def test_a_connection_the_engine_closed_while_idle_is_replaced_and_the_request_sent_once(
    server: Callable[..., Awaitable[Server]], up: Upstream
) -> None:
    srv = await server(keepalive=0.05)
    assert (await _post(up, srv.url, b"one"))[1] == b"echo:one"
    await asyncio.sleep(0.3)  # the server closes the idle connection
    assert (await _post(up, srv.url, b"two"))[1] == b"echo:two"
    assert len(srv.peers) == 2 and len(set(srv.peers)) == 2  # sent once, on a new connection


async def test_a_connection_closed_as_the_request_arrives_is_retried_once_on_a_new_one(up: Upstream) -> None:
    """The engine closes a kept-alive connection just as the next request is written on it (its idle
    timer fired): the client finds out only then, with no byte of an answer. The engine never read
    that request, so it goes once more on a new connection."""
    answered: list[int] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = len(answered)
        answered.append(0)
        while await reader.readuntil(b"\r\n\r\n"):
            if answered[conn] == 1:  # the second request on this connection: close, do not answer
                break
            await reader.readexactly(2)  # the body: b"hi"
            answered[conn] += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    async with _raw_engine(engine) as url:
        for _ in range(2):
            resp = await up.request(url, "POST", "/", {}, b"hi")
            assert (resp.status, await resp.read()) == (200, b"ok")
            resp.release()
        assert answered == [1, 1]  # the second request: not answered on the first connection, then once


async def test_a_body_without_a_length_ends_with_its_connection_and_a_base_path_prefixes_requests(
    up: Upstream,
) -> None:
    lines: list[bytes] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines.append((await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")[0])
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello, ")
        await writer.drain()
        writer.write(b"until the end")
        writer.close()

    async with _raw_engine(engine) as url:
        resp = await up.request(url + "/engine-a/", "GET", "/v1/models", {}, b"")
        assert (resp.status, await resp.read()) == (200, b"hello, until the end")
        resp.release()
        assert lines == [b"GET /engine-a/v1/models HTTP/1.1"]
        assert up.idle() == 0  # Connection: close


async def test_duplicate_headers_and_a_4_mib_body_arrive_intact(
    server: Callable[..., Awaitable[Server]], up: Upstream
) -> None:
    srv = await server()
    payload = bytes(range(256)) * 16_384
    status, body, headers = await _post(up, srv.url, payload)
    assert status == 200 and body == b"echo:" + payload
    assert [v for k, v in headers if k.lower() == "set-cookie"] == ["a=1", "b=2"]
    resp = await up.request(srv.url, "GET", "/big", {}, b"")
    assert resp.content_length == len(payload)
    got = await resp.read()
    resp.release()
    assert got == payload
    # A HEAD response has no body (its Content-Length notwithstanding); the next request is whole.
    resp = await up.request(srv.url, "HEAD", "/plain", {}, b"")
    assert (resp.status, await resp.read()) == (200, b"")
    resp.release()
    assert (await _post(up, srv.url, b"after"))[1] == b"echo:after"


async def test_an_interim_100_continue_is_skipped_for_the_real_answer(
    server: Callable[..., Awaitable[Server]], up: Upstream
) -> None:
    """curl asks with ``Expect: 100-continue`` for bodies over 1 KiB and the proxy passes the header on:
    the engine answers 100 first, then the response."""
    srv = await server()
    body = b"x" * 5_000
    resp = await up.request(srv.url, "POST", "/plain", {"Expect": "100-continue"}, body)
    assert (resp.status, await resp.read()) == (200, b"echo:" + body)
    resp.release()
    assert (await _post(up, srv.url, b"next"))[1] == b"echo:next"
    assert len(set(srv.peers)) == 1


async def test_failures_are_told_apart_and_a_broken_body_is_not_reused(
    server: Callable[..., Awaitable[Server]], up: Upstream
) -> None:
    srv = await server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: refused (and held, so nobody else listens there)
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(ConnectFailed):
            await up.request(closed, "GET", "/", {}, b"")
    resp = await up.request(srv.url, "GET", "/die", {}, b"")
    with pytest.raises(Disconnected):
        await resp.read()
    resp.release()
    # A response abandoned half read closes its connection: the next one does not read its rest.
    resp = await up.request(srv.url, "GET", "/big", {}, b"")
    await resp.readany()
    resp.release()
    assert (await _post(up, srv.url, b"clean"))[1] == b"echo:clean"


async def test_a_cancelled_request_closes_its_connection(
    server: Callable[..., Awaitable[Server]], up: Upstream
) -> None:
    srv = await server()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await up.request(srv.url, "GET", "/slow", {}, b"")
    assert (await _post(up, srv.url, b"next"))[1] == b"echo:next"
    assert up.idle() == 1  # the cancelled one's connection was closed, not kept


async def test_no_more_connections_in_use_than_the_limit(server: Callable[..., Awaitable[Server]]) -> None:
    srv = await server()
    up = Upstream(connect_timeout=2, limit=2)

    async def one() -> bytes:
        resp = await up.request(srv.url, "GET", "/slow", {}, b"")
        try:
            return await resp.read()
        finally:
            resp.release()

    try:
        assert await asyncio.gather(*(one() for _ in range(6))) == [b"slow"] * 6
        assert srv.most_in_flight == 2
    finally:
        await up.close()


def test_base_urls() -> None:
    assert base_of("http://10.0.0.7:8000").origin.host_header == "10.0.0.7:8000"
    assert base_of("http://[fd00::7]:8000/").origin.host_header == "[fd00::7]:8000"
    gateway = base_of("https://gateway.example/engine-a/")
    assert (gateway.origin.port, gateway.origin.host_header, gateway.prefix) == (
        443,
        "gateway.example",
        "/engine-a",
    )
    with pytest.raises(ValueError, match="not an http"):
        base_of("tcp://10.0.0.7:5557")
