"""When a held request would start at its own engine, and when at another: the forecast behind
``admission.moveOnForecast`` (router/admission.py). Pure functions of what the router sees: the requests
it runs on each engine, their ``max_tokens``, when each sent its first byte, and each engine's recent
prefill and decode paces.

The steal and move rules before it decide on cost equality now (a steal) or on time already waited (rent
or buy); neither asks how long the wait at home has left. A follow-up moved by them found 8 % of its
prompt cached where the peers' same requests found 36 % (family benchmark, fifty-fourth session), and
keeping every follow-up home cost the tail: a move pays only when home's room is far off."""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvstrata.router.pool import Pace

__all__ = ["request_end", "seconds_with_evictions", "wait_for_room"]


def request_end(now: float, first_at: float, output: int, decode: Pace) -> float | None:
    """Monotonic time a running request ends: its first byte (``first_at``; 0 while it has none) plus
    its ``output`` tokens at the engine's decode pace, and never before ``now``. One still in prefill
    is counted as if its first byte came now: it ends no sooner. None before a decode pace is known."""
    seconds = decode.seconds_for(output)
    if seconds is None:
        return None
    return max((first_at if first_at > 0 else now) + seconds, now)


def wait_for_room(now: float, need: int, free: int, running: Iterable[tuple[float, int]]) -> float:
    """Seconds until ``need`` blocks fit in ``free`` as the ``running`` requests (end time, blocks each
    frees) end in order of their ends. A request larger than the pool starts once nothing runs (the
    engine takes it alone), so the wait ends at the last end at the latest."""
    if need <= free:
        return 0.0
    last = now
    for end, blocks in sorted(running):
        free += blocks
        last = end
        if need <= free:
            break
    return last - now


def seconds_with_evictions(pace: Pace, tokens: float, free_blocks: int, block_size: int) -> float | None:
    """Seconds ``tokens`` of prefill take at ``pace``, with the prefill of the cached blocks they evict
    beyond ``free_blocks`` (if asked for again: an upper bound, as rent or buy counts it). None before a
    prefill pace is known."""
    new_blocks = math.ceil(max(tokens, 0.0) / block_size)
    return pace.seconds_for(tokens + max(new_blocks - max(free_blocks, 0), 0) * block_size)
