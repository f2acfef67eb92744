"""`make bench-router-tiers`: the router benchmark's workload on the same engines with and without KV tiers.

Two passes in one run, each router in each on freshly started engines (ENGINES tiny-model vLLM CPU
engines, the pool that `bench.router_bench` sizes for the workload): first with the engine pool only, then with a CPU DRAM tier and
an NVMe (fs) tier per engine — vLLM's native offloading with kvstrata's CPU-platform copy worker
(`kvstrata.engine.cpu_offload`), the `--kv-transfer-config` shape the operator renders for `device: cpu`.
Every router of `--routers` runs every seed in both passes. Hit rates come from the engines' own counters:
the pool's (`vllm:prefix_cache_hits_total`) and the tiers' (`prompt_tokens_cached_by_source_total`
host/disk), each as a share of all queried prompt tokens; TTFT from the client.

Engines share the cores here (no CFS quota as in bench-router's default): both passes alike. The fs tier
here is unbounded (no janitor: a bench run writes a few hundred MB at most) and lives in
`<workdir>/kv-cache/engine-<i>`, emptied before each router's engines start.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from bench.procs import BenchError, ProcGroup, bench_main
from bench.report import fmt, machine, table
from bench.router_bench import (
    ENGINE_EXTRA_ARGS,
    ENGINES,
    MODEL,
    _engine_blocks,
    _run_router,
    _summarize,
    _workload,
    _workload_info,
    parse_args,
)
from bench.routers import RouterConfig, Worker
from kvstrata.controller.hitrate import Counters, HitRates
from kvstrata.controller.promtext import parse_engine
from kvstrata.planner.flags import ENGINE_PYTHONPATH, unpinned_omp_env

CONFIGS = ("pool only", "pool + cpu + nvme")


def tier_args(cpu_bytes: int, root: Path) -> list[str]:
    """The offloading flags for one engine (as planner/flags.py renders them for device cpu)."""
    cfg = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": "kvstrata.engine.cpu_offload",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(root),
                    "n_read_threads": 2,
                    "n_write_threads": 2,
                    "enable_kv_events": True,
                }
            ],
        },
    }
    return ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]


def _counters(engines: list[Any]) -> Counters:
    total = Counters()
    for e in engines:
        total = total + parse_engine(e.metrics()).counters
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from kvstrata_dev.testing.engines import (
        VllmEngine,
        free_port,
        rebind_engine_env,
        start_all,
        stop_all,
    )
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    model_dir = ensure_tiny_model(default_tiny_model_dir())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    workloads = [_workload(seed, args, tok) for seed in args.seeds]
    blocks, max_len = _engine_blocks(
        max(w.info["working_set_blocks"] for w in workloads),
        max(w.info["longest_prompt_tokens"] for w in workloads),
        args,
    )
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    ready_s: dict[str, float] = {}
    for config in CONFIGS:
        tiered = config != CONFIGS[0]
        roots = [args.workdir / "kv-cache" / f"engine-{i}" for i in range(ENGINES)]

        def make(i: int, tiered: bool = tiered, roots: list[Path] = roots) -> VllmEngine:
            extra = list(ENGINE_EXTRA_ARGS)
            env = unpinned_omp_env(1)
            if tiered:
                extra += tier_args(args.cpu_tier_mib << 20, roots[i])
                # The engine image's copy of kvstrata's engine package is this checkout's operator/.
                env.update(rebind_engine_env({"PYTHONPATH": ENGINE_PYTHONPATH}))
            return VllmEngine(
                model_dir,
                port=free_port(),
                kv_events_port=free_port(),
                kv_replay_port=free_port(),
                log_path=args.workdir / "logs" / f"{'tiered' if tiered else 'pool'}-engine-{i}.log",
                block_size=args.block_size,
                num_gpu_blocks_override=blocks,
                max_model_len=max_len,
                served_model_name=MODEL,
                extra_args=extra,
                env=env,
            )

        cfg = RouterConfig(model=MODEL, tokenizer_dir=model_dir, block_size=args.block_size)
        for name in routers:
            # Fresh engines per router: POST /reset_prefix_cache empties the pool but not the CPU tier
            # (bench-tier-credit), so a later router would find an earlier one's blocks there.
            if tiered:
                for root in roots:
                    shutil.rmtree(root, ignore_errors=True)
                    root.mkdir(parents=True)
            started = time.monotonic()
            engines = start_all([make(i) for i in range(ENGINES)], timeout=900, remake=make)
            ready_s[f"{name} [{config}]"] = round(time.monotonic() - started, 1)
            print(
                f"{config}: {ENGINES} engines for {name} ready in {time.monotonic() - started:.0f} s",
                flush=True,
            )
            try:
                workers = [Worker(e.base_url, e.kv_events_endpoint, e.kv_replay_endpoint) for e in engines]
                with ProcGroup(args.workdir / "logs") as procs:
                    rounds, before = [], _counters(engines)
                    for w in workloads:
                        print(f"- {config}: {name}, seed {w.seed}", flush=True)
                        outcome = _run_router(procs, name, workers, cfg, engines, w, args)
                        if isinstance(outcome, dict):
                            raise BenchError(f"{name} ({config}): {outcome['problem']}")
                        rounds.append(outcome)
                    rates = HitRates.of(_counters(engines) - before)
                    row = _summarize(f"{name} [{config}]", rounds)
                    row["tier_hit_rates"] = {t: rates.tier_hit_rates[t] for t in ("gpu", "cpu", "nvme")}
                    row["all_tier_hit_rate"] = rates.hit_rate
                    results.append(row)
            finally:
                stop_all(engines)
    return {
        "benchmark": "router-tiers",
        "machine": machine(),
        "engines": {"count": ENGINES, "blocks_each": blocks, "max_model_len": max_len, "ready_s": ready_s},
        "tiers": {"cpu_mib": args.cpu_tier_mib, "nvme": "fs tier, unbounded, one directory per engine"},
        "workload": _workload_info(workloads, args),
        "results": results,
        "total_s": round(time.monotonic() - t0, 1),
    }


def _pct(x: float | None) -> str:
    return fmt(None if x is None else 100 * x)


def render(payload: dict[str, Any]) -> str:
    headers = ["router [engines]", "hit % all", "gpu", "cpu", "nvme", "TTFT p50", "p99", "mean", "errors"]
    rows = []
    for r in payload["results"]:
        t, tiers = r["ttft_ms"], r["tier_hit_rates"]
        rows.append(
            [
                r["router"],
                _pct(r["all_tier_hit_rate"]),
                _pct(tiers["gpu"]),
                _pct(tiers["cpu"]),
                _pct(tiers["nvme"]),
                fmt(t["p50"], 0),
                fmt(t["p99"], 0),
                fmt(t["mean"], 0),
                str(r["errors"]),
            ]
        )
    e, w = payload["engines"], payload["workload"]
    head = (
        f"router benchmark with and without KV tiers: {w['requests']} requests per seed (seeds "
        f"{','.join(map(str, w['seeds']))}), {e['count']} vLLM CPU engines x {e['blocks_each']} blocks, "
        f"CPU tier {payload['tiers']['cpu_mib']} MiB + fs tier per engine in the tiered pass; hit rates are "
        "shares of all prompt tokens by the tier that served them; TTFT in ms"
    )
    return "\n".join([head, table(headers, rows), f"total {payload['total_s']:.0f} s"])


def main(argv: list[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--cpu-tier-mib", type=int, default=32, help="CPU DRAM tier per engine (MiB)")
    known, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    # Not the plain bench's files: both may be kept side by side.
    if "--out" not in rest:
        args.out = Path(".bench/router-tiers.json")
    if "--workdir" not in rest:
        args.workdir = Path(".bench/router-tiers")
    args.cpu_tier_mib = known.cpu_tier_mib
    return bench_main("bench-router-tiers", lambda: run(args), render, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
