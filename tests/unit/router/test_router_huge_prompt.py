"""No prompt may hold up another: a 4 MB prompt in flight (body read, JSON parsed, tokenized and hashed
off the event loop) does not delay a short request behind it. Asserted on completion order, not time."""

from __future__ import annotations

import asyncio
import random

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
]


def _huge_prompt(chars: int) -> str:
    rng = random.Random(1)
    base = " ".join(rng.choice(_WORDS) + rng.choice(("", "s", "ing", "ed")) for _ in range(40_000))
    return (base + "\n") * (chars // (len(base) + 1) + 1)


async def test_a_huge_prompt_does_not_hold_up_a_short_one(make_router: RouterFactory) -> None:
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    sizes: list[int] = []

    async def engine(request: web.Request) -> web.Response:
        sizes.append(len(await request.read()))
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application(client_max_size=64 << 20)  # a fake engine that takes 4 MB bodies
    app.router.add_post("/v1/completions", engine)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tok = str(ensure_tiny_model(default_tiny_model_dir()))
    h = await make_router([f"http://127.0.0.1:{port}"], tokenizer=tok, maxPromptChars=5_000_000)
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
