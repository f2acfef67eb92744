"""`make bench-relay-floor`: the least a Python relay costs per request, beside which to read bench-proxy.

Three relays that decide nothing forward bench-proxy's json requests to the same nginx backend through
the router's own upstream client (`router/upstream.py`), under bench-proxy's wrk load (64 connections,
one thread), on uvloop with the router's collector settings:

- **aiohttp-app**: an aiohttp ``web.Application`` with one route, as the router serves (no middleware);
- **aiohttp-server**: aiohttp's low-level ``web.Server`` (no application, router or middleware);
- **httptools**: a bare asyncio protocol around httptools' request parser, writing the response in one
  piece: nearly nothing between the sockets and the upstream client;
- **hyper**: no Python on the path at all: hyper's server and kept-alive client on one tokio thread
  (`bench/relay_native/`, built by `make bench-relay-floor`): the floor of a native HTTP path;
- **hyper-kv-aware**: the same, asking the router's kv-aware decision in Python for every request (parse,
  decide, admit, commit; one GIL acquisition, on the tokio thread) and ending it when the answer is back
  (release, settle; another), as `make bench-decision` does: what a native HTTP path would cost with the
  decision kept in Python;
- **hyper-kv-aware-loop**: the same decision run where the router runs it today, on an asyncio event loop
  (uvloop) in the main thread, a task per request: the tokio thread hands each request over
  (``call_soon_threadsafe``) and waits for the answer, and the end goes back the same way.

CPU µs per request of the relay's process is the figure, as bench-proxy's; what separates kvstrata's
round-robin from aiohttp-app is the proxy's own work (parsing, admission, failover, headers, metrics).
No peer column: these are floors for Python, not routers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

from bench import nginx_backend
from bench.procs import ProcGroup, bench_main, free_port, http_get, wait_until
from bench.proxy_bench import request_body
from bench.report import fmt, group_cpu_seconds, machine, table
from bench.wrk import run_wrk, write_script

KINDS = ("aiohttp-app", "aiohttp-server", "httptools", "hyper", "hyper-kv-aware", "hyper-kv-aware-loop")
_NATIVE_KINDS = ("hyper", "hyper-kv-aware", "hyper-kv-aware-loop")
_HEADERS = {"content-type": "application/json"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default=",".join(KINDS), help="relays to measure")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per relay")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--workdir", type=Path, default=Path(".bench/relay-floor"))
    p.add_argument("--out", type=Path, default=Path(".bench/relay-floor.json"))
    # Internal: serve one relay (the benchmark starts itself with these).
    p.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    return p.parse_args(argv)


async def _serve(kind: str, port: int, upstream_url: str) -> None:
    from aiohttp import web

    from kvstrata.router.upstream import Upstream

    up = Upstream(connect_timeout=5.0, limit=256)

    async def relay(body: bytes) -> tuple[int, bytes]:
        resp = await up.request(upstream_url, "POST", "/v1/completions", _HEADERS, body)
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()

    async def handle(request: web.BaseRequest) -> web.Response:
        status, data = await relay(await request.read())
        return web.Response(status=status, body=data, headers=_HEADERS)

    loop = asyncio.get_running_loop()
    if kind == "aiohttp-app":
        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    elif kind == "aiohttp-server":
        await loop.create_server(web.Server(handle, access_log=None), "127.0.0.1", port, backlog=4096)
    else:
        await loop.create_server(lambda: _Bare(relay), "127.0.0.1", port, backlog=4096)
    await asyncio.Event().wait()


def _serve_native(kind: str, port: int, upstream_url: str) -> None:
    """The hyper relay, with the kv-aware decision asked of Python per request for ``hyper-kv-aware``."""
    import kvstrata_relay_native

    if kind == "hyper":
        kvstrata_relay_native.serve(port, [upstream_url])
    elif kind == "hyper-kv-aware":
        decide, end = _kv_aware_callbacks()
        kvstrata_relay_native.serve(port, [upstream_url], decide, end)
    else:
        import uvloop

        uvloop.run(_serve_native_on_loop(port, upstream_url))


async def _serve_native_on_loop(port: int, upstream_url: str) -> None:
    """hyper-kv-aware-loop: the decision as a task on this loop, the HTTP path on the tokio thread."""
    import kvstrata_relay_native

    kv = _KvAware()
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def decide(body: bytes, reply: Any) -> None:
        reply.send(*await kv.admit(body))

    def start(body: bytes, reply: Any) -> None:
        task = loop.create_task(decide(body, reply))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def submit(body: bytes, reply: Any) -> None:  # on the tokio thread
        loop.call_soon_threadsafe(start, body, reply)

    def end(ticket: Any) -> None:  # on the tokio thread
        loop.call_soon_threadsafe(kv.end, ticket)

    threading.Thread(
        target=kvstrata_relay_native.serve,
        args=(port, [upstream_url]),
        kwargs={"end": end, "submit": submit},
        daemon=True,
    ).start()
    await asyncio.Event().wait()


class _KvAware:
    """bench-decision's request on a kv-aware router with the tiny model's tokenizer and three endpoints
    (never contacted): :meth:`admit` parses, decides, admits and commits; :meth:`end` releases and
    settles. Made on a running loop."""

    def __init__(self) -> None:
        from kvstrata.api.router_config import RouterSettings
        from kvstrata.router.core import Router
        from kvstrata.router.metrics import RouterMetrics
        from kvstrata.router.pool import EndpointSpec
        from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

        tokenizer = ensure_tiny_model(default_tiny_model_dir())
        self.settings = RouterSettings.model_validate(
            {"model": nginx_backend.MODEL, "blockSize": 32, "policy": "kv-aware", "tokenizer": str(tokenizer)}
        )
        self.router = Router(self.settings, RouterMetrics())
        self.urls = [f"http://engine-{i}:8000" for i in range(3)]
        self.router.pool.replace([EndpointSpec(u) for u in self.urls])

    async def admit(self, body: bytes) -> tuple[int, Any]:
        """(the chosen endpoint's index, the ticket for :meth:`end`)."""
        from kvstrata.router.requests import parse_request

        s, router = self.settings, self.router
        parsed = parse_request(body, "completion", s.model, s.max_prompt_chars)
        decision = await router.decide(parsed, None)
        grant = await router.gate.admit(decision, parsed.output_tokens())
        ep = grant.endpoint
        if decision.committed is not ep:  # as the proxy's first try does
            router.commit(decision, ep)
        ep.in_flight += 1
        return self.urls.index(ep.url), (decision, ep, grant.claim)

    def end(self, ticket: Any) -> None:
        decision, ep, claim = ticket
        ep.in_flight -= 1
        self.router.gate.release(claim, ended=True)
        self.router.settle(decision, ep)


def _kv_aware_callbacks() -> tuple[Any, Any]:
    """``decide(body) -> (endpoint index, ticket)`` and ``end(ticket)``, run to completion on the calling
    (tokio) thread. A short prompt's decision and admission never wait, so the coroutine finishes on its
    first step; the thread is given the loop the router was made on as its running loop (asyncio's own
    hook), for the calls that ask for it."""
    loop = asyncio.new_event_loop()

    async def make() -> _KvAware:
        return _KvAware()

    kv = loop.run_until_complete(make())

    def decide(body: bytes) -> tuple[int, Any]:
        asyncio.events._set_running_loop(loop)  # thread-local: the tokio thread's
        coro = kv.admit(body)
        try:
            coro.send(None)
        except StopIteration as done:
            result: tuple[int, Any] = done.value
            return result
        coro.close()
        raise RuntimeError("the decision waited")

    return decide, kv.end


class _Bare(asyncio.Protocol):
    """HTTP/1.1 requests in, one response each, kept alive; enough for wrk's POSTs and nothing more."""

    def __init__(self, relay: Any) -> None:
        import httptools

        self._relay = relay
        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_begin(self) -> None:
        self._body = []

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, keep = b"".join(self._body), self._parser.should_keep_alive()
        asyncio.get_running_loop().create_task(self._answer(body, keep))

    async def _answer(self, body: bytes, keep: bool) -> None:
        status, data = await self._relay(body)
        t = self._transport
        if t is None or t.is_closing():
            return
        head = b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
            status,
            len(data),
        )
        t.write(head + data)
        if not keep:
            t.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    args.workdir.mkdir(parents=True, exist_ok=True)
    script = write_script(args.workdir / "wrk-json.lua", request_body(stream=False, unique=True))
    rows: list[dict[str, Any]] = []
    with ProcGroup(args.workdir / "logs") as procs:
        backend = nginx_backend.start_backend(procs, args.workdir, 1)
        for kind in kinds:
            port = free_port()
            argv = [sys.executable, "-m", "bench.relay_floor", "--serve", kind, "--port", str(port)]
            proc = procs.start(kind, [*argv, "--upstream", backend.json_urls[0]])
            url = f"http://127.0.0.1:{port}"
            try:
                # Any answer means it listens (GET is not routed: 404/405).
                wait_until(kind, lambda u=url: http_get(u + "/")[0] > 0, 20, [proc])
                run_wrk(url + "/v1/completions", script, args.connections, args.warmup)
                cpu0, t0 = group_cpu_seconds(proc.popen.pid), time.monotonic()
                res = run_wrk(url + "/v1/completions", script, args.connections, args.duration)
                cpu = group_cpu_seconds(proc.popen.pid) - cpu0
                ok = res.requests - res.non_2xx
                rows.append(
                    {
                        "relay": kind,
                        "rps": round(res.rps),
                        "p50_ms": res.p50_ms,
                        "errors": res.errors,
                        "non_2xx": res.non_2xx,
                        "cores": round(cpu / (time.monotonic() - t0), 2),
                        "cpu_us_per_request": round(cpu / ok * 1e6, 1) if ok else None,
                    }
                )
            finally:
                procs.stop(proc)
    return {
        "benchmark": "relay-floor",
        "machine": machine(),
        "settings": {"connections": args.connections, "duration_s": args.duration},
        "rows": rows,
    }


def render(payload: dict[str, Any]) -> str:
    s = payload["settings"]
    head = f"relays (all but hyper-kv-aware decide nothing), bench-proxy's json load ({s['connections']} connections, {s['duration_s']:g} s)"
    rows = [
        [
            r["relay"],
            fmt(r["rps"], 0),
            fmt(r["p50_ms"], 2),
            str(r["errors"]),
            str(r.get("non_2xx", "-")),
            fmt(r["cpu_us_per_request"], 1),
        ]
        for r in payload["rows"]
    ]
    return head + "\n" + table(["relay", "req/s", "p50 ms", "errors", "non-2xx", "cpu us/req"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve in _NATIVE_KINDS:
        from kvstrata.router.main import collect_rarely

        collect_rarely()
        _serve_native(args.serve, args.port, args.upstream)
        return 0
    if args.serve:
        import uvloop

        from kvstrata.router.main import collect_rarely

        collect_rarely()
        uvloop.run(_serve(args.serve, args.port, args.upstream))
        return 0
    return bench_main("bench-relay-floor", lambda: run(args), render, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
