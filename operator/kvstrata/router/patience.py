"""How long a stream's last try waits for its first byte.

A first-byte timeout moves a request to the next-best engine. On the last engine it may try there is
nowhere to move it, and failing it would turn a busy engine (a long queue, a slow machine) into a
lost request. "Last" includes a try after which only engines that are ejected or silent (not heard
from within a first-byte period: wedged, not yet ejected) are left: moving on would only reach those.
So past each first-byte timeout the last try waits one period more, as long as its engine was heard
from within the period just gone (a scrape answered, or any request's stream moving: busy, not
wedged), up to the whole-request ``upstreamTimeoutSeconds``. A wedged engine says nothing and is let
go at its first-byte timeout as before; ejection cuts the wait sooner (router/outlier.py).

Seen in CI: with one of three engines SIGSTOPped and the other two slow on a loaded machine, a
stream's last try timed out on a healthy engine and the client got a 502. Seen in CI again with
scrapes alone as the sign of life: on that loaded machine the healthy engines' API servers missed the
1 s scrape deadline while they streamed tokens, and two last tries were let go.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvstrata.router.pool import Endpoint


@contextmanager
def last_try_patience(limit: asyncio.Timeout, ep: Endpoint, period: float, budget: float) -> Iterator[None]:
    """Drive ``limit`` (entered with no deadline) while the body runs."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + budget

    pending: list[asyncio.TimerHandle] = []

    def check() -> None:
        pending.clear()
        if limit.expired():
            return
        now = loop.time()
        if ep.heard_within(period, time.monotonic()) and now < end:
            pending.append(loop.call_at(min(now + period, end), check))
        else:
            limit.reschedule(now)

    pending.append(loop.call_at(min(start + period, end), check))
    try:
        yield
    finally:
        for handle in pending:
            handle.cancel()
