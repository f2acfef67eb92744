"""`make bench-tier-credit`: what a prefix hit on each KV tier saves, measured on a real tiered engine.

The router credits a cached block by the tier that holds it (`tierWeights`: the share of the block's
prefill a hit there saves). This measures that share instead of assuming it. One vLLM CPU engine with
the operator's tier flags (`bench.tiers_bench.tier_args`: a CPU DRAM tier and an fs tier); per round, a
fresh prompt P of `--prompt-tokens` tokens (random token ids, so nothing else shares its blocks) is sent
four times, each after pushing it one tier further down with filler prompts:

1. cold: nothing cached;
2. gpu: at once again (the engine's pool holds it);
3. cpu: after fillers that overflow the pool but not the CPU tier;
4. nvme: after fillers that overflow the pool and the CPU tier (the fs tier is unbounded here).

Each send is classified by the engine's own counters (`prompt_tokens_cached_by_source_total`: device,
host, disk), never by where the fillers should have pushed it: a send counts for a tier only when that
tier served at least 90 % of P's cacheable tokens. TTFT is the client's time to the first streamed token
(max_tokens 1). Credit of a tier = (cold − tier) / (cold − gpu), the round's own cold and gpu sends as
the ends of the scale, so a round measures all tiers against the same prompt at the same moment.

Also checked, once: whether `POST /reset_prefix_cache` (which the router benchmarks call between routers)
empties the CPU and fs tiers, or only the pool.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.procs import BenchError, bench_main, http_post
from bench.report import fmt, machine, table
from bench.tiers_bench import tier_args
from kvstrata.controller.hitrate import Counters
from kvstrata.controller.promtext import parse_engine
from kvstrata.planner.arch import architecture_from_hf_config
from kvstrata.planner.kv import kv_bytes_per_token

MODEL = "tiny"
TIERS = ("gpu", "cpu", "nvme")
# The share of P's cacheable tokens a tier must serve for the send to count as that tier's hit.
SERVED_SHARE = 0.9
_SOURCE = {"gpu": "hits", "cpu": "cpu_hits", "nvme": "nvme_hits"}


def ttft_s(base_url: str, tokens: list[int]) -> float:
    """Seconds to the first streamed token of a completion of ``tokens`` (one output token)."""
    u = urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": MODEL, "prompt": tokens, "max_tokens": 1, "stream": True, "temperature": 0.0})
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"engine answered {resp.status}: {resp.read()[:200]!r}")
        first: float | None = None
        for line in resp:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
        if first is None:
            raise BenchError("the engine streamed no token")
        return first
    finally:
        conn.close()


def served_by(delta: Counters, cacheable: int) -> str | None:
    """The tier that served at least SERVED_SHARE of the prompt's cacheable tokens, or "cold" when
    none served any; None when the hit was split (not a clean measurement of any one tier)."""
    for tier in TIERS:
        if getattr(delta, _SOURCE[tier]) >= SERVED_SHARE * cacheable:
            return tier
    if all(getattr(delta, f) == 0 for f in _SOURCE.values()):
        return "cold"
    return None


def credit(cold: float, gpu: float, tier: float) -> float | None:
    """The share of the prefill a hit on ``tier`` saved, on the scale cold (0) → gpu (1)."""
    return (cold - tier) / (cold - gpu) if cold > gpu else None


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.planner.flags import ENGINE_PYTHONPATH, unpinned_omp_env
    from kvstrata_dev.testing.engines import (
        VllmEngine,
        engine_dtype,
        free_port,
        rebind_engine_env,
        start_all,
        stop_all,
    )
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    model_dir = ensure_tiny_model(default_tiny_model_dir())
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    bs = args.block_size
    p_blocks = args.prompt_tokens // bs
    if p_blocks < 2 or args.pool_blocks < 2 * p_blocks + 2:
        raise BenchError("--pool-blocks must hold two prompts of --prompt-tokens")
    # Fillers: enough blocks to push P out of the pool (and then the CPU tier), in prompts of P's size.
    block_bytes = kv_bytes_per_token(architecture_from_hf_config(config), "auto", engine_dtype()) * bs
    cpu_blocks = (args.cpu_tier_mib << 20) // block_bytes
    fill_pool = -(-(args.pool_blocks + p_blocks) // p_blocks)
    fill_cpu = -(-(args.pool_blocks + cpu_blocks + p_blocks) // p_blocks)
    root = args.workdir / "kv-cache"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = unpinned_omp_env(1)
    env.update(rebind_engine_env({"PYTHONPATH": ENGINE_PYTHONPATH}))
    engine = VllmEngine(
        model_dir,
        port=free_port(),
        kv_events_port=free_port(),
        kv_replay_port=free_port(),
        log_path=args.workdir / "logs" / "tiered-engine.log",
        block_size=bs,
        num_gpu_blocks_override=args.pool_blocks,
        max_model_len=(args.pool_blocks - 1) * bs,
        served_model_name=MODEL,
        extra_args=tier_args(args.cpu_tier_mib << 20, root),
        env=env,
    )
    t0 = time.monotonic()
    (engine,) = start_all([engine], timeout=900)
    print(f"engine ready in {time.monotonic() - t0:.0f} s", flush=True)
    rng = random.Random(args.seed)
    cacheable = (args.prompt_tokens - 1) // bs * bs  # vLLM recomputes the last token at least

    def counters() -> Counters:
        return parse_engine(engine.metrics()).counters

    def send(tokens: list[int]) -> tuple[float, str | None]:
        before = counters()
        t = ttft_s(engine.base_url, tokens)
        return t, served_by(counters() - before, cacheable)

    def fill(n: int) -> None:
        for _ in range(n):
            ttft_s(engine.base_url, _prompt(rng, args.prompt_tokens, vocab))

    rounds: list[dict[str, Any]] = []
    reset: dict[str, Any] = {}
    try:
        fill(2)  # warm-up: first requests pay one-time costs
        for r in range(args.rounds):
            p = _prompt(rng, args.prompt_tokens, vocab)
            row: dict[str, Any] = {}
            for tier, filler in (("cold", 0), ("gpu", 0), ("cpu", fill_pool), ("nvme", fill_cpu)):
                fill(filler)
                t, source = send(p)
                row[tier] = {"ttft_s": t, "served_by": source}
            rounds.append(row)
            print(
                f"round {r + 1}/{args.rounds}: "
                + ", ".join(f"{k} {v['ttft_s'] * 1000:.0f} ms ({v['served_by']})" for k, v in row.items()),
                flush=True,
            )
        # reset_prefix_cache: P cached on every tier, then reset, then P again.
        p = _prompt(rng, args.prompt_tokens, vocab)
        send(p)
        status, body = http_post(engine.base_url + "/reset_prefix_cache", b"")
        _, after_reset = send(p)
        reset = {"status": status, "body": body[:200].decode(errors="replace"), "then_served_by": after_reset}
    finally:
        stop_all([engine])
    return {
        "benchmark": "tier-credit",
        "machine": machine(),
        "engine": {
            "pool_blocks": args.pool_blocks,
            "block_size": bs,
            "block_bytes": block_bytes,
            "cpu_tier_mib": args.cpu_tier_mib,
            "cpu_tier_blocks": cpu_blocks,
            "nvme": "fs tier, unbounded",
        },
        "prompt_tokens": args.prompt_tokens,
        "fillers": {"cpu": fill_pool, "nvme": fill_cpu},
        "seed": args.seed,
        "rounds": rounds,
        "reset_prefix_cache": reset,
        "total_s": round(time.monotonic() - t0, 1),
    }


def summarize(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per tier: clean sends, median TTFT, and the median and spread of the per-round credit."""
    out: dict[str, dict[str, Any]] = {}
    for tier in ("cold", *TIERS):
        clean = [r for r in payload["rounds"] if r[tier]["served_by"] == tier]
        credits = []
        for r in clean:
            if r["cold"]["served_by"] == "cold" and r["gpu"]["served_by"] == "gpu":
                c = credit(r["cold"]["ttft_s"], r["gpu"]["ttft_s"], r[tier]["ttft_s"])
                if c is not None:
                    credits.append(c)
        ttfts = [r[tier]["ttft_s"] * 1000 for r in clean]
        out[tier] = {
            "clean": len(clean),
            "ttft_ms_median": statistics.median(ttfts) if ttfts else None,
            "credit_median": statistics.median(credits) if credits else None,
            "credit_min": min(credits, default=None),
            "credit_max": max(credits, default=None),
        }
    return out


def render(payload: dict[str, Any]) -> str:
    from kvstrata.api.router_config import RouterSettings

    weights = RouterSettings(model=MODEL).tier_weights
    configured = {"gpu": weights.gpu, "cpu": weights.cpu, "nvme": weights.storage}
    s = summarize(payload)
    rows = []
    for tier in ("cold", *TIERS):
        t = s[tier]
        rows.append(
            [
                tier,
                f"{t['clean']}/{len(payload['rounds'])}",
                fmt(t["ttft_ms_median"], 1),
                fmt(t["credit_median"], 2),
                f"{fmt(t['credit_min'], 2)} .. {fmt(t['credit_max'], 2)}",
                fmt(configured.get(tier), 2),
            ]
        )
    e = payload["engine"]
    head = (
        f"tier credit: prompts of {payload['prompt_tokens']} tokens on one vLLM CPU engine "
        f"({e['pool_blocks']} pool blocks, CPU tier {e['cpu_tier_mib']} MiB = {e['cpu_tier_blocks']} blocks, "
        f"fs tier); credit = (cold - tier) / (cold - gpu) per round"
    )
    reset = payload["reset_prefix_cache"]
    tail = (
        f"reset_prefix_cache: HTTP {reset.get('status')}; the prompt then came from "
        f"{reset.get('then_served_by')} (cold: the reset emptied every tier)"
    )
    headers = ["served by", "clean", "TTFT median ms", "credit median", "min .. max", "tierWeights"]
    return "\n".join([head, table(headers, rows), tail, f"total {payload['total_s']:.0f} s"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench-tier-credit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--pool-blocks", type=int, default=80, help="The engine's KV pool, in blocks")
    ap.add_argument("--cpu-tier-mib", type=int, default=40, help="CPU DRAM tier (MiB)")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM CPU attention needs a multiple of 32")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1, help="Prompt token ids; fixed, not chosen by outcome")
    ap.add_argument("--out", type=Path, default=Path(".bench/tier-credit.json"))
    ap.add_argument("--workdir", type=Path, default=Path(".bench/tier-credit"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return bench_main("bench-tier-credit", lambda: run(args), render, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
