"""`make bench-router-overhead`: the latency a router adds to long prompts, cold and extending a known one.

Every router sits in front of the same static nginx backend (bench/nginx_backend.py: canned answers, so
only the router is measured). For each prompt size (1K, 8K, 32K, 128K tokens of the tiny model's
tokenizer) and each mode, requests are sent one at a time over one keep-alive connection, each one
twice in a row: straight to nginx, then through the router; the figure is the paired difference
(router - direct) per request, so the machine's drifting load cancels out.

- cold: every request a prompt the router has never seen (distinct text from the first character);
- extend: a conversation: the first turn is sent untimed, then every timed request is the previous
  prompt plus a new turn of about 100 tokens (what a multi-turn chat or an agent sends);
- cold-chat, extend-chat: the same prompts as chat (/v1/chat/completions): the text is a system
  message followed by a short question, and each new turn appends an answer and a question;
- agent: one long conversation, as an agent sends it: an 8K-token start, then ``--agent-turns`` turns,
  each the previous prompt plus ~100 tokens (600 turns end near 69K tokens). The figure is the added
  p50 over the first and over the last tenth of the turns: what a router's cost per turn grows with,
  the prompt's length or the conversation's history.
- beside a huge prompt: short cold prompts (~256 tokens), paired as above, first with nothing else in
  flight, then for ``--huge-seconds`` while another connection keeps a ``--huge-chars`` prompt (4 MB)
  in flight through the same router, one after another. The figure is the short prompts' added latency
  beside the huge one (only those whose routed leg lay wholly inside a huge request) against idle: what
  one huge prompt costs everyone else. Between the two, a *control*: the same short prompts for the same
  ``--huge-seconds`` with nothing else in flight, so beside and control hold about as many requests and
  their tails compare like for like (the slowest of thousands of requests on two shared cores is the
  scheduler's as much as the router's; the 40 idle ones have no tail to speak of). kvstrata refuses prompts over ``maxPromptChars`` (2,000,000
  characters by default) with a 413 at once; here it runs with the bound raised past the huge prompt,
  so the prompt is really read, parsed, tokenized, hashed and forwarded.

The reference for cold prompts is the engine's own tokenization of the same prompt: the Rust tokenizer
vLLM's fast tokenizer wraps (`tokenizers.Tokenizer.encode`), timed in this process; for chat, the
rendering of the model's chat template (jinja, as vLLM renders it) plus that tokenization. Figures are printed
side by side and written to .bench/overhead.json; the benchmark never fails the build on a figure.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from bench import nginx_backend
from bench.procs import BenchError, ProcGroup, bench_main, http_get
from bench.report import fmt, group_cpu_seconds, machine, percentile, table
from bench.routers import RouterConfig, Worker, start_router

DEFAULT_ROUTERS = ("kvstrata/kv-aware", "sglang-router/cache_aware", "vllm-router/cache_aware")
DEFAULT_SIZES = (1024, 8192, 32768, 131072)
MODES = ("cold", "extend", "cold-chat", "extend-chat")
_QUESTION = "What does the text above say? Answer briefly."
_TURN_WORDS = 30  # ~100 tokens of the tiny model per new turn
_AGENT_START_TOKENS = 8192
_SHORT_TOKENS = 256  # a short prompt beside the huge one
_IDLE_SHORT = 40  # short prompts timed with nothing else in flight


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.overhead_bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--routers",
        default=os.environ.get("BENCH_OVERHEAD_ROUTERS", ",".join(DEFAULT_ROUTERS)),
        help="comma-separated <impl>/<policy> list (default: %(default)s)",
    )
    p.add_argument(
        "--sizes",
        default=os.environ.get("BENCH_OVERHEAD_SIZES", ",".join(map(str, DEFAULT_SIZES))),
        help="prompt sizes in tokens (default: %(default)s)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=int(os.environ.get("BENCH_OVERHEAD_REQUESTS", "15")),
        help="timed requests per router, size and mode (default: %(default)s)",
    )
    p.add_argument(
        "--agent-turns",
        type=int,
        default=int(os.environ.get("BENCH_OVERHEAD_AGENT_TURNS", "600")),
        help="turns of the long agent conversation (0 = none; default: %(default)s)",
    )
    p.add_argument(
        "--huge-chars",
        type=int,
        default=int(os.environ.get("BENCH_OVERHEAD_HUGE_CHARS", "4000000")),
        help="characters of the prompt kept in flight while short ones are timed (0 = skip; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--huge-seconds",
        type=float,
        default=float(os.environ.get("BENCH_OVERHEAD_HUGE_SECONDS", "8")),
        help="how long short prompts are timed beside huge ones (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, default=Path(".bench/overhead.json"))
    p.add_argument("--workdir", type=Path, default=Path(".bench/overhead"))
    return p.parse_args(argv)


class Prompts:
    """Prompt text of a given token count, from the tiny model's generated pseudo-English."""

    def __init__(self, tokenizer: Any) -> None:
        from kvstrata_dev.testing.tinymodel import _corpus

        self.tok = tokenizer
        self.text = "".join(_corpus(1) + _corpus(2))
        ids = tokenizer.encode(self.text[:20_000]).ids
        self.chars_per_token = 20_000 / len(ids)
        self.rng = random.Random(0)

    def fit(self, text: str, tokens: int) -> str:
        """``text`` cut to about ``tokens`` tokens (at a space)."""
        n = int(tokens * self.chars_per_token)
        cut = text.rfind(" ", 0, n)
        return text[: cut if cut > 0 else n]

    def cold(self, tokens: int, i: int) -> str:
        # A distinct start (a serial number and a shuffled offset) makes every prompt new to every router.
        n = int(tokens * self.chars_per_token) + 64
        start = self.rng.randrange(0, max(1, len(self.text) - n))
        body = (self.text[start:] + self.text)[:n]
        return self.fit(f"Request {i} {self.rng.random():.12f}. " + body, tokens)

    def huge(self, chars: int) -> Callable[[int], Request]:
        """Completion requests of a prompt of ``chars`` characters (and a short head), each new to every
        router from its first character. The body is JSON-escaped once; each request only prefixes its
        own head (a copy, not an encode, so the sender thread barely holds this process's GIL while
        short prompts are timed)."""
        text = (self.text * (chars // len(self.text) + 1))[:chars]
        escaped = json.dumps(text)[1:-1].encode()
        tail = b'", "max_tokens": 16}'
        model = json.dumps(nginx_backend.MODEL)
        seed = self.rng.random()

        def make(i: int) -> Request:
            head = f'{{"model": {model}, "prompt": "Huge prompt {i} {seed:.12f}. '.encode()
            return Request("/v1/completions", head + escaped + tail)

        return make

    def turn(self) -> str:
        words = self.text[self.rng.randrange(0, len(self.text) - 2000) :].split(" ")[:_TURN_WORDS]
        return "\n\nUser: " + " ".join(words) + "\nAssistant:"


class Request(NamedTuple):
    path: str
    body: bytes


def _post(conn: http.client.HTTPConnection, req: Request) -> tuple[int, float]:
    t0 = time.perf_counter()
    conn.request("POST", req.path, body=req.body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    return resp.status, time.perf_counter() - t0


def _pair(
    direct: http.client.HTTPConnection, routed: http.client.HTTPConnection, req: Request
) -> tuple[float, float] | None:
    """``req`` straight to nginx, then through the router: (when the routed leg started, the ms the
    router added), or None if either answered other than 200."""
    s1, t_direct = _post(direct, req)
    start = time.perf_counter()
    s2, t_router = _post(routed, req)
    if s1 != 200 or s2 != 200:
        return None
    return start, (t_router - t_direct) * 1e3


def _pairs(
    direct: http.client.HTTPConnection, routed: http.client.HTTPConnection, reqs: Sequence[Request]
) -> tuple[list[float], int]:
    """:func:`_pair` for each of ``reqs``: the ms the router added to those answered 200 both ways, and
    how many were not."""
    pairs = [_pair(direct, routed, req) for req in reqs]
    return [p[1] for p in pairs if p is not None], sum(p is None for p in pairs)


def _conn(url: str) -> http.client.HTTPConnection:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=120)


def completion(prompt: str) -> Request:
    body = {"model": nginx_backend.MODEL, "prompt": prompt, "max_tokens": 16}
    return Request("/v1/completions", json.dumps(body).encode())


def chat(messages: list[dict[str, str]]) -> Request:
    body = {"model": nginx_backend.MODEL, "messages": messages, "max_tokens": 16}
    return Request("/v1/chat/completions", json.dumps(body).encode())


def chat_messages(text: str) -> list[dict[str, str]]:
    """A long prompt as chat: the text as the system message, then a short question."""
    return [{"role": "system", "content": text}, {"role": "user", "content": _QUESTION}]


def chat_turn(messages: list[dict[str, str]], turn: str) -> list[dict[str, str]]:
    """The conversation one turn on: an answer, then the new turn's words as the next question."""
    return [*messages, {"role": "assistant", "content": "It says little."}, {"role": "user", "content": turn}]


def _measure(
    direct_url: str, router_url: str, prompts: list[Request], warm: Request | None, pgid: int
) -> dict[str, Any]:
    direct, routed = _conn(direct_url), _conn(router_url)
    added: list[float] = []
    errors = 0
    cpu = 0.0
    try:
        if warm is not None:  # the conversation's first turn, untimed
            _post(routed, warm)
            _settle(router_url)  # processed, as it would be by the time an engine answered it
        cpu0 = group_cpu_seconds(pgid)
        added, errors = _pairs(direct, routed, prompts)
        _settle(router_url)  # the cell's CPU includes work the router did after answering
        cpu = group_cpu_seconds(pgid) - cpu0
    finally:
        direct.close()
        routed.close()
    return {
        "requests": len(prompts),
        "errors": errors,
        "added_ms": [round(a, 3) for a in added],
        "p10_ms": _r(percentile(added, 10)),
        "p50_ms": _r(percentile(added, 50)),
        "p90_ms": _r(percentile(added, 90)),
        # The router's own CPU (all its threads) per request: unlike latency, barely moved by the
        # rest of the machine's load. Clock ticks: 10 ms resolution, summed over the cell.
        "router_cpu_ms_per_req": round(cpu / len(prompts) * 1e3, 2) if prompts else None,
    }


class HugeSender(threading.Thread):
    """Keeps one huge prompt in flight through the router, one after another, until stopped."""

    def __init__(self, router_url: str, make: Callable[[int], Request]) -> None:
        super().__init__(daemon=True)
        self.router_url = router_url
        self.make = make
        self.sending = threading.Event()  # the first huge request is on its way
        self.stop = threading.Event()
        self.spans: list[tuple[float, float, int]] = []  # (start, end, HTTP status), perf_counter

    def run(self) -> None:
        conn = _conn(self.router_url)
        try:
            for i in itertools.count():
                if self.stop.is_set():
                    return
                req = self.make(i)
                t0 = time.perf_counter()
                self.sending.set()
                try:
                    status, took = _post(conn, req)
                except (OSError, http.client.HTTPException):
                    status, took = 0, time.perf_counter() - t0
                    conn.close()
                    conn = _conn(self.router_url)
                self.spans.append((t0, t0 + took, status))
        finally:
            self.sending.set()  # never leave the timing loop waiting on a sender that failed to start
            conn.close()


def in_flight_since(leg: tuple[float, float], spans: Sequence[tuple[float, float, int]]) -> float | None:
    """When the huge request that was in flight through the router for all of ``leg`` was sent, or None
    if no one was."""
    start, end = leg
    return next((s for s, e, _ in spans if s <= start and end <= e), None)


def _timed_pairs(
    direct: http.client.HTTPConnection,
    routed: http.client.HTTPConnection,
    short: Sequence[Request],
    seconds: float,
    keep_going: Callable[[], bool] = lambda: True,
) -> tuple[list[tuple[float, float, float]], int]:
    """Short prompts paired (direct, then routed) for ``seconds``: each routed leg's start, end and
    added ms, and the errors."""
    legs: list[tuple[float, float, float]] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    for req in itertools.cycle(short):
        if time.perf_counter() >= deadline or not keep_going():
            break
        pair = _pair(direct, routed, req)
        if pair is None:
            errors += 1
            continue
        start, added = pair
        legs.append((start, time.perf_counter(), added))
    return legs, errors


def _measure_beside_huge(
    direct_url: str,
    router_url: str,
    idle: Sequence[Request],
    short: Sequence[Request],
    huge: Callable[[int], Request],
    seconds: float,
) -> dict[str, Any]:
    """Short prompts' added latency with nothing else in flight (a few, then as many as beside: the
    control), then beside huge prompts."""
    direct, routed = _conn(direct_url), _conn(router_url)
    idle_added: list[float] = []
    control: list[tuple[float, float, float]] = []
    legs: list[tuple[float, float, float]] = []  # (router leg start, end, added ms)
    errors = 0
    sender = HugeSender(router_url, huge)
    try:
        idle_added, errors = _pairs(direct, routed, idle)
        control, control_errors = _timed_pairs(direct, routed, short, seconds)
        errors += control_errors
        sender.start()
        sender.sending.wait(60)
        time.sleep(0.05)  # the huge body is on the wire: localhost takes a few ms for 4 MB
        legs, beside_errors = _timed_pairs(direct, routed, short, seconds, sender.is_alive)
        errors += beside_errors
    finally:
        sender.stop.set()
        sender.join(300)
        direct.close()
        routed.close()
    # Each short prompt beside a huge one: when it ran (s after that huge one was sent) and what it
    # added. When tells which stage of the huge prompt's path held the short ones up.
    timeline = [
        (round(start - since, 4), round(added, 3))
        for start, end, added in legs
        if (since := in_flight_since((start, end), sender.spans)) is not None
    ]
    beside = [added for _, added in timeline]
    controlled = [added for _, _, added in control]
    huge_ok = [e - s for s, e, status in sender.spans if status == 200]
    return {
        "mode": "beside-huge",
        "idle_p50_ms": _r(percentile(idle_added, 50)),
        "idle_p90_ms": _r(percentile(idle_added, 90)),
        "idle_max_ms": _r(max(idle_added, default=None)),
        "control": len(controlled),
        "control_p50_ms": _r(percentile(controlled, 50)),
        "control_p90_ms": _r(percentile(controlled, 90)),
        "control_p99_ms": _r(percentile(controlled, 99)),
        "control_max_ms": _r(max(controlled, default=None)),
        "beside": len(beside),
        "short_timed": len(legs),
        "beside_p50_ms": _r(percentile(beside, 50)),
        "beside_p90_ms": _r(percentile(beside, 90)),
        "beside_p99_ms": _r(percentile(beside, 99)),
        "beside_max_ms": _r(max(beside, default=None)),
        "huge_done": len(huge_ok),
        "huge_errors": len(sender.spans) - len(huge_ok),
        "huge_statuses": sorted({status for _, _, status in sender.spans}),
        "huge_p50_s": _r(percentile(huge_ok, 50)),
        "beside_timeline": timeline,
        "errors": errors,
    }


def _settle(router_url: str, limit_s: float = 30.0) -> None:
    """Wait until the router has no prompt hashing left that it deferred past a decision (kvstrata
    routes a long cold prompt on its leading blocks and hashes the rest after; /kvstrata/state says how
    many). Routers without that state return at once."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        status, body = http_get(router_url + "/kvstrata/state", timeout=5)
        if status != 200 or not json.loads(body).get("backgroundHashing"):
            return
        time.sleep(0.01)


def _agent_row(row: dict[str, Any]) -> dict[str, Any]:
    """The agent conversation's cell: the added p50 over its first and its last tenth of turns."""
    added = row["added_ms"]
    tenth = max(len(added) // 10, 1)
    row.update(
        mode="agent",
        first_p50_ms=_r(percentile(added[:tenth], 50)),
        last_p50_ms=_r(percentile(added[-tenth:], 50)),
    )
    return row


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _engine_tokenize_ms(encode: Callable[[Any], object], prompts: Sequence[Any]) -> float | None:
    times = []
    for p in prompts:
        t0 = time.perf_counter()
        encode(p)
        times.append((time.perf_counter() - t0) * 1e3)
    return _r(percentile(times, 50))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from kvstrata.router.prompts import LocalTokenizer
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    model_dir = ensure_tiny_model(default_tiny_model_dir())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    gen = Prompts(tok)
    # The same prompts for every router: cold ones fresh to each (a fresh router process each time).
    cells: dict[tuple[int, str], tuple[list[Request], Request | None]] = {}
    engine_ms: dict[str, float | None] = {}
    chat_tok = LocalTokenizer(model_dir)
    for n in sizes:
        cold = [gen.cold(n, i) for i in range(args.requests)]
        first = gen.cold(n, 10_000 + n)
        prompts, messages = [first], [chat_messages(first)]
        for _ in range(args.requests):
            turn = gen.turn()
            prompts.append(prompts[-1] + turn)
            messages.append(chat_turn(messages[-1], turn))
        cells[n, "cold"] = [completion(p) for p in cold], None
        cells[n, "extend"] = [completion(p) for p in prompts[1:]], completion(first)
        cells[n, "cold-chat"] = [chat(chat_messages(p)) for p in cold], None
        cells[n, "extend-chat"] = [chat(m) for m in messages[1:]], chat(messages[0])
        engine_ms[f"{n}"] = _engine_tokenize_ms(lambda p: tok.encode(p, add_special_tokens=True), cold[:5])
        engine_ms[f"{n}/chat"] = _engine_tokenize_ms(
            lambda p: chat_tok.encode_chat(chat_messages(p)), cold[:5]
        )
    agent: list[Request] = []
    if args.agent_turns > 0:
        prompts = [gen.cold(_AGENT_START_TOKENS, 20_000)]
        for _ in range(args.agent_turns):
            prompts.append(prompts[-1] + gen.turn())
        agent = [completion(p) for p in prompts]
        agent_end_tokens = len(tok.encode(prompts[-1]).ids)
        del prompts
    huge = gen.huge(args.huge_chars) if args.huge_chars > 0 else None
    idle_short = [completion(gen.cold(_SHORT_TOKENS, 30_000 + i)) for i in range(_IDLE_SHORT)]
    # More than the timed window can use (a pair takes a few ms), each new to the router.
    short = [completion(gen.cold(_SHORT_TOKENS, 40_000 + i)) for i in range(4000)] if huge else []
    cfg = RouterConfig(model=nginx_backend.MODEL, tokenizer_dir=model_dir, block_size=32)
    results: list[dict[str, Any]] = []
    args.workdir.mkdir(parents=True, exist_ok=True)
    with ProcGroup(args.workdir / "logs") as procs:
        backend = nginx_backend.start_backend(procs, args.workdir, 3)
        direct_url = backend.json_urls[0]
        for name in routers:
            running = None
            try:
                # kvstrata refuses a prompt over maxPromptChars (2M characters by default) at once: raise
                # the bound so the huge prompt is really routed.
                env = {"KVSTRATA_ROUTER_MAX_PROMPT_CHARS": str(2 * args.huge_chars)} if huge else {}
                running = start_router(procs, name, [Worker(u) for u in backend.json_urls], cfg, env=env)
                pgid = running.proc.popen.pid
                for n in sizes:
                    for mode in MODES:
                        row = _measure(direct_url, running.url, *cells[n, mode], pgid)
                        row.update(router=name, tokens=n, mode=mode)
                        results.append(row)
                        print(
                            f"  {name:28} {n:>7} tokens {mode:6} added p50 {fmt(row['p50_ms'], 2)} ms"
                            f"  p90 {fmt(row['p90_ms'], 2)} ms  cpu/req {fmt(row['router_cpu_ms_per_req'], 2)} ms"
                            f"  errors {row['errors']}",
                            flush=True,
                        )
                if agent:
                    row = _agent_row(_measure(direct_url, running.url, agent[1:], agent[0], pgid))
                    row.update(router=name, tokens=_AGENT_START_TOKENS, end_tokens=agent_end_tokens)
                    results.append(row)
                    print(
                        f"  {name:28} agent {args.agent_turns} turns to {agent_end_tokens} tokens: added p50"
                        f" {fmt(row['first_p50_ms'], 2)} ms (first tenth) {fmt(row['last_p50_ms'], 2)} ms"
                        f" (last tenth)  errors {row['errors']}",
                        flush=True,
                    )
                if huge is not None:
                    row = _measure_beside_huge(
                        direct_url, running.url, idle_short, short, huge, args.huge_seconds
                    )
                    row.update(router=name, tokens=_SHORT_TOKENS, huge_chars=args.huge_chars)
                    results.append(row)
                    print(
                        f"  {name:28} {_SHORT_TOKENS}-token prompts beside a {args.huge_chars:,}-character"
                        f" one: added p50 {fmt(row['beside_p50_ms'], 2)} ms p99 {fmt(row['beside_p99_ms'], 2)}"
                        f" max {fmt(row['beside_max_ms'], 2)} ({row['beside']} of {row['short_timed']} beside;"
                        f" idle p50 {fmt(row['idle_p50_ms'], 2)} ms; control p99"
                        f" {fmt(row['control_p99_ms'], 2)} max {fmt(row['control_max_ms'], 2)});"
                        f" huge done {row['huge_done']}"
                        f" (p50 {fmt(row['huge_p50_s'], 2)} s), errors {row['errors']}/{row['huge_errors']}",
                        flush=True,
                    )
            except BenchError as exc:
                results.append({"router": name, "problem": str(exc).splitlines()[0]})
                print(f"  {name}: FAILED {str(exc).splitlines()[0]}", flush=True)
            finally:
                if running is not None:
                    procs.stop(running.proc)
    return {
        "benchmark": "router-overhead",
        "machine": machine(),
        "settings": {
            "sizes_tokens": sizes,
            "requests": args.requests,
            "turn_words": _TURN_WORDS,
            "agent_turns": args.agent_turns,
            "agent_start_tokens": _AGENT_START_TOKENS,
            "huge_chars": args.huge_chars,
            "huge_seconds": args.huge_seconds,
            "short_tokens": _SHORT_TOKENS,
            "chars_per_token": round(gen.chars_per_token, 3),
            "backend": "nginx, canned completion (no engine: only the router is measured)",
            "method": "paired: each request straight to nginx, then through the router; added = difference",
        },
        "engine_tokenize_p50_ms": engine_ms,
        "results": results,
    }


def render(payload: dict[str, Any]) -> str:
    rows_by: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    routers: list[str] = []
    problems = []
    agents = []
    besides = []
    for r in payload["results"]:
        if "problem" in r:
            problems.append(f"! {r['router']}: {r['problem']}")
            continue
        if r["mode"] == "agent":
            agents.append(r)
            continue
        if r["mode"] == "beside-huge":
            besides.append(r)
            continue
        if r["router"] not in routers:
            routers.append(r["router"])
        rows_by.setdefault((r["tokens"], r["mode"]), {})[r["router"]] = r
    headers = ["tokens", "mode", "engine tokenize ms"]
    for r in routers:
        headers += [f"{r} p50 / p90 (p10)", "cpu/req"]
    rows = []
    for (n, mode), by in sorted(rows_by.items()):
        key = f"{n}/chat" if mode.endswith("chat") else f"{n}"
        eng = payload["engine_tokenize_p50_ms"].get(key)
        cells = [str(n), mode, fmt(eng, 2) if mode.startswith("cold") else ""]
        for name in routers:
            r = by.get(name)
            if r is None:
                cells += ["-", "-"]
                continue
            cells.append(
                f"{fmt(r['p50_ms'], 2)} / {fmt(r['p90_ms'], 2)} ({fmt(r['p10_ms'], 2)})"
                + (f" {r['errors']} err" if r["errors"] else "")
            )
            cells.append(fmt(r.get("router_cpu_ms_per_req"), 2))
        rows.append(cells)
    s = payload["settings"]
    lines = [
        f"latency added by each router (ms, paired vs direct nginx), {s['requests']} requests per cell, "
        f"{payload['machine']['cpus']} CPUs shared by client, router and nginx",
        table(headers, rows),
        *problems,
    ]
    if agents:
        lines += [
            "",
            f"one agent conversation: {s['agent_turns']} turns from {s['agent_start_tokens']} tokens, each"
            " turn the previous prompt + ~100 tokens (added ms, paired vs direct nginx)",
            table(
                ["router", "end tokens", "p50 first tenth", "p50 last tenth", "cpu/req", "errors"],
                [
                    [
                        r["router"],
                        str(r["end_tokens"]),
                        fmt(r["first_p50_ms"], 2),
                        fmt(r["last_p50_ms"], 2),
                        fmt(r.get("router_cpu_ms_per_req"), 2),
                        str(r["errors"]),
                    ]
                    for r in agents
                ],
            ),
        ]
    if besides:
        lines += ["", render_beside_huge(besides, s)]
    return "\n".join(lines)


def render_beside_huge(rows: Sequence[dict[str, Any]], settings: dict[str, Any]) -> str:
    """The short prompts' added latency beside a huge one, against idle, per router."""
    return "\n".join(
        [
            f"{settings['short_tokens']}-token prompts beside a {settings['huge_chars']:,}-character prompt in"
            f" flight through the same router for {settings['huge_seconds']:g} s (added ms, paired vs direct"
            " nginx; only short prompts whose routed leg lay wholly inside a huge request count as beside)",
            table(
                [
                    "router",
                    "idle p50 / p90",
                    "control p50 / p90 / p99 / max (n)",
                    "beside p50 / p90 / p99 / max",
                    "beside n",
                    "huge done (p50 s)",
                    "errors short / huge",
                ],
                [
                    [
                        r["router"],
                        f"{fmt(r['idle_p50_ms'], 2)} / {fmt(r['idle_p90_ms'], 2)}",
                        _control(r),
                        f"{fmt(r['beside_p50_ms'], 2)} / {fmt(r['beside_p90_ms'], 2)} / "
                        f"{fmt(r['beside_p99_ms'], 2)} / {fmt(r['beside_max_ms'], 2)}",
                        f"{r['beside']} of {r['short_timed']}",
                        f"{r['huge_done']} ({fmt(r['huge_p50_s'], 2)})",
                        f"{r['errors']} / {r['huge_errors']}"
                        + (f" (HTTP {r['huge_statuses']})" if r["huge_errors"] else ""),
                    ]
                    for r in rows
                ],
            ),
        ]
    )


def _control(row: dict[str, Any]) -> str:
    """The control's percentiles (runs before the forty-sixth session had none)."""
    if "control" not in row:
        return "-"
    return (
        f"{fmt(row['control_p50_ms'], 2)} / {fmt(row['control_p90_ms'], 2)} / "
        f"{fmt(row['control_p99_ms'], 2)} / {fmt(row['control_max_ms'], 2)} ({row['control']})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return bench_main("bench-router-overhead", lambda: run(args), render, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
