"""The router benchmark's client: runs conversations turn by turn with bounded concurrency, streaming each
request and timing the first content chunk (TTFT)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import aiohttp

from bench.workload import Conversation


@dataclass(frozen=True)
class Result:
    cid: int
    turn: int
    ok: bool
    ttft_s: float | None
    latency_s: float
    error: str | None = None
    start_s: float = 0.0  # when it was sent, from the start of the run


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int, cid: int, turn: int
) -> Result:
    """One streamed request; ``start_s`` is filled in by the caller."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    ttft = None
    done = False
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Result(
                    cid, turn, False, None, time.perf_counter() - start, f"HTTP {resp.status}: {text}"
                )
            # SSE: events are `data: ...` lines; routers may split or merge network chunks arbitrarily.
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                if ttft is None:
                    event = json.loads(data)
                    choices = event.get("choices") or []
                    if choices and choices[0].get("text"):
                        ttft = time.perf_counter() - start
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return Result(
            cid, turn, False, ttft, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"[:200]
        )
    latency = time.perf_counter() - start
    if not done:
        return Result(cid, turn, False, ttft, latency, "stream ended without [DONE]")
    if ttft is None:
        return Result(cid, turn, False, None, latency, "no content chunk")
    return Result(cid, turn, True, ttft, latency)


async def run_conversations(
    url: str,
    model: str,
    convs: Sequence[Conversation],
    max_tokens: int,
    concurrency: int,
    timeout_s: float = 300.0,
) -> list[Result]:
    """Each conversation sends its turns in order; at most `concurrency` requests are in flight."""
    gate = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()

        async def conversation(conv: Conversation) -> None:
            for turn, prompt in enumerate(conv.prompts):
                async with gate:
                    sent = time.perf_counter() - t0
                    res = await _one(session, url, model, prompt, max_tokens, conv.cid, turn)
                    results.append(replace(res, start_s=sent))

        await asyncio.gather(*(conversation(c) for c in convs))
    return results
