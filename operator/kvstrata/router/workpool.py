"""Thread pools for tokenization and hashing, by prompt size, so that big prompts cannot starve short
ones (head-of-line blocking: two 4 MB prompts once held every other request for 13.5 s).

Prompts up to ``largePromptChars`` share the small pool. Larger ones go to a pool of their own with
one thread and at most ``largePromptQueue`` prompts running or waiting; past that the caller gets
:class:`PoolBusy` and routes on character blocks instead (a counted fallback), which costs only a
hash over the text.

Work no request waits for (the rest of a prompt routed on its leading blocks) has a thread of its own,
so a backlog of it never delays work a request does wait for; at most ``largePromptQueue`` such jobs
run or wait there.

The large-prompt thread runs at the kernel's idle priority (Linux ``SCHED_IDLE``): its CPU is what
nothing else in the pod wants, so a 4 MB prompt's second of tokenizing yields the core to the event
loop and the tokenizer threads of every short request the moment they wake. (At normal priority it
took a core beside them, and short prompts waited for the scheduler: `make bench-router-overhead`,
beside-huge, p99 added 8.3-9.4 ms; idle: 5.9-6.4 ms, the huge prompt itself 0.2-0.4 s slower.) The
price is that under a router saturated by short requests a large prompt advances slowly, holding its
``largePromptQueue`` slot, and further large prompts route on character blocks instead. The background
thread keeps normal priority: a follow-up that needs a rest it has not hashed yet hashes it itself,
and how often that would happen with the rest starved (by engines sharing the router's cores, as in
the family benchmark) is not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


def _idle_cpu_priority() -> None:
    """Put the calling thread at idle CPU priority (Linux; elsewhere, or where a sandbox refuses the
    call, it keeps its priority: the pools still bound the work, only the scheduler does not help)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread on Linux
    except (AttributeError, OSError) as exc:
        log.debug("large-prompt thread keeps its CPU priority: %s", exc)


class PoolBusy(Exception):
    pass


def _on_loop_when_done(fut: Future[Any], loop: asyncio.AbstractEventLoop, call: Callable[[], None]) -> None:
    """``call()`` on ``loop`` once ``fut`` ends (done, failed or cancelled), from whichever thread."""

    def done(_: Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
            loop.call_soon_threadsafe(call)

    fut.add_done_callback(done)


class WorkPools:
    def __init__(self, threads: int, large_chars: int, large_queue: int) -> None:
        self.small = ThreadPoolExecutor(threads, thread_name_prefix="kvstrata-tok")
        self.large = ThreadPoolExecutor(
            1, thread_name_prefix="kvstrata-tok-large", initializer=_idle_cpu_priority
        )
        self.background = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-tok-bg")
        self.large_chars = large_chars
        self.large_queue = large_queue
        self.large_pending = 0
        self.background_pending = 0

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        if size <= self.large_chars:
            return await loop.run_in_executor(self.small, fn, *args)
        if self.large_pending >= self.large_queue:
            raise PoolBusy(f"{self.large_pending} large prompts already tokenizing")
        self.large_pending += 1
        fut = self.large.submit(fn, *args)
        # Counted until the work really ends: a cancelled request does not stop its thread.
        _on_loop_when_done(fut, loop, self._release)
        return await asyncio.wrap_future(fut)

    def _release(self) -> None:
        self.large_pending -= 1

    def submit_background(self, fn: Callable[..., T], *args: Any) -> Future[T] | None:
        """``fn(*args)`` on the background thread (the future can be cancelled until it starts), or None
        when ``large_queue`` jobs already run or wait there. Call on the event loop."""
        if self.background_pending >= self.large_queue:
            return None
        self.background_pending += 1
        fut = self.background.submit(fn, *args)
        _on_loop_when_done(fut, asyncio.get_running_loop(), self._background_done)
        return fut

    def _background_done(self) -> None:
        self.background_pending -= 1

    def shutdown(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.large.shutdown(wait=False, cancel_futures=True)
        self.background.shutdown(wait=False, cancel_futures=True)
