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
from collections.abc import Iterator
from contextlib import contextmanager
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

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            ready = len(self._ready)
            scheduled = self._scheduled
            first = scheduled[0].when() if scheduled else None
            try:
                yield
            finally:
                # The loop sleeps until its earliest timer: wake it only for a callback to run now or a
                # timer earlier than that one (one that is later is run when the loop wakes for it).
                if len(self._ready) != ready or (
                    scheduled and (first is None or scheduled[0].when() < first)
                ):
                    self.loop._write_to_self()  # type: ignore[attr-defined]
