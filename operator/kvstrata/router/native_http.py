"""The native HTTP front (``dataPlane: native``): hyper serves the router's port from the native core
(native/src/front.rs) and calls into Python for every decision and every piece of bookkeeping.

- A short plain generation request is read by the front, which calls :meth:`NativeHttp.begin`: Python
  parses, decides, admits and starts the first try (router/proxy.py, ``Proxy.plan``), and the front
  makes it, then reports its first byte and its end. A decision that must wait (a held request, a long
  prompt hashed in the pools) goes on as a task on the event loop and answers through ``reply``.
- Everything else reaches the Python app on a loopback port, as it would without the front: other
  paths, large or encoded bodies, and a request whose first try failed before anything reached the
  client or whose first try is a patient one (Python goes on with it, named by a one-use token).

Each call runs under the router lock (router/loop.py), so the event loop's callbacks and the front's
calls never interleave. Python's exceptions do not cross into the front: a call that fails is logged
and the client gets the OpenAI-shaped 500 that the Python app's middleware gives.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from asyncio.tasks import _enter_task, _leave_task  # the current task, for a step run off the loop
from collections.abc import Coroutine, Generator
from typing import Any, cast

import kvstrata_native
from aiohttp import web

from kvstrata.api.router_config import RouterSettings
from kvstrata.router.errors import json_error
from kvstrata.router.loop import RouterLock
from kvstrata.router.outcomes import FailureKind, Outcome
from kvstrata.router.proxy import PROXY_KEY, Answer, NativeTry, Plan, Proxy, Resume, answer
from kvstrata.router.requests import Kind

log = logging.getLogger("kvstrata.router.native_http")

# Bodies up to this size are read by the front and decided on its thread (proxy.py parses up to 1 MB
# on the event loop too); larger ones go to the Python app, which parses them in a thread.
FAST_BODY_BYTES = 1 << 20


def _internal_error() -> Answer:
    return answer(json_error(500, "internal router error (logged)", code="router_error"))


class _Adopted:
    """Awaits a coroutine that was started elsewhere and is suspended on ``pending`` (what it yielded):
    a task on the event loop then drives it on, as if it had run there from the start."""

    __slots__ = ("_coro", "_pending")

    def __init__(self, coro: Coroutine[Any, None, Plan], pending: Any) -> None:
        self._coro = coro
        self._pending = pending

    def __await__(self) -> Generator[Any, None, Plan]:
        coro, pending = self._coro, self._pending
        while True:
            try:
                yield pending
            except BaseException as exc:  # the task was cancelled: the coroutine hears of it
                try:
                    pending = coro.throw(exc)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                continue
            try:
                pending = coro.send(None)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]


class _StandIn:
    """The current task of a plan's first step, run on the front's thread: what asyncio (and aiohttp)
    ask of the current task when a timeout is armed. Were the step to wait, the task that adopts the
    plan takes its place, and a timeout armed meanwhile cancels that task. No timer can fire before
    (the event loop waits for the router lock)."""

    __slots__ = ("_loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.task: asyncio.Task[None] | None = None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def cancelling(self) -> int:
        return self.task.cancelling() if self.task is not None else 0

    def __getattr__(self, name: str) -> Any:
        if self.task is None:
            raise AttributeError(name)
        return getattr(self.task, name)


class NativeHttp:
    """The calls the native front makes, each under the router lock."""

    def __init__(self, proxy: Proxy, lock: RouterLock) -> None:
        self.proxy = proxy
        self.lock = lock
        self._waiting: dict[int, tuple[Any, asyncio.Task[None]]] = {}  # by id(reply)

    def begin(self, kind: Kind, path: str, body: bytes, session: str | None, reply: Any) -> Plan | None:
        """The plan for a request, or None: it comes later through ``reply.send``."""
        loop = self.lock.loop
        with self.lock.held():
            coro = self.proxy.plan(kind, path, body, session)
            standin = _StandIn(loop)
            _enter_task(loop, cast(asyncio.Task[None], standin))
            try:
                pending = coro.send(None)
            except StopIteration as done:
                plan: Plan = done.value
                return plan
            except Exception:
                log.exception("deciding a request failed")
                return _internal_error()
            finally:
                _leave_task(loop, cast(asyncio.Task[None], standin))
            task = loop.create_task(self._finish(_Adopted(coro, pending), reply))
            standin.task = task
            self._waiting[id(reply)] = (reply, task)
            return None

    async def _finish(self, plan: _Adopted, reply: Any) -> None:
        try:
            got: Plan = await plan
        except asyncio.CancelledError:
            return  # the client left (cancel); whatever the plan had taken, it gave back
        except Exception:
            log.exception("deciding a request failed")
            got = _internal_error()
        finally:
            self._waiting.pop(id(reply), None)
        reply.send(got)

    def cancel(self, reply: Any) -> None:
        """The client left while its plan was being made."""
        with self.lock.held():
            waiting = self._waiting.pop(id(reply), None)
            if waiting is not None:
                waiting[1].cancel()

    def undo(self, plan: Plan) -> None:
        """A plan made for a client that had left: give back what it took."""
        if isinstance(plan, Resume):
            self.abandon(plan.token)
        elif not isinstance(plan, Answer):
            self.done(plan.handle, Outcome.CLIENT_DISCONNECT.value, None)

    def first(self, nt: NativeTry) -> None:
        with self.lock.held():
            self.proxy.first_byte(nt)

    def heard(self, nt: NativeTry) -> None:
        with self.lock.held():
            self.proxy.heard(nt)

    def done(self, nt: NativeTry, outcome: str, body: bytes | None) -> None:
        with self.lock.held():
            self.proxy.done(nt, Outcome(outcome), body)

    def failed(self, nt: NativeTry, kind: str, detail: str) -> Resume:
        with self.lock.held():
            return self.proxy.failed(nt, FailureKind(kind), detail)

    def broke(self, nt: NativeTry, outcome: str, detail: str) -> Answer | bytes:
        with self.lock.held():
            return self.proxy.broke(nt, Outcome(outcome), detail)

    def abandon(self, token: str) -> None:
        with self.lock.held():
            self.proxy.abandon(token)

    def body_timeout(self) -> Answer:
        with self.lock.held():
            return self.proxy.body_timeout()

    def malformed(self, error: str) -> None:
        """The front refused a request it could not parse (``error``: as the Python app names it)."""
        self.proxy.metrics.malformed_http.labels(error).inc()


class NativeFront:
    """The front on ``host:port`` in a thread of its own, in front of the app served on ``loopback``."""

    def __init__(self, app: web.Application, settings: RouterSettings, host: str, port: int, loopback: int):
        proxy = app[PROXY_KEY]
        lock = RouterLock(asyncio.get_running_loop())
        s = settings
        self._front = kvstrata_native.Front(
            host,
            port,
            loopback,
            NativeHttp(proxy, lock),
            session_header=s.session_header,
            fast_body_bytes=min(FAST_BODY_BYTES, s.max_body_bytes),
            body_read_timeout=s.body_read_timeout_seconds,
            header_read_timeout=s.header_read_timeout_seconds,
            connect_timeout=s.connect_timeout_seconds,
            first_byte_timeout=s.first_byte_timeout_seconds,
            upstream_timeout=s.upstream_timeout_seconds,
            stream_idle_timeout=s.stream_idle_timeout_seconds,
            max_response_bytes=s.max_response_bytes,
            max_connections=s.max_upstream_connections,
        )
        self.port: int = self._front.port
        front = self._front
        # Cuts the front's waits on an ejected endpoint, as outlier.Waiter does Python's.
        proxy.outlier.ejection_listeners.append(lambda ep, kind: front.eject(ep.url))

        def serve() -> None:
            lock.enter_thread()
            try:
                front.serve()
            except BaseException:
                log.exception("the native HTTP front stopped")

        self._server_thread = threading.Thread(target=serve, name="kvstrata-native-http", daemon=True)
        self._server_thread.start()

    async def stop(self) -> None:
        self._front.stop()
        # Joined from a worker thread: the loop waits in select meanwhile, so the front's last calls
        # (requests in flight, dropped) can take the router lock.
        await asyncio.to_thread(self._server_thread.join)
