"""Thread pools for tokenization and hashing, by prompt size, so that big prompts cannot starve short
ones (head-of-line blocking: two 4 MB prompts once held every other request for 13.5 s).

Prompts up to ``largePromptChars`` share the small pool. Larger ones go to a pool of their own with
one thread and at most ``largePromptQueue`` prompts running or waiting; past that the caller gets
:class:`PoolBusy` and routes on character blocks instead (a counted fallback), which costs only a
hash over the text.

Work no request waits for (the rest of a prompt routed on its leading blocks) has a thread of its own,
so a backlog of it never delays work a request does wait for; at most ``largePromptQueue`` such jobs
run or wait there.

The large-prompt thread runs at the lowest CPU priority of its class (nice 19): under contention a
4 MB prompt's second of tokenizing takes a small share of a core, and the event loop and the threads
of short requests the rest. Not the kernel's idle class (``SCHED_IDLE``): a thread there is preempted
by any wakeup and then waits for whole ticks, and this one holds the GIL between tokenizer calls, so
the event loop waited for a thread that could not run (`make bench-router-overhead`, beside-huge, with
the library's own pool off: p99 added 5.0 ms at idle, 2.8-2.9 ms at nice 19 and at normal priority;
the huge prompt 1.4-1.5 s against 1.2 s). The price of nice 19: under a router saturated by short
requests a large prompt advances slowly, holding its ``largePromptQueue`` slot, and further large
prompts route on character blocks instead. The background thread keeps normal priority: a follow-up
that needs a rest it has not hashed yet hashes it itself, and how often that would happen with the
rest starved (by engines sharing the router's cores, as in the family benchmark) is not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

# The background thread's name: work nothing waits for (tests tell it apart by this).
BACKGROUND_THREAD_NAME = "kvstrata-tok-bg"
_TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"
_LOWEST_NICE = 19


def tokenize_on_calling_threads() -> None:
    """Make the tokenizer library encode a call's pieces on the thread that calls it, one after another,
    instead of handing them to its own thread pool (``TOKENIZERS_PARALLELISM``, read at every call).

    Why: these pools decide which thread tokenizes what, and at what priority. The library's pool is a
    second scheduler beside them, with threads of its own at normal priority: a cold short prompt (a
    few pieces) handed its pieces to them and waited. Beside a 4 MB prompt in flight, short prompts
    were slower for it (`make bench-router-overhead`, beside-huge, five paired runs: p90 added 2.4-3.4
    -> 1.2-1.8 ms, p99 5.6-6.5 -> 4.7-5.2 ms). A long new stretch on a request's path now takes one
    core instead of two; a cold one is routed on its leading blocks anyway (core.Router._probe), and
    the overhead bench's cold and extending prompts up to 128K tokens were unchanged in a paired run.

    Call it before the router's threads start (``os.environ`` is the C environment, which is not safe
    to change while other threads read it)."""
    if os.environ.get(_TOKENIZERS_PARALLELISM) != "false":
        os.environ[_TOKENIZERS_PARALLELISM] = "false"


def _low_cpu_priority() -> None:
    """Give the calling thread the lowest priority of the normal class, nice 19 (a per-thread attribute
    on Linux; elsewhere, or where a sandbox refuses it, the thread keeps its priority: the pools still
    bound the work, only the scheduler does not help)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_NICE)
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
            1, thread_name_prefix="kvstrata-tok-large", initializer=_low_cpu_priority
        )
        self.background = ThreadPoolExecutor(1, thread_name_prefix=BACKGROUND_THREAD_NAME)
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
