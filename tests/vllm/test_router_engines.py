"""The router in front of three real vLLM CPU engines (tiny model, small KV cache, KV events on).

One module-scoped set of engines and one router process (`kvstrata router`, as deployed) serve every
test here; the engine-kill test runs last because it takes an engine away.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq

from kvstrata.router.events import BlockStored, decode_frames
from kvstrata.router.hashing import block_hashes
from kvstrata.router.prompts import LocalTokenizer
from kvstrata_dev.testing.engines import VllmEngine, free_port, start_engines, stop_all, wait_http

MODEL = "tiny"
BLOCK = 32
# Small enough that the workload below evicts, big enough for a few long prompts at once.
KV_BLOCKS = 160
VENV_BIN = Path(sys.executable).parent


@dataclass
class Stack:
    engines: list[VllmEngine]
    router_url: str
    router_proc: subprocess.Popen[bytes]
    router_log: Path
    tokenizer: LocalTokenizer
    model_dir: Path
    log_dir: Path

    def engine(self, url: str) -> VllmEngine:
        return next(e for e in self.engines if e.base_url == url)


@pytest.fixture(scope="module")
def stack(tiny_model: Path, vllm_py: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("router-engines")
    engines = start_engines(
        3,
        tiny_model,
        kv_events=True,
        kv_replay=True,
        log_dir=log_dir,
        block_size=BLOCK,
        num_gpu_blocks_override=KV_BLOCKS,
        max_model_len=2048,
        max_num_seqs=8,
        extra_args=["--enable-prompt-tokens-details"],
        timeout=900,
    )
    router_log = log_dir / "router.log"
    try:
        proc, url = start_router(engines, tiny_model, router_log)
    except BaseException:
        stop_all(engines)
        raise
    try:
        yield Stack(engines, url, proc, router_log, LocalTokenizer(tiny_model), tiny_model, log_dir)
    finally:
        stop_router(proc)
        stop_all(engines)


def start_router(
    engines: list[VllmEngine], tiny_model: Path, log_path: Path, settings: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`kvstrata router` as deployed (a process of its own), in front of ``engines``; waits for /ready.
    ``settings`` are RouterSettings fields by env name (``FIRST_BYTE_TIMEOUT_SECONDS``: ``"6"``)."""
    port = free_port()
    argv = [
        str(VENV_BIN / "kvstrata"),
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--tokenizer",
        str(tiny_model),
        "--block-size",
        str(BLOCK),
        "--log-level",
        "DEBUG",
    ]
    for e in engines:
        argv += ["--endpoint", f"{e.base_url},events={e.kv_events_endpoint},replay={e.kv_replay_endpoint}"]
    with open(log_path, "wb") as log:
        env = {**os.environ, **{f"KVSTRATA_ROUTER_{k}": v for k, v in (settings or {}).items()}}
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", 60)
    except BaseException:
        stop_router(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- helpers -----------------------------------------------------------------------------------------
_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "sigma",
    "omega",
]


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) + str(rng.randint(0, 99)) for _ in range(words))


async def post(
    session: aiohttp.ClientSession, base: str, path: str, body: dict[str, Any]
) -> tuple[int, dict[str, str], Any]:
    async with session.post(base + path, json=body) as resp:
        raw = await resp.read()
        return resp.status, dict(resp.headers), json.loads(raw) if raw else None


async def turn_of(session: aiohttp.ClientSession, base: str, prompt: list[int]) -> tuple[dict[str, str], Any]:
    """One turn of a token-id conversation (8 tokens answered): its headers and body."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    status, headers, resp = await post(session, base, "/v1/completions", body)
    assert status == 200, resp
    return headers, resp


def engine_counter(engine: VllmEngine, name: str) -> float:
    total = 0.0
    for line in engine.metrics().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def router_state(stack: Stack, url: str | None = None) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen((url or stack.router_url) + "/kvstrata/state", timeout=5) as resp:
        return json.loads(resp.read())


def reserved_blocks(stack: Stack, url: str, wait_s: float) -> int:
    """Blocks the router keeps for follow-ups, on every engine; polled up to ``wait_s`` for a positive
    count (the room is kept as the answer ends)."""
    deadline = time.monotonic() + wait_s
    while True:
        kept = sum(ep["reservedBlocks"] for ep in router_state(stack, url)["endpoints"].values())
        if kept > 0 or time.monotonic() >= deadline:
            return int(kept)
        time.sleep(0.05)


def router_metric(stack: Stack, name: str, url: str | None = None) -> float:
    import urllib.request

    with urllib.request.urlopen((url or stack.router_url) + "/metrics", timeout=5) as resp:
        text_ = resp.read().decode()
    total = 0.0
    for line in text_.splitlines():
        if re.match(rf"^{re.escape(name)}(\{{| )", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


class EventTap:
    """A test-side SUB on every engine's KV events: what each engine says it stored."""

    def __init__(self, engines: list[VllmEngine]) -> None:
        self.ctx = zmq.Context()
        self.socks = {}
        for e in engines:
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(e.kv_events_endpoint)
            self.socks[e.base_url] = s
        time.sleep(1.0)  # ZMQ slow joiner

    def stored(self, url: str, wait_s: float = 5.0) -> set[int]:
        out: set[int] = set()
        sock = self.socks[url]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if sock.poll(200):
                batch = decode_frames(sock.recv_multipart())
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        out |= set(ev.block_hashes)
        return out

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)
        self.ctx.term()


# --- tests -------------------------------------------------------------------------------------------
def test_the_router_knows_each_engine_pool_size(stack: Stack) -> None:
    """The fit scorer's pool sizes are the engines' own num_gpu_blocks, read from their metrics."""
    for e in stack.engines:
        pool = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', e.metrics())
        assert pool, "the engine no longer exports num_gpu_blocks in vllm:cache_config_info"
        name = f'kvstrata_router_endpoint_kv_blocks{{endpoint="{e.base_url}"}}'
        deadline = time.monotonic() + 10  # scraped every second
        while router_metric(stack, name) == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert router_metric(stack, name) == int(pool.group(1)) > 0


def test_local_tokenization_matches_the_engine(stack: Stack) -> None:
    eng = stack.engines[0]
    prompt = text(1, 120)
    assert (
        stack.tokenizer.encode_completion(prompt)
        == eng.post_json("/tokenize", {"model": MODEL, "prompt": prompt})["tokens"]
    )
    messages = [{"role": "system", "content": text(2, 40)}, {"role": "user", "content": text(3, 60)}]
    engine_chat = eng.post_json("/tokenize", {"model": MODEL, "messages": messages})["tokens"]
    assert stack.tokenizer.encode_chat(messages) == engine_chat


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_router_hashes_equal_the_engines_block_stored(stack: Stack, kind: str) -> None:
    tap = EventTap(stack.engines)
    try:
        if kind == "completion":
            prompt = text(10, 300)
            tokens = stack.tokenizer.encode_completion(prompt)
            path, body = "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        else:
            messages = [
                {"role": "system", "content": text(11, 150)},
                {"role": "user", "content": text(12, 150)},
            ]
            tokens = stack.tokenizer.encode_chat(messages)
            path, body = "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}
        want = block_hashes(tokens, BLOCK)
        assert len(want) >= 10
        async with aiohttp.ClientSession() as s:
            status, headers, _ = await post(s, stack.router_url, path, body)
            assert status == 200
            chosen = headers["x-kvstrata-endpoint"]
            stored = await asyncio.to_thread(tap.stored, chosen)
            # Every full prompt block the router hashed is a block the engine stored, same 64-bit value.
            assert set(want) <= stored, f"{len(set(want) - stored)} of {len(want)} router hashes not stored"
            # Asked again, the router predicts exactly what the engine then reports as cached.
            status, headers, resp = await post(s, stack.router_url, path, body)
        assert status == 200
        assert headers["x-kvstrata-endpoint"] == chosen
        assert headers["x-kvstrata-reason"] == "prefix"
        predicted = int(headers["x-kvstrata-predicted-cached-tokens"])
        # vLLM recomputes a prompt's last token, so an exactly block-aligned prompt hits one block less.
        assert predicted == min(len(want) * BLOCK, (len(tokens) - 1) // BLOCK * BLOCK)
        assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
    finally:
        tap.close()


async def test_shared_prefixes_land_on_the_engine_that_holds_them(stack: Stack) -> None:
    groups, per_group = 6, 4
    prefix_words = 350  # ~ 25 blocks of shared prefix per group
    before = {e.base_url: engine_counter(e, "vllm:prefix_cache_hits_total") for e in stack.engines}
    queries_before = {e.base_url: engine_counter(e, "vllm:prefix_cache_queries_total") for e in stack.engines}
    routes: dict[int, list[tuple[str, str]]] = {}
    async with aiohttp.ClientSession() as s:
        for g in range(groups):
            shared = text(1000 + g, prefix_words)
            for i in range(per_group):
                body = {"model": MODEL, "prompt": shared + " " + text(2000 + g * 10 + i, 20), "max_tokens": 2}
                status, headers, _ = await post(s, stack.router_url, "/v1/completions", body)
                assert status == 200
                routes.setdefault(g, []).append(
                    (headers["x-kvstrata-endpoint"], headers["x-kvstrata-reason"])
                )
    for g, rs in routes.items():
        first = rs[0][0]
        assert all(url == first for url, _ in rs), f"group {g} split across engines: {rs}"
        assert all(reason == "prefix" for _, reason in rs[1:]), rs
    # Groups spread over the engines (first requests of a group tie and are hashed apart).
    assert len({rs[0][0] for rs in routes.values()}) >= 2
    hits = {
        e.base_url: engine_counter(e, "vllm:prefix_cache_hits_total") - before[e.base_url]
        for e in stack.engines
    }
    queries = {
        e.base_url: engine_counter(e, "vllm:prefix_cache_queries_total") - queries_before[e.base_url]
        for e in stack.engines
    }
    shared_tokens = min(
        len(stack.tokenizer.encode_completion(text(1000 + g, prefix_words))) for g in range(groups)
    )
    expected_min_hits = groups * (per_group - 1) * (shared_tokens // BLOCK) * BLOCK
    total_hits, total_queries = sum(hits.values()), sum(queries.values())
    assert total_hits >= expected_min_hits
    for rs in routes.values():
        assert hits[rs[0][0]] > 0
    print(
        f"\n[router-engines] shared-prefix hit rate {total_hits / total_queries:.3f} "
        f"({total_hits:.0f}/{total_queries:.0f} prompt tokens); per engine hits {hits}"
    )


async def test_a_new_router_learns_what_engines_hold_through_replay(stack: Stack) -> None:
    """A router that starts after the traffic knows the engines' caches from their replay buffers."""
    proc, url = await asyncio.to_thread(
        start_router, stack.engines, stack.model_dir, stack.log_dir / "router-2.log"
    )
    try:
        # The start-up replays run concurrently; each is counted once its end marker arrives.
        for _ in range(200):
            replays = router_metric(stack, "kvstrata_router_kv_event_replays_total", url)
            if replays >= len(stack.engines):
                break
            await asyncio.sleep(0.1)
        assert replays >= len(stack.engines)
        state = router_state(stack, url)
        assert router_metric(stack, "kvstrata_router_kv_event_gaps_total", url) == 0
        assert all(e["indexedBlocks"] > 0 for e in state["endpoints"].values()), state
        # Its very first request already finds the cached prefix (no prediction, no traffic of its own).
        prompt = text(1000, 350) + " " + text(7777, 20)  # group 0's shared prefix, a new suffix
        async with aiohttp.ClientSession() as s:
            status, headers, resp = await post(
                s, url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            )
        assert status == 200 and headers["x-kvstrata-reason"] == "prefix", headers
        predicted = int(headers["x-kvstrata-predicted-cached-tokens"])
        assert predicted > 0
        assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] >= predicted
        print(
            f"\n[router-engines] fresh router: indexed blocks from replay "
            f"{ {u: e['indexedBlocks'] for u, e in state['endpoints'].items()} }, first request predicted "
            f"{predicted} cached tokens, engine reported {resp['usage']['prompt_tokens_details']['cached_tokens']}"
        )
    finally:
        await asyncio.to_thread(stop_router, proc)
    assert "Traceback" not in (stack.log_dir / "router-2.log").read_text()


async def test_a_burst_larger_than_the_pools_waits_in_the_router_not_in_preemption(stack: Stack) -> None:
    """Twelve 1,800-token prompts at once on pools of 160 blocks: more than the engines can run
    together. The router holds what does not fit (router/admission.py) and sends it when room frees;
    every request is answered, no engine preempts, and nothing stays claimed or held afterwards."""
    rng = random.Random(7)
    shared = [rng.randrange(100, 4000) for _ in range(10 * BLOCK)]  # one tenant's system prompt
    bodies = [
        {"model": MODEL, "prompt": shared + [rng.randrange(100, 4000) for _ in range(1500)], "max_tokens": 4}
        for _ in range(12)
    ]
    preempted = sum(engine_counter(e, "vllm:num_preemptions_total") for e in stack.engines)
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(post(s, stack.router_url, "/v1/completions", b) for b in bodies))
    assert [status for status, _, _ in answers] == [200] * len(bodies)
    how = Counter(headers["x-kvstrata-admission"] for _, headers, _ in answers)
    held_ms = sorted(int(headers["x-kvstrata-held-ms"]) for _, headers, _ in answers)
    print(f"\n[router-engines] burst admission {dict(how)}, held ms {held_ms}")
    assert sum(how[h] for h in ("queued", "overdue", "stolen", "moved", "expired")) >= 1, how
    if not how["expired"]:  # a request held past maxHoldSeconds goes to the engine's own queue
        after = sum(engine_counter(e, "vllm:num_preemptions_total") for e in stack.engines)
        assert after == preempted, "an engine preempted although the router held what did not fit"
    state = await asyncio.to_thread(router_state, stack)
    assert state["heldRequests"] == 0
    assert all(ep["admittedBlocks"] == 0 for ep in state["endpoints"].values()), state["endpoints"]


async def test_a_conversation_followed_at_once_finds_its_room_kept(stack: Stack) -> None:
    """Anticipation (admission.anticipateSeconds): a conversation whose turns follow each other at once
    teaches the router so; when a turn ends, its blocks' room stays kept on its engine and the next turn
    takes it (``reserved``), hitting the cache of the turn before. Token-id prompts, so each turn extends
    the previous one exactly as a chat's next turn would."""
    log = stack.log_dir / "router-anticipate.log"
    proc, url = await asyncio.to_thread(
        start_router,
        stack.engines,
        stack.model_dir,
        log,
        {"ADMISSION": '{"anticipateSeconds": 2.0, "anticipateOnlyEvicted": false}'},
    )
    rng = random.Random(11)
    prompt = [rng.randrange(100, 4000) for _ in range(12 * BLOCK)]
    answers = []
    try:
        async with aiohttp.ClientSession() as s:
            for _turn in range(3):
                headers, resp = await turn_of(s, url, prompt)
                answers.append((len(prompt), headers, resp))
                # The next turn, sent the moment the answer is in: this prompt and two blocks more (what
                # an agent appends: the answer, a tool's result).
                prompt = prompt + [rng.randrange(100, 4000) for _ in range(2 * BLOCK)]
        how = [h["x-kvstrata-admission"] for _, h, _ in answers]
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for _, _, r in answers]
        print(f"\n[router-engines] anticipation: admissions {how}, cached tokens {cached}")
        # Turn 1 is new and ends before anything has followed it; turn 2 follows it in time (the group
        # is learnt), so turn 2's end keeps room for turn 3, which takes it.
        assert how[0] == "direct" and how[2] == "reserved", how
        previous_full_blocks = answers[1][0] // BLOCK
        assert cached[2] >= previous_full_blocks * BLOCK, (cached, previous_full_blocks)
        assert {h["x-kvstrata-endpoint"] for _, h, _ in answers[1:]} == {answers[0][1]["x-kvstrata-endpoint"]}
        # The last turn's room is given back when its window ends unused.
        assert await asyncio.to_thread(reserved_blocks, stack, url, wait_s=0) > 0
        await asyncio.sleep(2.5)
        assert await asyncio.to_thread(reserved_blocks, stack, url, wait_s=0) == 0
    finally:
        await asyncio.to_thread(stop_router, proc)
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("evicted", [False, True], ids=["blocks-kept", "blocks-evicted"])
async def test_only_turns_that_lose_their_blocks_get_a_room_kept(stack: Stack, evicted: bool) -> None:
    """``anticipateOnlyEvicted``: a conversation followed at once keeps a room only once a follow-up
    found the blocks of the turn before evicted. Here prompts sent straight to the engine between turns
    1 and 2 evict turn 1's blocks (the router learns it from the engine's BlockRemoved events); without
    them turn 2 finds its blocks and no room is kept."""
    log = stack.log_dir / f"router-anticipate-evicted-{evicted}.log"
    # The window spans the flood below: three 1,920-token prefills, over 6 s on a slow CPU engine in
    # float32 (a 5 s window failed there: turn 2 came too late to count as a follow-up at all).
    settings = {"ADMISSION": '{"anticipateSeconds": 30.0, "anticipateOnlyEvicted": true}'}
    proc, url = await asyncio.to_thread(start_router, stack.engines, stack.model_dir, log, settings)
    rng = random.Random(13 if evicted else 17)
    prompt = [rng.randrange(100, 4000) for _ in range(20 * BLOCK)]
    how = []
    try:
        async with aiohttp.ClientSession() as s:
            for turn in range(3):
                headers, _ = await turn_of(s, url, prompt)
                how.append(headers["x-kvstrata-admission"])
                if turn == 0 and evicted:
                    # More distinct blocks than the pool holds, straight to turn 1's engine: its blocks
                    # (free since turn 1 ended, the least recently used) are evicted.
                    for _ in range(3):
                        flood = [rng.randrange(100, 4000) for _ in range(60 * BLOCK)]
                        body = {"model": MODEL, "prompt": flood, "max_tokens": 1}
                        status, _, resp = await post(
                            s, headers["x-kvstrata-endpoint"], "/v1/completions", body
                        )
                        assert status == 200, resp
                    await asyncio.sleep(0.5)  # the engine's BlockRemoved events reach the router
                if turn == 1:
                    kept = await asyncio.to_thread(reserved_blocks, stack, url, wait_s=1.0 if evicted else 0)
                prompt = prompt + [rng.randrange(100, 4000) for _ in range(2 * BLOCK)]
        print(
            f"\n[router-engines] anticipation only where evicted ({evicted}): admissions {how}, kept {kept}"
        )
        if evicted:
            assert kept > 0 and how[2] == "reserved", (how, kept)
        else:
            assert kept == 0 and how[2] == "direct", (how, kept)
    finally:
        await asyncio.to_thread(stop_router, proc)
    assert "Traceback" not in log.read_text()


async def _one(
    s: aiohttp.ClientSession, base: str, prompt: str, stream: bool, out: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One request; ``out`` is filled in as it goes, so the caller can watch streams progress."""
    # Streams are long so that one is surely mid-way when its engine is killed.
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 400 if stream else 32,
        "stream": stream,
        "ignore_eos": True,
    }
    out = out if out is not None else {}
    out.update({"stream": stream, "chunks": 0, "error": None, "done": False, "endpoint": None})
    try:
        async with s.post(base + "/v1/completions", json=body) as resp:
            out["status"] = resp.status
            out["endpoint"] = resp.headers.get("x-kvstrata-endpoint")
            if not stream:
                data = await resp.json()
                out["done"] = resp.status == 200 and bool(data.get("choices"))
                return out
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    out["done"] = True
                elif b'"error"' in payload:
                    out["error"] = json.loads(payload)["error"]
                else:
                    out["chunks"] += 1
    except aiohttp.ClientError as exc:
        out["error"] = repr(exc)
    return out


async def test_a_streamed_request_teaches_the_router_its_engines_prefill_pace(stack: Stack) -> None:
    """The first streamed token of a cold prompt is a sample of how fast its engine prefills: the pace a
    held request's move elsewhere is weighed at (router/admission.py)."""
    async with aiohttp.ClientSession() as s:
        out = await _one(s, stack.router_url, text(77_000, 300), stream=True)
    assert out["done"] and out["endpoint"], out
    pace = (await asyncio.to_thread(router_state, stack))["endpoints"][out["endpoint"]][
        "prefillSecondsPer1kTokens"
    ]
    print(f"\n[router-engines] prefill pace at {out['endpoint']}: {pace} s per 1k tokens")
    assert pace is not None and pace > 0


# Short deadlines so the wedge shows within the test's time (defaults are 60 s / 10 s).
FIRST_BYTE_S = 6.0
SLACK_S = 3.0
WEDGE_SETTINGS = {
    "FIRST_BYTE_TIMEOUT_SECONDS": str(FIRST_BYTE_S),
    "STREAM_IDLE_TIMEOUT_SECONDS": str(FIRST_BYTE_S),
    "SCRAPE_TIMEOUT_SECONDS": "1",
    "EJECTION_CONSECUTIVE_FAILURES": "2",
    "EJECTION_BASE_SECONDS": "5",
}


async def _timed(s: aiohttp.ClientSession, base: str, prompt: str, stream: bool) -> dict[str, Any]:
    """One request, with the client's wait until its first byte (streams) or its answer."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": stream}
    out: dict[str, Any] = {"stream": stream, "sent": time.monotonic(), "wait": None, "chunks": 0}
    out.update({"done": False, "error": None, "endpoint": None})
    try:
        async with s.post(base + "/v1/completions", json=body) as resp:
            out["status"], out["endpoint"] = resp.status, resp.headers.get("x-kvstrata-endpoint")
            out["attempts"] = int(resp.headers.get("x-kvstrata-attempts", "0"))
            out["upstream_s"] = int(resp.headers.get("x-kvstrata-upstream-ms", "0")) / 1000
            if not stream:
                data = await resp.json()
                out["wait"] = time.monotonic() - out["sent"]
                out["done"] = resp.status == 200 and bool(data.get("choices"))
                out["usage"] = data.get("usage")
                return out
            async for line in resp.content:
                payload = line.removeprefix(b"data: ").strip()
                if not line.startswith(b"data: "):
                    continue
                if out["wait"] is None:
                    out["wait"] = time.monotonic() - out["sent"]
                if payload == b"[DONE]":
                    out["done"] = True
                elif b'"error"' in payload:
                    out["error"] = json.loads(payload)["error"]
                else:
                    out["chunks"] += 1
    except aiohttp.ClientError as exc:
        out["error"] = repr(exc)
    return out


def _unfinished_stream_on(r: dict[str, Any], url: str) -> bool:
    return bool(r.get("stream") and r.get("endpoint") == url and r.get("chunks", 0) > 0 and not r.get("done"))


async def _settled(
    results: list[dict[str, Any]], url: str, quiet_s: float = 0.5, timeout_s: float = 10.0
) -> None:
    """Wait until no stream from ``url`` has read anything for ``quiet_s``: what that frozen engine had
    sent is read."""
    seen = None
    quiet_since = time.monotonic()
    deadline = quiet_since + timeout_s
    while time.monotonic() < deadline:
        now = [(r.get("chunks"), r.get("done")) for r in results if r.get("endpoint") == url]
        if now != seen:
            seen, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        await asyncio.sleep(0.05)


def _why(failed: list[dict[str, Any]], router_log: Path, stopped_at: float) -> str:
    """What a failed request got, and what the router logged: enough to tell a fault from CI's log."""
    keys = ("stream", "status", "attempts", "endpoint", "error")
    seen = "\n".join(f"+{r['sent'] - stopped_at:.1f}s " + repr({k: r.get(k) for k in keys}) for r in failed)
    lines = [ln for ln in router_log.read_text().splitlines() if "WARNING" in ln or "ERROR" in ln]
    return seen + "\nrouter warnings:\n" + "\n".join(lines[-30:])


async def _wait_state(
    stack: Stack, router: str, victim: str, ejected: bool, timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        ep = (await asyncio.to_thread(router_state, stack, router))["endpoints"][victim]
        if ep["ejected"] is ejected or time.monotonic() > deadline:
            return ep  # type: ignore[no-any-return]
        await asyncio.sleep(0.5)


async def test_a_wedged_engine_is_ejected_and_comes_back(stack: Stack) -> None:
    """SIGSTOP one engine's process group mid-workload (wedged, not dead): no request waits longer
    than the first-byte timeout plus one retry, the engine is ejected, and after SIGCONT it is back
    in rotation with its cache."""
    proc, url = await asyncio.to_thread(
        start_router, stack.engines, stack.model_dir, stack.log_dir / "router-wedge.log", WEDGE_SETTINGS
    )
    groups = [text(30_000 + g, 200) for g in range(6)]
    stopped: VllmEngine | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            homes = {}
            for g, shared in enumerate(groups):
                r = await _timed(s, url, shared + " " + text(31_000 + g, 10), stream=False)
                assert r["done"], r
                homes[g] = r["endpoint"]
            victim_url = homes[0]
            victim = stack.engine(victim_url)
            results: list[dict[str, Any]] = []
            stop_workers = asyncio.Event()

            async def worker(w: int) -> None:
                i = 0
                while not stop_workers.is_set():
                    prompt = groups[(w + i) % len(groups)] + " " + text(40_000 + 100 * w + i, 10)
                    results.append(await _timed(s, url, prompt, stream=(w + i) % 3 != 0))
                    i += 1

            workers = [asyncio.create_task(worker(w)) for w in range(6)]
            await asyncio.sleep(4)
            os.killpg(victim.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            stopped = victim
            stopped_at = time.monotonic()
            ejected = await _wait_state(stack, url, victim_url, True, 30)
            await asyncio.sleep(max(0.0, 20 - (time.monotonic() - stopped_at)))
            stop_workers.set()
            await asyncio.gather(*workers)
            os.killpg(victim.pid, signal.SIGCONT)  # type: ignore[arg-type]
            stopped = None
            resumed_at = time.monotonic()
            back = await _wait_state(stack, url, victim_url, False, 90)
            returned_after = time.monotonic() - resumed_at
            # Back in rotation: requests reach it again, and cached prefixes are hit again.
            after = []
            for g, shared in enumerate(groups):
                after.append(await _timed(s, url, shared + " " + text(50_000 + g, 10), stream=False))
            fresh = []
            for i in range(12):
                fresh.append(await _timed(s, url, text(60_000 + i, 200), stream=False))
                if fresh[-1]["endpoint"] == victim_url:
                    break
    finally:
        if stopped is not None:
            os.killpg(stopped.pid, signal.SIGCONT)  # type: ignore[arg-type]
        await asyncio.to_thread(stop_router, proc)
    during = [r for r in results if r["sent"] >= stopped_at]
    assert during, "no request was sent while the engine was stopped"
    failed = [r for r in during if not r["done"]]
    assert not failed, _why(failed, stack.log_dir / "router-wedge.log", stopped_at)
    assert all(r["endpoint"] != victim_url for r in during)
    # No request waits on the stopped engine longer than one first-byte timeout (less when ejection
    # cuts the wait), then it is retried. The retry recomputes the prefix the stopped engine held, as
    # slowly as the machine makes it, and on a loaded machine a healthy engine can itself miss the
    # (short, 6 s) first-byte timeout and pass the request on once more. The router reports the
    # answering engine's time; what remains is what failover cost: one first-byte timeout at most
    # per engine the request left.
    # SLACK_S is the rest of a client's wait: the router's own work and the test client's, both on a
    # machine whose cores three engines share (seen: 1-2 s with two CPU hogs added).
    lost = [(r["wait"] - r["upstream_s"], r["attempts"]) for r in during]
    over = sorted(lost, key=lambda tn: tn[0] - (tn[1] - 1) * FIRST_BYTE_S)
    assert all(t <= (n - 1) * FIRST_BYTE_S + SLACK_S for t, n in lost), over[-5:]
    # Failover was exercised: requests waiting on the engine when it stopped (sent before, no first
    # byte yet), or sent to it before it was ejected, were retried elsewhere. Which of the two happens
    # depends on timing (on a loaded machine the ejection can come before any new request picks it).
    retried = [r for r in results if r["done"] and r.get("attempts", 0) > 1]
    assert retried, "no request was retried off the stopped engine"
    slowest = max(t for t, _ in lost)
    # Before the stop: only streams that had started on the victim may fail (cut by the idle timeout).
    for r in results:
        if not r["done"]:
            assert r["stream"] and r["chunks"] > 0 and r["endpoint"] == victim_url, r
            assert r["error"]["code"] == "upstream_idle_timeout", r
    assert ejected["ejected"] and ejected["ejectionReason"] in (
        "first_byte_timeout",
        "scrape_timeout",
        "ejected",
    )
    assert not back["ejected"] and back["ejections"] >= 1
    assert all(r["done"] for r in after + fresh)
    assert any(r["endpoint"] == victim_url for r in after + fresh), "the engine never came back into rotation"
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in after)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in after)
    assert cached / prompt_tokens > 0.5  # the hit rate recovers
    log = (stack.log_dir / "router-wedge.log").read_text()
    assert "Traceback" not in log
    # The module's own router (default deadlines) also took the victim out on its scrapes; let it
    # return before the kill test picks its victim.
    await _wait_state(stack, stack.router_url, victim_url, False, 120)
    print(
        f"\n[router-engines] wedge: SIGSTOP {victim_url} during {len(results)} requests; {len(during)} sent "
        f"while stopped, {sum(r['attempts'] > 1 for r in during)} of them retried ({sum(r['attempts'] > 2 for r in during)} twice), "
        f"{len(retried)} retried in all; at "
        f"most {slowest:.1f}s lost to failover "
        f"(first-byte timeout {FIRST_BYTE_S:g}s), slowest wait {max(r['wait'] for r in during):.1f}s; ejected for "
        f"{ejected['ejectionReason']}; back {returned_after:.1f}s after SIGCONT; hit rate after "
        f"{cached / prompt_tokens:.2f}"
    )


async def test_killing_an_engine_loses_no_request_that_had_not_started_streaming(stack: Stack) -> None:
    n = 24
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        tasks = [
            asyncio.create_task(_one(s, stack.router_url, text(5000 + i, 150), i % 2 == 0, results[i]))
            for i in range(n)
        ]
        # Kill the engine of the first stream that has started, while requests are queued everywhere.
        # A started stream can end before the kill lands: its engine runs ahead of this client, whose
        # view lags on a loaded machine (a CI run once found no stream left to cut). So the engine is
        # frozen first (SIGSTOP) and killed only if a stream that started on it is still unfinished
        # once everything it had sent is read.
        victim: VllmEngine | None = None
        cut_expected: list[int] = []
        for _ in range(6000):
            started = [r for r in results if r.get("stream") and r.get("chunks", 0) > 0 and not r.get("done")]
            if started:
                url = started[0]["endpoint"]
                frozen = stack.engine(url)
                os.killpg(frozen.pid, signal.SIGSTOP)  # type: ignore[arg-type]
                await _settled(results, url)
                cut_expected = [i for i, r in enumerate(results) if _unfinished_stream_on(r, url)]
                if cut_expected:
                    victim = frozen
                    break
                os.killpg(frozen.pid, signal.SIGCONT)  # type: ignore[arg-type]
            await asyncio.sleep(0.05)
        assert victim is not None, "no stream was mid-way on its engine within 300 s"
        victim_url = victim.base_url
        await asyncio.to_thread(victim.kill)
        killed_at = time.monotonic()
        await asyncio.gather(*tasks)
        after = [await _one(s, stack.router_url, text(9000 + i, 150), stream=i % 2 == 0) for i in range(4)]
    lost = [r for r in results if not r["done"] and not (r["stream"] and r["chunks"] > 0)]
    aborted_at = [i for i, r in enumerate(results) if r["stream"] and not r["done"]]
    aborted = [results[i] for i in aborted_at]
    assert lost == [], f"requests lost without having started: {lost}"
    # The streams unfinished on the victim are cut with the router's error event, not replayed; no other.
    assert aborted_at == cut_expected, results
    for r in aborted:
        assert r["error"]["code"] == "upstream_failed" and r["endpoint"] == victim_url and r["chunks"] > 0
    assert all(r["done"] and r["endpoint"] != victim_url for r in after)
    state = router_state(stack)
    dead = state["endpoints"][victim_url]
    assert dead["healthy"] is False
    assert dead["indexedBlocks"] == 0  # the index dropped the dead engine
    alive = [u for u in state["endpoints"] if u != victim_url]
    assert any(state["endpoints"][u]["indexedBlocks"] > 0 for u in alive)
    retries = router_metric(stack, "kvstrata_router_retries_total")
    print(
        f"\n[router-engines] kill: {n} concurrent requests (half streaming), killed {victim_url} once a stream "
        f"on it had started ({len(cut_expected)} unfinished streams on it); completed "
        f"{sum(r['done'] for r in results)}/{n}, streams cut after starting {len(aborted)}, lost {len(lost)}, "
        f"router retries {retries:.0f}; post-kill requests ok {sum(r['done'] for r in after)}/4 "
        f"({time.monotonic() - killed_at:.1f}s after the kill)"
    )


def test_no_router_tracebacks(stack: Stack) -> None:
    log = stack.router_log.read_text()
    assert "Traceback" not in log, log[-4000:]
    assert stack.router_proc.poll() is None
