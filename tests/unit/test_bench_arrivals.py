"""The router benchmark's open-loop arrivals: the seeded schedule (pure) and the client that keeps it."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from bench.client import run_conversations
from bench.workload import Conversation, arrivals
from helpers import serve


def test_arrivals_are_seeded_poisson_with_the_first_at_zero() -> None:
    plan = arrivals(2000, 3, rate=0.5, think_mean_s=2.0, seed=7)
    assert plan == arrivals(2000, 3, rate=0.5, think_mean_s=2.0, seed=7)
    assert plan != arrivals(2000, 3, rate=0.5, think_mean_s=2.0, seed=8)
    starts = [a.start_s for a in plan]
    assert starts[0] == 0.0 and starts == sorted(starts)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert sum(gaps) / len(gaps) == pytest.approx(2.0, rel=0.1)  # 1 / rate
    thinks = [t for a in plan for t in a.think_s]
    assert all(len(a.think_s) == 2 for a in plan)
    assert sum(thinks) / len(thinks) == pytest.approx(2.0, rel=0.1)


def test_arrivals_without_think_time_and_bad_rates() -> None:
    assert all(a.think_s == (0.0,) for a in arrivals(5, 2, rate=1.0, think_mean_s=0.0, seed=1))
    with pytest.raises(ValueError, match="arrival rate"):
        arrivals(5, 2, rate=0.0, think_mean_s=1.0, seed=1)
    with pytest.raises(ValueError, match="think time"):
        arrivals(5, 2, rate=1.0, think_mean_s=-1.0, seed=1)


@pytest.fixture
async def slow_engine() -> AsyncIterator[tuple[str, list[float]]]:
    """A stand-in engine that answers every completion after 0.4 s; records when each request came."""
    arrived: list[float] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        arrived.append(time.perf_counter())
        await asyncio.sleep(0.4)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner, port = await serve(app)
    try:
        yield f"http://127.0.0.1:{port}", arrived
    finally:
        await runner.cleanup()


CONVS = [Conversation(cid, 0, ("a", "a b")) for cid in range(3)]


async def test_open_loop_sends_on_schedule_whatever_is_in_flight(
    slow_engine: tuple[str, list[float]],
) -> None:
    url, arrived = slow_engine
    plan = arrivals(3, 2, rate=10.0, think_mean_s=0.0, seed=3)
    t0 = time.perf_counter()
    results = await run_conversations(url, "m", CONVS, 1, concurrency=1, schedule=plan)
    assert all(r.ok for r in results) and len(results) == 6
    # Concurrency 1 is ignored: all three first turns arrive before the first answer (0.4 s) is back.
    firsts = sorted(arrived)[:3]
    assert firsts[-1] - t0 < 0.4
    for r in results:
        if r.turn == 0:
            assert r.start_s == pytest.approx(plan[r.cid].start_s, abs=0.05)


async def test_closed_loop_holds_requests_to_the_concurrency(slow_engine: tuple[str, list[float]]) -> None:
    url, arrived = slow_engine
    t0 = time.perf_counter()
    results = await run_conversations(url, "m", CONVS, 1, concurrency=1)
    assert all(r.ok for r in results)
    gaps = [b - a for a, b in itertools.pairwise(sorted(arrived))]
    assert min(gaps) >= 0.35  # one at a time
    assert time.perf_counter() - t0 >= 6 * 0.4
