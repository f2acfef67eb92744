"""No prompt may hold up another: a 4 MB prompt in flight (body read, JSON parsed, tokenized and hashed
off the event loop) does not delay a short request behind it. Asserted on completion order, not time."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path
from typing import Any

from aiohttp import web
from test_router_proxy import RouterFactory, completion, free_port, make_router

__all__ = ["make_router"]  # fixtures, used by name

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "while",
    "numbers",
    "123",
    "and",
    "4567",
    "follow",
    # Not ASCII: the pieces go through the tokenizer's whole pipeline, not the byte-level shortcut
    # (native/src/bytelevel.rs), so the huge prompt takes long enough for the order to show a hold-up.
    "naïve",
    "café",
]


def _huge_prompt(chars: int) -> str:
    rng = random.Random(1)
    base = " ".join(rng.choice(_WORDS) + rng.choice(("", "s", "ing", "ed")) for _ in range(40_000))
    return (base + "\n") * (chars // (len(base) + 1) + 1)


async def _router_before_a_fake_engine(make_router: RouterFactory) -> tuple[Any, web.AppRunner, list[int]]:
    """A router with the tiny model's tokenizer that takes 4 MB prompts, before a fake engine that takes
    4 MB bodies; the engine's runner (to clean up) and the sizes of the bodies it got."""
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    sizes: list[int] = []

    async def engine(request: web.Request) -> web.Response:
        sizes.append(len(await request.read()))
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", engine)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tok = str(ensure_tiny_model(default_tiny_model_dir()))
    h = await make_router([f"http://127.0.0.1:{port}"], tokenizer=tok, maxPromptChars=5_000_000)
    return h, runner, sizes


async def test_a_huge_prompt_does_not_hold_up_a_short_one(make_router: RouterFactory) -> None:
    h, runner, sizes = await _router_before_a_fake_engine(make_router)
    huge = _huge_prompt(4_000_000)
    done: list[str] = []

    async def send(name: str, prompt: str) -> None:
        status, _, _ = await h.post("/v1/completions", completion(prompt=prompt))
        assert status == 200
        done.append(name)

    big = asyncio.create_task(send("huge", huge))
    await asyncio.sleep(0.2)  # its body is in; it is being parsed or tokenized
    shorts = [await send(f"short-{i}", f"hello there number {i}") for i in range(3)]
    assert len(shorts) == 3
    await big
    assert done == ["short-0", "short-1", "short-2", "huge"]
    async with h.client.get(h.base + "/metrics") as resp:
        text = await resp.text()
    await runner.cleanup()
    # The huge prompt was tokenized for real (no character-block fallback) and reached the engine.
    assert "kvstrata_router_fallbacks_total{" not in text
    assert max(sizes) > 4_000_000


def _cpu_seconds_of_threads(prefix: str) -> float:
    """CPU time so far of this process's threads whose names start with ``prefix`` (Linux /proc)."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None:
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
            utime, stime = stat.rsplit(")", 1)[1].split()[11:13]
            total += int(utime) + int(stime)
    return total / os.sysconf("SC_CLK_TCK")


async def test_a_huge_prompt_leaves_the_tokenizer_to_short_ones(make_router: RouterFactory) -> None:
    """Short prompts cut into several pieces are encoded while a 4 MB prompt is being tokenized: each
    one is answered before the huge one. Seen before the fix (with the tokenizer library's own thread
    pool, which every thread of the process shared): the huge prompt went to that pool as one batch of
    ~4,000 pieces, and a short prompt's batch on the event loop queued behind all of it (the loop stood
    still 1.1-1.4 s, `make bench-router-overhead` beside-huge). The router's native encoder calls the
    tokenizer on the thread the router chose, which holds no pool or lock the short prompts need."""
    h, runner, _ = await _router_before_a_fake_engine(make_router)
    huge = _huge_prompt(4_000_000)
    before = _cpu_seconds_of_threads("kvstrata-tok-large")
    big = asyncio.create_task(h.post("/v1/completions", completion(prompt=huge)))
    # Until the large-prompt thread has worked a while: the huge prompt is being tokenized.
    while _cpu_seconds_of_threads("kvstrata-tok-large") < before + 0.05:
        assert not big.done()
        await asyncio.sleep(0.005)
    for i in range(3):
        # ~900 characters: tokenized on the event loop, in several pieces.
        words = " ".join(random.Random(i).choice(_WORDS) for _ in range(180))
        status, _, _ = await h.post("/v1/completions", completion(prompt=f"short {i}: {words}"))
        assert status == 200
        assert not big.done(), f"short {i} waited for the huge prompt"
    status, _, _ = await big
    await runner.cleanup()
    assert status == 200
