"""How long a stream's last try waits for its first byte.

A first-byte timeout moves a request to the next-best engine. On the last engine it may try there is
nowhere to move it, and failing it would turn a busy engine (a long queue, a slow machine) into a
lost request. So past each first-byte timeout the last try waits one period more, as long as its
engine answered a metrics scrape within the period just gone (busy, not wedged), up to the
whole-request ``upstreamTimeoutSeconds``. A wedged engine answers no scrape and is let go at its
first-byte timeout as before; ejection cuts the wait sooner (router/outlier.py).

Seen in CI: with one of three engines SIGSTOPped and the other two slow on a loaded machine, a
stream's last try timed out on a healthy engine and the client got a 502.
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
        alive = ep.answered_at >= time.monotonic() - period
        if alive and now < end:
            pending.append(loop.call_at(min(now + period, end), check))
        else:
            limit.reschedule(now)

    pending.append(loop.call_at(min(start + period, end), check))
    try:
        yield
    finally:
        for handle in pending:
            handle.cancel()
