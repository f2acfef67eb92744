"""A shared-prefix completions workload: a few long "system prompts", each followed by short questions.

Requests that share a prefix can reuse its KV blocks, but only on the engine that already computed them:
this is the traffic where prefix-affinity routing and the prefix cache pay off. Prompts are built from
the tiny model's own tokenizer so each prefix is a known number of tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp


@dataclass(frozen=True)
class Request:
    group: int
    prompt: str


@dataclass
class Result:
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    endpoints: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0


def _words(rng: random.Random, n: int) -> str:
    onsets = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "n", "r", "s", "t", "l", "m", "ng"]
    return " ".join(
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(n)
    )


def _count_tokens(tokenizer_json: Path | None) -> Callable[[str], int]:
    if tokenizer_json is None:
        return lambda text: len(text) // 3
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return lambda text: len(tok.encode(text).ids)


def shared_prefix_requests(
    *,
    groups: int = 4,
    per_group: int = 8,
    prefix_tokens: int = 480,
    suffix_words: int = 12,
    seed: int = 7,
    tokenizer_json: Path | None = None,
) -> list[Request]:
    """`groups` prefixes of about `prefix_tokens` tokens, `per_group` questions each, interleaved the
    way concurrent users would send them (group order shuffled with a fixed seed)."""
    rng = random.Random(seed)
    count = _count_tokens(tokenizer_json)
    prefixes = []
    for g in range(groups):
        text = f"System prompt {g}. "
        while count(text) < prefix_tokens:
            text += _words(rng, 16) + ". "
        prefixes.append(text)
    reqs = [
        Request(g, f"{prefixes[g]}\nQuestion {i}: {_words(rng, suffix_words)}?\nAnswer:")
        for g in range(groups)
        for i in range(per_group)
    ]
    # Each group's first request goes first (cold), the rest interleaved: realistic and reproducible.
    firsts = [r for i, r in enumerate(reqs) if i % per_group == 0]
    rest = [r for i, r in enumerate(reqs) if i % per_group != 0]
    rng.shuffle(rest)
    return firsts + rest


def distinct_prompt(n: int) -> str:
    """Prompt n of a family that shares no prefix: distinct from the first token on, 530-700 tokens
    (~19 blocks of 32) with the tiny model's tokenizer."""
    return f"doc{n} " + " ".join(f"w{n}x{i}" for i in range(125))


def tier_revisit_requests(new: int = 40, revisits: tuple[int, ...] = (1, 8, 14)) -> list[Request]:
    """A working set larger than the engines' pools: `new` distinct prompts, each followed by revisits
    of the prompts sent `d` new prompts before it, for each d in `revisits`.

    A revisit finds its prompt in whichever tier still holds it, so the distances pick the tiers: with
    the tiered example (a 64-block pool ~ 3 prompts, a 24 MiB CPU tier ~ 5 prompts, an NVMe tier of
    many more) and two engines sharing the new prompts (about every other one each), d=1 is a pool hit,
    d=8 (~4 prompts later on its engine) has left the pool for the CPU tier, and d=14 (~7 on its engine)
    has left the CPU tier too and comes from the NVMe tier."""
    out = []
    for i in range(new):
        out.append(Request(i, distinct_prompt(i)))
        out += [Request(i - d, distinct_prompt(i - d)) for d in revisits if i >= d]
    return out


def progress(done: int, total: int, result: Result, width: int = 30) -> None:
    filled = int(width * done / max(1, total))
    bar = "#" * filled + "." * (width - filled)
    hit = f"{result.cached_tokens / result.prompt_tokens:5.1%}" if result.prompt_tokens else "  -  "
    sys.stderr.write(
        f"\r  [{bar}] {done}/{total} requests, {result.failed} failed, cached prompt tokens {hit}"
    )
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


async def run(
    base_url: str,
    model: str,
    requests: list[Request],
    *,
    concurrency: int = 4,
    max_tokens: int = 8,
    timeout: float = 300.0,
    show_progress: bool = True,
    result: Result | None = None,
) -> Result:
    """Send every request through `base_url` (the router) with `concurrency` in flight; never raises
    for a failed request, it is counted in the result with its error. Pass `result` to watch progress
    from another thread."""
    result = result if result is not None else Result()
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    done = 0
    started = time.monotonic()

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal done
        while True:
            try:
                req = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {"model": model, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0}
            try:
                async with http.post(f"{base_url}/v1/completions", json=body) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {text[:200]}")
                    data = json.loads(text)
                    usage = data.get("usage") or {}
                    result.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens += int(details.get("cached_tokens") or 0)
                    ep = resp.headers.get("x-kvstrata-endpoint", "?")
                    reason = resp.headers.get("x-kvstrata-reason", "?")
                    result.endpoints[ep] = result.endpoints.get(ep, 0) + 1
                    result.reasons[reason] = result.reasons.get(reason, 0) + 1
                    result.ok += 1
            except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as err:
                result.failed += 1
                result.errors.append(f"{type(err).__name__}: {err}")
            done += 1
            if show_progress:
                progress(done, len(requests), result)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    result.seconds = time.monotonic() - started
    return result
