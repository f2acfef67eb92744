"""The event loop of a router whose HTTP path is native (router/native_http.py).

The native front calls the router's Python (decide, admit, end a try) on its own thread, while the
event loop runs the rest (KV events, scrapes, held requests, the Python app) on the main thread. Both
touch the same objects, which were written for one thread: so the loop holds :class:`RouterLock`'s lock
whenever it runs Python and lets it go only while it waits in ``select``, and the front takes it for
each call. A call therefore never sees the loop half-way through a callback, and the loop's callbacks
run as they did alone. The loop is asyncio's own (uvloop's selector cannot be wrapped).
"""

from __future__ import annotations

import asyncio
import selectors
import threading
from typing import Any


class _LockingSelector(selectors.DefaultSelector):
    """The loop's selector: the lock is the loop thread's except while it waits for I/O."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.lock.acquire()  # the thread that makes the loop runs it

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.lock.release()
        try:
            return super().select(timeout)
        finally:
            self.lock.acquire()


def new_loop() -> asyncio.AbstractEventLoop:
    """An event loop that :class:`RouterLock` can share (``asyncio.Runner(loop_factory=new_loop)``)."""
    return asyncio.SelectorEventLoop(_LockingSelector())


def shares_lock(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` came from :func:`new_loop`."""
    return isinstance(getattr(loop, "_selector", None), _LockingSelector)


class RouterLock:
    """Runs another thread's calls into the router as if they were callbacks of ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if not isinstance(loop, asyncio.SelectorEventLoop) or not shares_lock(loop):
            raise RuntimeError(
                "the native data plane needs the router's event loop from kvstrata.router.loop.new_loop"
            )
        selector: _LockingSelector = loop._selector  # type: ignore[attr-defined]
        self._lock = selector.lock
        self.loop = loop
        # asyncio's private queues: only their lengths are read, to wake the loop when a call scheduled
        # something (a future's callbacks, a timer) that its wait in select would otherwise sleep past.
        self._ready: Any = loop._ready  # type: ignore[attr-defined]
        self._scheduled: Any = loop._scheduled  # type: ignore[attr-defined]

    def enter_thread(self) -> None:
        """Makes ``loop`` the calling thread's running loop, for the router code that asks for it."""
        asyncio.events._set_running_loop(self.loop)

    def held(self) -> _Held:
        """The lock, for one call into the router (``with lock.held(): ...``)."""
        return _Held(self)


class _Held:
    """One call's hold of the router lock (a class, not a generator: it is taken twice per request)."""

    __slots__ = ("_first", "_ready", "_rl")

    def __init__(self, rl: RouterLock) -> None:
        self._rl = rl

    def __enter__(self) -> None:
        rl = self._rl
        rl._lock.acquire()
        self._ready = len(rl._ready)
        scheduled = rl._scheduled
        self._first = scheduled[0].when() if scheduled else None

    def __exit__(self, *exc: object) -> None:
        rl = self._rl
        try:
            # The loop sleeps until its earliest timer: wake it only for a callback to run now or a
            # timer earlier than that one (one that is later is run when the loop wakes for it).
            scheduled = rl._scheduled
            if len(rl._ready) != self._ready or (
                scheduled and (self._first is None or scheduled[0].when() < self._first)
            ):
                rl.loop._write_to_self()  # type: ignore[attr-defined]
        finally:
            rl._lock.release()
