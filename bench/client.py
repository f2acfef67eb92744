"""The router benchmark's client: runs conversations turn by turn, either with bounded concurrency (closed
loop) or on a seeded arrival schedule (open loop), streaming each request and timing the first content
chunk (TTFT)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from bench.workload import Arrival, Conversation


@dataclass(frozen=True)
class Result:
    cid: int
    turn: int
    ok: bool
    ttft_s: float | None
    latency_s: float
    error: str | None = None
    start_s: float = 0.0  # when it was sent, from the start of the run
    # From the engine's final usage chunk: what this request really found cached (None if not reported).
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # The router's x-kvstrata-* answer headers without the prefix (engine, reason, admission, held-ms):
    # a slow request's wait split into held in the router and spent at the engine. Peers send none.
    router: dict[str, str] = field(default_factory=dict)

    @property
    def ttft_ms(self) -> float | None:
        return None if self.ttft_s is None else round(self.ttft_s * 1000, 1)

    def record(self) -> dict[str, Any]:
        """This request in a benchmark's JSON: which one it was, when it went, what it waited and found."""
        return {
            "cid": self.cid,
            "turn": self.turn,
            "start_s": round(self.start_s, 3),
            "ttft_ms": self.ttft_ms,
            "ok": self.ok,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            **({"router": self.router} if self.router else {}),
        }


@dataclass(frozen=True)
class Scripted:
    """A conversation as the client sends it: per turn, the API path and the body's input fields
    (``prompt`` for completions, ``messages`` for chat)."""

    cid: int
    requests: tuple[tuple[str, dict[str, Any]], ...]


_EXPLAIN = "x-kvstrata-"

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def completions(conv: Conversation) -> Scripted:
    return Scripted(conv.cid, tuple((COMPLETIONS, {"prompt": p}) for p in conv.prompts))


def _content(event: dict[str, Any]) -> str | None:
    choices = event.get("choices") or []
    if not choices:
        return None
    first = choices[0]
    text = first.get("text") or (first.get("delta") or {}).get("content")
    return text if isinstance(text, str) else None


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    request: tuple[str, dict[str, Any]],
    max_tokens: int,
    cid: int,
    turn: int,
) -> Result:
    """One streamed request; ``start_s`` is filled in by the caller."""
    path, fields = request
    body = {
        "model": model,
        **fields,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        # The final chunk then carries usage, with the prompt tokens the engine found cached.
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    ttft = None
    done = False
    usage: dict[str, Any] = {}
    try:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Result(
                    cid, turn, False, None, time.perf_counter() - start, f"HTTP {resp.status}: {text}"
                )
            explained = {
                k.lower().removeprefix(_EXPLAIN): v
                for k, v in resp.headers.items()
                if k.lower().startswith(_EXPLAIN)
            }
            # SSE: events are `data: ...` lines; routers may split or merge network chunks arbitrarily.
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if ttft is None and _content(event):
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    usage = event["usage"]
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return Result(
            cid, turn, False, ttft, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"[:200]
        )
    latency = time.perf_counter() - start
    if not done:
        return Result(cid, turn, False, ttft, latency, "stream ended without [DONE]")
    if ttft is None:
        return Result(cid, turn, False, None, latency, "no content chunk")
    details = usage.get("prompt_tokens_details") or {}
    return Result(
        cid,
        turn,
        True,
        ttft,
        latency,
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        router=explained,
    )


async def run_conversations(
    url: str,
    model: str,
    convs: Sequence[Conversation | Scripted],
    max_tokens: int,
    concurrency: int,
    timeout_s: float = 300.0,
    schedule: Sequence[Arrival] | None = None,
) -> list[Result]:
    """Each conversation sends its turns in order. Without a ``schedule`` at most ``concurrency`` requests
    are in flight and a turn goes as soon as a slot is free; with one, conversation i opens at
    ``schedule[i].start_s`` and each later turn goes its think time after the previous response ended,
    however many requests are in flight then."""
    if schedule is not None and len(schedule) < len(convs):
        raise ValueError(f"schedule has {len(schedule)} arrivals for {len(convs)} conversations")
    # An open loop must not cap requests in flight anywhere, the connection pool included.
    gate: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(concurrency) if schedule is None else contextlib.nullcontext()
    )
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency * 2 if schedule is None else 0)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()

        async def conversation(conv: Scripted, arrival: Arrival | None) -> None:
            if arrival is not None:
                await asyncio.sleep(max(0.0, t0 + arrival.start_s - time.perf_counter()))
            for turn, request in enumerate(conv.requests):
                if arrival is not None and turn:
                    await asyncio.sleep(arrival.think_s[turn - 1])
                async with gate:
                    sent = time.perf_counter() - t0
                    res = await _one(session, url, model, request, max_tokens, conv.cid, turn)
                    results.append(replace(res, start_s=sent))

        plan = list(schedule) if schedule is not None else [None] * len(convs)
        scripted = [c if isinstance(c, Scripted) else completions(c) for c in convs]
        await asyncio.gather(*(conversation(c, a) for c, a in zip(scripted, plan, strict=False)))
    return results
