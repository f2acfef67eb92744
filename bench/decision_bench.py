"""`make bench-decision`: what the router's decision and its bookkeeping cost per request, without HTTP.

`make bench-proxy` measures a whole request through the router (server, decision, upstream client,
response), against the peers. This takes the part in between on its own, in process, so that a change to
the decision can be measured in seconds and with little spread: bench-proxy's runs of kv-aware vary by
about ±25 µs from one to the next; this varies by a few.

Per policy, a router with the tiny model's tokenizer and ``--engines`` endpoints (never contacted) routes
``--requests`` requests shaped as bench-proxy's (its ~130-token prompt, each ending in its own ticket
number), ``--in-flight`` at once: each is parsed, decided, admitted by the gate and committed to its
engine; the oldest in flight then ends (its claim released as answered, its prediction settled). The
figures are µs per request: process CPU over the whole loop, and wall time per phase.

A run's figure moves by several µs with what else the machine does (on the two-core VM, 58-80 µs for one
code in four runs back to back), more than most changes to compare. So ``--rounds`` rounds, each a fresh
router per policy, the policies in turn (reversed every other round, so neither always runs first): each
row gives the median round and the range of all of them, and comparing two code versions means paired
rounds, not one run against another.

The router's own collector settings (`router/main.py: collect_rarely`) apply, and the tokenizer encodes on
the calling thread (`router/workpool.py`), as in the router. No peer
column: no peer router can be driven this way, so the figures compare code versions, not routers.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time
from pathlib import Path
from typing import Any

from bench import nginx_backend
from bench.procs import bench_main
from bench.proxy_bench import request_body
from bench.report import alternating, fmt, machine, table
from bench.wrk import UNIQUE
from kvstrata.api.router_config import RouterSettings
from kvstrata.router.admission import Claim
from kvstrata.router.core import Router
from kvstrata.router.decision import Decision
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.pool import Endpoint, EndpointSpec
from kvstrata.router.requests import parse_request

PHASES = ("parse", "decide", "admit", "end")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="kv-aware,round-robin", help="router policies to measure")
    p.add_argument("--requests", type=int, default=20_000, help="requests measured per policy")
    p.add_argument("--warmup", type=int, default=2_000, help="requests routed first, unmeasured")
    p.add_argument("--in-flight", type=int, default=64, help="requests in flight (bench-proxy's connections)")
    p.add_argument("--engines", type=int, default=3, help="endpoints (bench-proxy's backend workers)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each policy once per round")
    p.add_argument("--out", type=Path, default=Path(".bench/decision.json"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


_BODY = request_body(stream=False, unique=True)


def _body(n: int) -> bytes:
    return _BODY.replace(UNIQUE, str(n)).encode()


async def _measure(policy: str, args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    settings = RouterSettings.model_validate(
        {"model": nginx_backend.MODEL, "blockSize": 32, "policy": policy, "tokenizer": str(tokenizer)}
    )
    router = Router(settings, RouterMetrics())
    router.pool.replace([EndpointSpec(f"http://engine-{i}:8000") for i in range(args.engines)])
    in_flight: collections.deque[tuple[Decision, Endpoint, Claim | None]] = collections.deque()
    spent = dict.fromkeys(PHASES, 0.0)
    hashed = 0

    async def one(n: int) -> None:
        nonlocal hashed
        t0 = time.perf_counter()
        parsed = parse_request(_body(n), "completion", settings.model, settings.max_prompt_chars)
        t1 = time.perf_counter()
        decision = await router.decide(parsed, None)
        t2 = time.perf_counter()
        grant = await router.gate.admit(decision, parsed.output_tokens())
        ep = grant.endpoint
        if decision.committed is not ep:  # as the proxy's first try does
            router.commit(decision, ep)
        ep.in_flight += 1
        in_flight.append((decision, ep, grant.claim))
        t3 = time.perf_counter()
        if len(in_flight) > args.in_flight:
            d, e, claim = in_flight.popleft()
            e.in_flight -= 1
            router.gate.release(claim, ended=True)
            router.settle(d, e)
        t4 = time.perf_counter()
        spent["parse"] += t1 - t0
        spent["decide"] += t2 - t1
        spent["admit"] += t3 - t2
        spent["end"] += t4 - t3
        hashed += bool(decision.hashes)

    try:
        for n in range(args.warmup):
            await one(n)
        spent.update(dict.fromkeys(PHASES, 0.0))
        hashed = 0
        cpu0 = time.process_time()
        for n in range(args.warmup, args.warmup + args.requests):
            await one(n)
        cpu = time.process_time() - cpu0
    finally:
        router.close()
    per = 1e6 / args.requests
    return {
        "policy": policy,
        "cpu_us_per_request": round(cpu * per, 1),
        "phase_us": {k: round(v * per, 1) for k, v in spent.items()},
        "requests": args.requests,
        "hashed": hashed,
    }


def _summary(policy: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's rounds: the median round's figures (each its own median), and every round's CPU."""
    cpu = [r["cpu_us_per_request"] for r in rounds]
    return {
        "policy": policy,
        "cpu_us_per_request": round(statistics.median(cpu), 1),
        "cpu_us_rounds": cpu,
        "phase_us": {k: round(statistics.median(r["phase_us"][k] for r in rounds), 1) for k in PHASES},
        "requests": rounds[0]["requests"],
        "hashed": rounds[0]["hashed"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    tokenizer = ensure_tiny_model(default_tiny_model_dir())
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    measured: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for n in range(args.rounds):
        for p in alternating(policies, n):
            measured[p].append(asyncio.run(_measure(p, args, tokenizer)))
    rows = [_summary(p, measured[p]) for p in policies]
    return {
        "benchmark": "decision",
        "machine": machine(),
        "settings": {
            "requests": args.requests,
            "warmup": args.warmup,
            "in_flight": args.in_flight,
            "engines": args.engines,
            "rounds": args.rounds,
        },
        "rows": rows,
    }


def render(payload: dict[str, Any]) -> str:
    s = payload["settings"]
    head = (
        f"decision and bookkeeping per request, in process: {s['requests']} requests shaped as "
        f"bench-proxy's, {s['in_flight']} in flight, {s['engines']} engines; median of {s['rounds']} rounds "
        "(range: every round's CPU)"
    )
    rows = [
        [
            r["policy"],
            fmt(r["cpu_us_per_request"], 1),
            f"{min(r['cpu_us_rounds']):.1f}-{max(r['cpu_us_rounds']):.1f}",
            *(fmt(r["phase_us"][k], 1) for k in PHASES),
        ]
        for r in payload["rows"]
    ]
    headers = ["policy", "cpu us/req", "range", *(f"{k} us" for k in PHASES)]
    return head + "\n" + table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    from kvstrata.router.main import collect_rarely
    from kvstrata.router.workpool import tokenize_on_calling_threads

    args = parse_args(argv)
    collect_rarely()  # as the router runs
    tokenize_on_calling_threads()
    return bench_main("bench-decision", lambda: run(args), render, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
