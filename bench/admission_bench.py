"""`make bench-admission`: what the router's admission gate costs while it holds many requests.

The gate (router/admission.py) holds a request whose engine's KV pool is full of the router's running
requests, and when room frees it weighs the held requests against what each engine holds (one index
lookup per held request weighed). Under a burst larger than the cluster's pools, hundreds of requests
can be held at once; this measures what that costs the router's event loop, which every other request
shares.

In process, no engine: ``--engines`` (3) endpoints whose pools (``--pool`` blocks) are full of ``--running`` claims
each, the router's real block index (native tables) holding every prompt's blocks on its home, and
``--held`` requests of distinct 64-block prompts held across the three. For each count of held requests:

- **pump**: one pass of the gate over its held requests with nothing freed (index lookups, ms);
- **release**: a running request ends on one engine and the gate admits what now fits (ms);
- **idle**: what the held requests cost the loop over one second in which nothing changes (CPU ms and
  index lookups: the gate's rechecks, which bound how stale a held request's view may get).

And once per run, what every admission pays: the room check (`Gate.fits`) of a prompt on a full pool,
where counting shared prefixes once decides it (µs, mean of 2,000).

No peer router holds requests (each forwards at once and leaves the queue to the engine), so there is no
peer column: the figures are the gate's own cost, to compare across code versions.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.procs import bench_main
from bench.report import fmt, machine, table
from kvstrata.api.router_config import AdmissionSettings, TierWeights
from kvstrata.router.admission import Gate, GateDeps, Grant
from kvstrata.router.decision import Decision
from kvstrata.router.events import BlockStored
from kvstrata.router.index import BlockIndex, PrefixMatch
from kvstrata.router.pool import Endpoint, EndpointSpec
from kvstrata.router.reasons import Reason
from kvstrata.router.scoring import RouteRequest

BLOCK_SIZE = 32
PROMPT_BLOCKS = 64
_FITS_CALLS = 2000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--held", default="10,100,300,1000", help="held-request counts to measure")
    p.add_argument("--engines", type=int, default=3, help="engines behind the router")
    p.add_argument("--running", type=int, default=16, help="running requests (claims) per engine")
    p.add_argument("--pool", type=int, default=2048, help="KV blocks per engine")
    p.add_argument("--out", type=Path, default=Path(".bench/admission.json"))
    return p.parse_args(argv)


def _prompt(n: int) -> array[int]:
    """A prompt's block hashes, distinct from every other ``n``'s."""
    return array("Q", [(n << 16) + i + 1 for i in range(PROMPT_BLOCKS)])


class _Counted:
    """The index's lookup, counted."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.calls = 0

    def __call__(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        self.calls += 1
        return self.index.lookup(hashes)


async def _measure(held: int, engines: int, running: int, pool: int) -> dict[str, Any]:
    eps = [Endpoint(EndpointSpec(f"http://engine-{i}"), kv_blocks=pool) for i in range(engines)]
    index = BlockIndex(2_000_000)
    lookup = _Counted(index)
    gate = Gate(
        AdmissionSettings(),
        3600.0,
        GateDeps(
            lookup=lookup,
            tiers=TierWeights(),
            block_size=BLOCK_SIZE,
            usable=lambda ep: True,
            silent=lambda ep: False,
            endpoints=lambda: list(eps),
            indexed_blocks=lambda ep: index.blocks_of(ep.url),
            commit=lambda d, ep: None,
            moved=lambda d, ep: None,
        ),
    )

    def decision(n: int, home: int, blocks: int) -> Decision:
        hs = _prompt(n)
        index.apply(eps[home].url, BlockStored(tuple(hs), None, (), BLOCK_SIZE, "GPU"))
        order = [eps[home], *(ep for i, ep in enumerate(eps) if i != home)]
        return Decision(
            order,
            Reason.PREFIX,
            hs,
            matches=index.lookup(hs),
            prompt_tokens=blocks * BLOCK_SIZE,
            request=RouteRequest(hs),
        )

    # Fill each pool with running requests (the last one takes what the others leave).
    each = (pool - 1) // running
    grants: list[Grant] = []
    for e in range(engines):
        for r in range(running):
            blocks = each if r < running - 1 else pool - 1 - each * (running - 1)
            grants.append(await gate.admit(decision(1_000_000 + e * running + r, e, blocks), 0))
    waiting = [
        asyncio.ensure_future(gate.admit(decision(n, n % engines, PROMPT_BLOCKS), 0)) for n in range(held)
    ]
    await asyncio.sleep(0.05)  # every one is held now
    assert gate.held() == held, f"{gate.held()} of {held} held"

    # The room check of every admission, where only counting shared prefixes once can decide it: the
    # claims' blocks summed exceed the pool. A prompt sharing its first blocks with a running one.
    probe = array("Q", [*_prompt(1_000_000)[:8], *_prompt(held + 1)[8:]])
    t = time.perf_counter()
    for _ in range(_FITS_CALLS):
        gate.fits(eps[0], PROMPT_BLOCKS, probe)
    fits_us = (time.perf_counter() - t) / _FITS_CALLS * 1e6

    lookup.calls = 0
    t = time.perf_counter()
    gate.pump()
    pump_ms, pump_lookups = (time.perf_counter() - t) * 1e3, lookup.calls

    # Idle: nothing frees for a second; what do the held requests cost the loop meanwhile?
    lookup.calls = 0
    cpu0 = time.process_time()
    await asyncio.sleep(1.0)
    idle_cpu_ms, idle_lookups = (time.process_time() - cpu0) * 1e3, lookup.calls

    # One running request ends on engine 0: its room goes to what is held there.
    lookup.calls = 0
    t = time.perf_counter()
    gate.release(grants[0].claim)
    release_ms, release_lookups = (time.perf_counter() - t) * 1e3, lookup.calls

    for w in waiting:
        w.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    return {
        "held": held,
        "pump_ms": round(pump_ms, 3),
        "pump_lookups": pump_lookups,
        "release_ms": round(release_ms, 3),
        "release_lookups": release_lookups,
        "idle_cpu_ms_per_s": round(idle_cpu_ms, 1),
        "idle_lookups_per_s": idle_lookups,
        "fits_us": round(fits_us, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(x) for x in args.held.split(",") if x.strip()]
    rows = [asyncio.run(_measure(n, args.engines, args.running, args.pool)) for n in counts]
    return {
        "benchmark": "admission",
        "machine": machine(),
        "engines": args.engines,
        "pool_blocks": args.pool,
        "running_per_engine": args.running,
        "prompt_blocks": PROMPT_BLOCKS,
        "rows": rows,
    }


def render(payload: dict[str, Any]) -> str:
    head = (
        f"admission gate, {payload['engines']} engines of {payload['pool_blocks']} blocks, "
        f"{payload['running_per_engine']} running requests each, held prompts of {payload['prompt_blocks']} blocks"
    )
    fits = [r["fits_us"] for r in payload["rows"]]
    head += f"\nroom check of an admission on a full pool: {min(fits):.1f}-{max(fits):.1f} us"
    rows = [
        [
            str(r["held"]),
            fmt(r["pump_ms"], 2),
            str(r["pump_lookups"]),
            fmt(r["release_ms"], 2),
            str(r["release_lookups"]),
            fmt(r["idle_cpu_ms_per_s"], 0),
            str(r["idle_lookups_per_s"]),
        ]
        for r in payload["rows"]
    ]
    headers = ["held", "pump ms", "lookups", "release ms", "lookups", "idle cpu ms/s", "idle lookups/s"]
    return head + "\n" + table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return bench_main("bench-admission", lambda: run(args), render, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
