"""`make bench-router`: kvstrata and its peers over a family of randomly drawn workloads (bench/family.py).

Per draw: three real vLLM CPU engines start with the KV capacity the draw asks for (a multiple of its
working set), every router runs the draw's workload on them in rotated order with the engines' prefix
caches reset before each, then the engines stop. Hit rates come from the engines' own counters, TTFT
from the client. Per draw the oracle (one infinite cache, prompts in order) is printed beside every
router, and each router's capacity bound (bench.workload.bounded_hit_rate: the best any placement could
do with the cluster's pools, in the order that router's run sent the requests); pooled, kvstrata's paired
differences against each peer (mean ± standard error over draws), split by regime: pressure (capacity <
working set) and rich (≥), and how far each router stays below its bound. The seeds are 1..N; none is
chosen by outcome.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import engine_metrics as em
from bench.client import Result
from bench.cpuquota import CpuQuotas
from bench.family import Draw, conversations, draw, engine_blocks, paired, schedule
from bench.procs import BenchError, ProcGroup, bench_main
from bench.report import fmt, machine, mean, percentile, read_json, table, write_json
from bench.router_bench import (
    ENGINE_EXTRA_ARGS,
    ENGINES,
    MODEL,
    _engine_cpu,
    _Round,
    _run_router,
    _Workload,
    cap_engines,
    resolve_engine_cpu,
    router_metrics_file,
)
from bench.routers import RERUN, RouterConfig, Worker
from bench.workload import bounded_hit_rate, distinct_blocks, ideal_hit_rate

KVSTRATA = "kvstrata/kv-aware"
# vllm-router's round_robin and kv_aware trailed by 25+ points in every earlier run; the best two peers
# keep a 20-draw run within a working day on two cores (BENCH_ROUTERS adds them back).
DEFAULT_ROUTERS = (KVSTRATA, "sglang-router/cache_aware", "vllm-router/cache_aware")
DEFAULT_DRAWS = 20
BLOCK_SIZE = 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.family_bench", description=__doc__.split("\n")[0])
    p.add_argument("--routers", default=os.environ.get("BENCH_ROUTERS", ",".join(DEFAULT_ROUTERS)))
    p.add_argument(
        "--draws",
        type=int,
        default=int(os.environ.get("BENCH_DRAWS") or DEFAULT_DRAWS),
        help="draws of the family, seeds FIRST..FIRST+N-1 (env BENCH_DRAWS, default %(default)s)",
    )
    p.add_argument("--first-seed", type=int, default=int(os.environ.get("BENCH_FIRST_SEED") or 1))
    p.add_argument(
        "--seeds",
        type=_seed_list,
        default=os.environ.get("BENCH_SEEDS") or None,
        help="exactly these seeds, e.g. 1,3,5-7 (instead of --first-seed/--draws; env BENCH_SEEDS)",
    )
    p.add_argument(
        "--engine-cpu",
        type=_engine_cpu,
        default=os.environ.get("BENCH_ENGINE_CPU") or "auto",
        help="CPU cores per engine (CFS quota; auto = 0.6 where cgroups are writable)",
    )
    p.add_argument("--out", type=Path, default=Path(".bench/router-family.json"))
    p.add_argument("--workdir", type=Path, default=Path(".bench/router-family"))
    p.add_argument("--dry-run", action="store_true", help="print the draws and their sizes, run nothing")
    p.add_argument(
        "--report",
        type=Path,
        nargs="+",
        help="print the tables of finished or partial JSONs and exit; several files (runs of other "
        "seed windows) are pooled as one run",
    )
    return p.parse_args(argv)


def _seed_list(raw: str) -> list[int]:
    """``1,3,5-7`` → [1, 3, 5, 6, 7]."""
    seeds: list[int] = []
    try:
        for part in raw.split(","):
            lo, sep, hi = part.strip().partition("-")
            seeds += range(int(lo), int(hi) + 1) if sep else [int(lo)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 1,3,5-7, got {raw!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct seeds, got {raw!r}")
    return seeds


def _is_peer(router: str) -> bool:
    """A router kvstrata is judged against: not kvstrata itself nor a variant of it (an ablation), and
    not a peer's rerun (the best of two runs of one peer is not a router a user could run)."""
    return not router.startswith("kvstrata/") and not router.endswith(f"@{RERUN}")


def _rerun_spread(chosen: list[dict[str, Any]], router: str) -> dict[str, Any]:
    """How far two runs of ``router`` in the same draws are apart (it minus its ``@rerun``)."""
    hit, ratio_mean, ratio_p99 = [], [], []
    for d in chosen:
        rows = {r["router"]: r for r in d["results"]}
        a, b = rows.get(router), rows.get(f"{router}@{RERUN}")
        if a and b and _ok(a) and _ok(b):
            hit.append(100 * (a["hit_rate"] - b["hit_rate"]))
            ratio_mean.append(a["ttft_ms_mean"] / b["ttft_ms_mean"])
            ratio_p99.append(a["ttft_ms_p99"] / b["ttft_ms_p99"])
    if not hit:
        return {"pairs": 0}
    return {
        "pairs": len(hit),
        "hit_points_abs_mean": sum(abs(x) for x in hit) / len(hit),
        "hit_points_abs_max": max(abs(x) for x in hit),
        "ttft_mean_ratio_range": (min(ratio_mean), max(ratio_mean)),
        "ttft_p99_ratio_range": (min(ratio_p99), max(ratio_p99)),
    }


def _losses_beyond_rerun(chosen: list[dict[str, Any]], routers: list[str]) -> tuple[int, int] | None:
    """Of the draws where kvstrata's hit rate is below the best peer's: how many there are, and in how
    many the gap is larger than the larger of the two routers' rerun differences in that draw. None
    when no draw has both reruns."""
    losses = beyond = 0
    seen = False
    for d in chosen:
        rows = {r["router"]: r for r in d["results"] if _ok(r) and r["router"] in routers}
        mine = rows.get(KVSTRATA)
        peers = [r for r in rows.values() if _is_peer(r["router"])]
        if mine is None or not peers:
            continue
        best = max(peers, key=lambda r: r["hit_rate"])
        reruns = [rows.get(f"{n}@{RERUN}") for n in (KVSTRATA, best["router"])]
        if reruns[0] is None or reruns[1] is None:
            continue
        seen = True
        gap = best["hit_rate"] - mine["hit_rate"]
        if gap > 0:
            losses += 1
            noise = max(
                abs(mine["hit_rate"] - reruns[0]["hit_rate"]), abs(best["hit_rate"] - reruns[1]["hit_rate"])
            )
            beyond += gap > noise
    return (losses, beyond) if seen else None


@dataclass(frozen=True)
class Prepared:
    draw: Draw
    workload: _Workload
    blocks: int
    max_len: int
    info: dict[str, Any]
    # Token ids per conversation and turn, as the engines see them (for the capacity bound).
    ids: list[list[list[int]]]


def prepare(d: Draw, tok: Any) -> Prepared:
    """The draw's prompts, their token ids (as the engines will see them), working set and oracle."""
    convs = conversations(d, lambda text: len(tok.tokenizer.encode(text, add_special_tokens=False).ids))
    ids = [
        [
            tok.encode_chat(c.messages(k)) if d.api == "chat" else tok.encode_completion(c.prompt(k))
            for k in range(len(c.turns))
        ]
        for c in convs
    ]
    token_lists = [t for conv in ids for t in conv]
    in_order = [conv[k] for k in range(d.turns) for conv in ids]
    working_set = distinct_blocks(token_lists, BLOCK_SIZE)
    longest = max(len(t) for t in token_lists) + d.max_tokens
    blocks = engine_blocks(d, working_set, longest, BLOCK_SIZE, ENGINES)
    max_len = min(4096, (blocks - 1) * BLOCK_SIZE)
    if max_len < longest:
        raise BenchError(f"draw {d.seed}: longest request needs {longest} tokens, max model len {max_len}")
    info = {
        **{k: v for k, v in vars(d).items() if k != "scaled"},
        "scaled": list(d.scaled),
        "requests": len(token_lists),
        "prompt_tokens_total": sum(len(t) for t in token_lists),
        "longest_request_tokens": longest,
        "working_set_blocks": working_set,
        "blocks_each": blocks,
        # The capacity the engines really got (the floor can raise it above the drawn ratio).
        "capacity_actual": round(blocks * ENGINES / working_set, 3),
        "oracle_hit_rate": round(ideal_hit_rate(in_order, BLOCK_SIZE), 4),
    }
    workload = _Workload(d.seed, [c.scripted(d.api) for c in convs], schedule(d), info)
    return Prepared(d, workload, blocks, max_len, info, ids)


def regime(p: Prepared) -> str:
    return "pressure" if p.info["capacity_actual"] < 1.0 else "rich"


def own_order_bound(p: Prepared, results: list[Result]) -> float:
    """The capacity bound (bench.workload.bounded_hit_rate) of the requests a router served, in the
    order it sent them: that order depends on the router's own speed (closed loops, think times), and a
    cache's best hit rate depends on the order, so each router is held to the bound of its own run. The
    cluster's capacity is every engine's pool less the null block vLLM keeps."""
    served = sorted((r for r in results if r.ok), key=lambda r: r.start_s)
    token_lists = [p.ids[r.cid][r.turn] for r in served]
    return bounded_hit_rate(token_lists, BLOCK_SIZE, ENGINES * (p.blocks - 1))


def _row(name: str, rnd: _Round | dict[str, Any], metrics: Path, p: Prepared) -> dict[str, Any]:
    if isinstance(rnd, dict):
        return rnd
    ok = [r for r in rnd.results if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    return {
        "router": name,
        "requests": len(rnd.results),
        "errors": sum(not r.ok for r in rnd.results),
        "error_samples": sorted({r.error for r in rnd.results if r.error})[:3],
        "hit_rate": em.cluster_hit_rate(rnd.rows),
        "bound_hit_rate": round(own_order_bound(p, rnd.results), 4),
        "ttft_ms_mean": mean(ttft),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "per_engine_requests": [int(r.requests) for r in rnd.rows],
        "split_max_over_mean": em.split_imbalance(rnd.rows),
        "preemptions": sum(r.preemptions for r in rnd.rows),
        # Per request, what the engine found cached (usage.prompt_tokens_details): the ground truth a
        # router's own prediction (kvstrata_router_predicted_cached_tokens_total) is compared with.
        "cached_tokens_reported": sum(r.cached_tokens or 0 for r in ok),
        "prompt_tokens_reported": sum(r.prompt_tokens or 0 for r in ok),
        "router_counters": _router_counters(metrics.read_text().splitlines() if metrics.exists() else []),
        "wall_s": round(rnd.wall_s, 1),
        "router_cpu_s": round(rnd.router_cpu_s, 2),
        # Every request, in the order sent: a draw's p99 is its slowest one or two, and which request
        # that was (a conversation's first turn, a follow-up, when in the run) is what explains it.
        "per_request": [r.record() for r in sorted(rnd.results, key=lambda r: r.start_s)],
    }


_COUNTERS = (
    "kvstrata_router_predicted_cached_tokens_total",
    "kvstrata_router_actual_cached_tokens_total",
)


def _router_counters(lines: list[str]) -> dict[str, float]:
    """kvstrata's predicted vs actual cached tokens, and the KV events by type (evictions per engine
    show as BlockRemoved), from the router's /metrics scraped at the end of the run."""
    out: dict[str, float] = {}
    for line in lines:
        if line.startswith(_COUNTERS) or (
            line.startswith("kvstrata_router_kv_events_total") and "Block" in line
        ):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.router.prompts import LocalTokenizer
    from kvstrata_dev.testing.engines import EngineError, start_engines, stop_all, vllm_python
    from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    model_dir = ensure_tiny_model(default_tiny_model_dir())
    tok = LocalTokenizer(model_dir)
    seeds = args.seeds or range(args.first_seed, args.first_seed + args.draws)
    prepared = [prepare(draw(s), tok) for s in seeds]
    for p in prepared:
        print(
            f"{p.draw.label()}\n    {p.info['requests']} requests, {p.info['prompt_tokens_total']} prompt tokens, "
            f"working set {p.info['working_set_blocks']} blocks, engines {ENGINES} x {p.blocks} blocks "
            f"({p.info['capacity_actual']:.2f}x, {regime(p)}), oracle hit {100 * p.info['oracle_hit_rate']:.1f}%",
            flush=True,
        )
    if args.dry_run:
        return {"benchmark": "router-family", "dry_run": True, "draws": [p.info for p in prepared]}
    try:
        vllm_python()
    except EngineError as exc:
        raise BenchError(str(exc)) from None
    cpu_each, uncapped_why = resolve_engine_cpu(args.engine_cpu)
    if uncapped_why:
        print(f"engines share the cores (not capped: {uncapped_why})", flush=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    machine_info = machine()
    t0 = time.monotonic()
    draws_out: list[dict[str, Any]] = []
    payload: dict[str, Any] = {}
    for k, p in enumerate(prepared):
        print(f"draw {k + 1}/{len(prepared)} (seed {p.draw.seed}, {regime(p)})", flush=True)
        engines = start_engines(
            ENGINES,
            model_dir,
            kv_events=True,
            kv_replay=True,
            log_dir=args.workdir / "logs" / f"seed{p.draw.seed}",
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=p.blocks,
            max_model_len=p.max_len,
            served_model_name=MODEL,
            extra_args=ENGINE_EXTRA_ARGS,
        )
        quotas = CpuQuotas(cpu_each) if cpu_each else None
        rows: dict[str, dict[str, Any]] = {}
        try:
            if quotas is not None:
                cap_engines(quotas, engines, cpu_each)
            workers = [Worker(e.base_url, e.kv_events_endpoint, e.kv_replay_endpoint) for e in engines]
            cfg = RouterConfig(
                model=MODEL, tokenizer_dir=model_dir, block_size=BLOCK_SIZE, log_decisions=True
            )
            run_args = argparse.Namespace(
                max_tokens=p.draw.max_tokens, concurrency=p.draw.concurrency, workdir=args.workdir
            )
            with ProcGroup(args.workdir / "logs" / f"seed{p.draw.seed}") as procs:
                # Rotate: the machine's load drifts, so no router always goes first.
                for name in routers[k % len(routers) :] + routers[: k % len(routers)]:
                    print(f"- {name}", flush=True)
                    outcome = _run_router(procs, name, workers, cfg, engines, p.workload, run_args)
                    rows[name] = _row(name, outcome, router_metrics_file(args.workdir, name), p)
        finally:
            if quotas is not None:
                quotas.close()
            stop_all(engines)
        draws_out.append({**p.info, "regime": regime(p), "results": [rows[n] for n in routers if n in rows]})
        payload = {
            "benchmark": "router-family",
            "machine": {**machine_info, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
            "engines": {
                "count": ENGINES,
                "block_size": BLOCK_SIZE,
                "cpu_each": cpu_each or None,
                "cpu_shared_because": uncapped_why,
                "extra_args": list(ENGINE_EXTRA_ARGS),
                "vllm": "0.32.0 CPU",
            },
            "routers": routers,
            "draws_planned": len(prepared),
            "draws": draws_out,
            "pooled": pooled(draws_out, routers),
            "total_s": round(time.monotonic() - t0, 1),
        }
        # A run of many draws takes hours: what is done so far survives a stop, and shows progress.
        write_json(partial_path(args.out), payload)
        print(render(payload), flush=True)
    return payload


def partial_path(out: Path) -> Path:
    return out.with_name(out.stem + ".partial.json")


def _ok(row: dict[str, Any]) -> bool:
    return "problem" not in row and row.get("hit_rate") is not None and row.get("ttft_ms_mean") is not None


def _kvstrata_and_peers(d: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """A draw's kvstrata row and its peers' rows, those that ran well; None without either."""
    oks = [r for r in d["results"] if _ok(r)]
    mine = next((r for r in oks if r["router"] == KVSTRATA), None)
    peers = [r for r in oks if _is_peer(r["router"])]
    return None if mine is None or not peers else (mine, peers)


def pooled(draws: list[dict[str, Any]], routers: list[str]) -> dict[str, Any]:
    """Per regime (and all draws): kvstrata minus each peer, paired per draw, mean ± SE; and the share
    of draws where kvstrata's hit rate ≥ the best peer's."""
    out: dict[str, Any] = {}
    for name in ("pressure", "rich", "all"):
        chosen = [d for d in draws if name == "all" or d["regime"] == name]
        section: dict[str, Any] = {"draws": len(chosen), "vs": {}}
        for peer in routers:
            if peer == KVSTRATA:
                continue
            hit, ratio_mean, ratio_p99 = [], [], []
            for d in chosen:
                rows = {r["router"]: r for r in d["results"]}
                mine, theirs = rows.get(KVSTRATA), rows.get(peer)
                if not mine or not theirs or not _ok(mine) or not _ok(theirs):
                    continue
                hit.append(100 * (mine["hit_rate"] - theirs["hit_rate"]))
                ratio_mean.append(mine["ttft_ms_mean"] / theirs["ttft_ms_mean"])
                ratio_p99.append(mine["ttft_ms_p99"] / theirs["ttft_ms_p99"])
            section["vs"][peer] = {
                "pairs": len(hit),
                "hit_points": paired(hit),
                "ttft_mean_ratio": paired(ratio_mean),
                "ttft_p99_ratio": paired(ratio_p99),
                "hit_ge_peer_draws": sum(x >= 0 for x in hit),
            }
        # Against the best peer of each draw, figure by figure: the highest hit rate, the lowest TTFTs.
        best_hit, best_mean, best_p99 = [], [], []
        for d in chosen:
            if (pair := _kvstrata_and_peers(d)) is None:
                continue
            mine, peers = pair
            best = max(r["hit_rate"] for r in peers)
            best_hit.append(100 * (mine["hit_rate"] - best))
            best_mean.append(mine["ttft_ms_mean"] / min(r["ttft_ms_mean"] for r in peers))
            best_p99.append(mine["ttft_ms_p99"] / min(r["ttft_ms_p99"] for r in peers))
        section["vs_best_peer_hit_points"] = paired(best_hit)
        section["vs_best_peer_ttft_mean_ratio"] = paired(best_mean)
        section["vs_best_peer_ttft_p99_ratio"] = paired(best_p99)
        yardstick = _every_draw_yardstick(chosen)
        section["every_draw_yardstick"] = yardstick
        section["hit_ge_best_peer_draws"] = yardstick.get(KVSTRATA, {}).get("hit_ge_best_other", 0)
        section["rerun_spread"] = {r: _rerun_spread(chosen, r) for r in routers if f"{r}@{RERUN}" in routers}
        section["hit_losses_beyond_rerun"] = _losses_beyond_rerun(chosen, routers)
        section["below_bound_points"] = {r: _below_bound(chosen, r) for r in routers}
        section["by_admission"] = _by_admission(chosen)
        section["follow_ups_by_move"] = _by_move(chosen)
        section["errors"] = {
            r: sum(row.get("errors", 0) for d in chosen for row in d["results"] if row["router"] == r)
            for r in routers
        }
        out[name] = section
    return out


def _every_draw_yardstick(chosen: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Issue 14's per-draw goals held to every router alike: for kvstrata and each peer, the draws in
    which its hit rate is at least the best of the others' and in which it is no worse than the best of
    the others on every figure (hit rate, TTFT mean, p99), each figure's best taken separately. The best
    of two noisy routers, figure by figure, is a bar that an equal router clears in about a third of the
    draws per figure; this says how often each router clears it, kvstrata's peers included."""
    out: dict[str, dict[str, int]] = {}
    for d in chosen:
        oks = [r for r in d["results"] if _ok(r) and (r["router"] == KVSTRATA or _is_peer(r["router"]))]
        for me in oks:
            others = [r for r in oks if r is not me]
            if not others:
                continue
            hit = me["hit_rate"] >= max(r["hit_rate"] for r in others)
            tally = out.setdefault(
                me["router"], {"draws": 0, "hit_ge_best_other": 0, "no_worse_on_every_figure": 0}
            )
            tally["draws"] += 1
            tally["hit_ge_best_other"] += hit
            tally["no_worse_on_every_figure"] += (
                hit
                and me["ttft_ms_mean"] <= min(r["ttft_ms_mean"] for r in others)
                and me["ttft_ms_p99"] <= min(r["ttft_ms_p99"] for r in others)
            )
    return out


Request = dict[str, Any]
# Which group a kvstrata request is counted in (None: none), given it and the draw's kvstrata requests
# by (conversation, turn).
Grouping = Callable[[Request, dict[tuple[int, int], Request]], str | None]


def _admission(q: Request, _mine: dict[tuple[int, int], Request]) -> str:
    return (q.get("router") or {}).get("admission") or "unknown"


def _move(q: Request, mine: dict[tuple[int, int], Request]) -> str | None:
    """A follow-up's group: whether it went to another engine than its conversation's previous turn."""
    before = mine.get((q["cid"], q["turn"] - 1)) if q["turn"] > 0 else None
    if before is None:
        return None
    here, there = ((r.get("router") or {}).get("endpoint") for r in (q, before))
    return None if not here or not there else "stayed" if here == there else "moved"


def _by_admission(chosen: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """kvstrata's requests grouped by how its admission gate let them go (``x-kvstrata-admission``:
    direct, queued, stolen, ...). The draw's figures say whether kvstrata lost; this says which of its
    requests lost it (a held request's wait, a stolen one's cold prefill)."""
    return _beside_best_peer(chosen, _admission)


def _by_move(chosen: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """kvstrata's follow-ups grouped by whether they went to the engine of their conversation's previous
    turn (``x-kvstrata-endpoint``). The peers never move a conversation; a move trades the prefix left
    at the old engine for the chance of a shorter wait at the new one, and this says what each side paid."""
    return _beside_best_peer(chosen, _move)


def _beside_best_peer(chosen: list[dict[str, Any]], group: Grouping) -> dict[str, dict[str, float]]:
    """kvstrata's requests in the groups ``group`` puts them in, each beside the same request
    (conversation and turn) through the peer with the lowest TTFT mean in its draw: how many, their
    mean TTFT, and the share of their prompt tokens the engine found cached, on both routers."""
    sums: dict[str, list[float]] = {}  # kind -> [requests, ttft, peer ttft, cached, peer cached, prompt]
    for d in chosen:
        if (pair := _kvstrata_and_peers(d)) is None or not pair[0].get("per_request"):
            continue
        mine, peers = pair
        best = min(peers, key=lambda r: r["ttft_ms_mean"])
        theirs = {
            (q["cid"], q["turn"]): q for q in best.get("per_request") or [] if q.get("ttft_ms") is not None
        }
        by_turn = {(q["cid"], q["turn"]): q for q in mine["per_request"]}
        for q in mine["per_request"]:
            other = theirs.get((q["cid"], q["turn"]))
            if q.get("ttft_ms") is None or other is None or (kind := group(q, by_turn)) is None:
                continue
            s = sums.setdefault(kind, [0.0] * 6)
            s[0] += 1
            s[1] += q["ttft_ms"]
            s[2] += other["ttft_ms"]
            s[3] += q.get("cached_tokens") or 0
            s[4] += other.get("cached_tokens") or 0
            s[5] += q.get("prompt_tokens") or 0
    total = sum(s[0] for s in sums.values())
    return {
        kind: {
            "requests": int(n),
            "share": n / total,
            "ttft_ms": ttft / n,
            "peer_ttft_ms": peer_ttft / n,
            "cached_share": cached / prompt if prompt else 0.0,
            "peer_cached_share": peer_cached / prompt if prompt else 0.0,
        }
        for kind, (n, ttft, peer_ttft, cached, peer_cached, prompt) in sorted(
            sums.items(), key=lambda kv: -kv[1][0]
        )
    }


def _below_bound(chosen: list[dict[str, Any]], router: str) -> tuple[float, float] | None:
    """How far ``router``'s hit rate stays below the capacity bound of its own runs (points, mean ±
    SE over the draws that have one): what better placement could still win, capacity taken out."""
    gaps = [
        100 * (r["bound_hit_rate"] - r["hit_rate"])
        for d in chosen
        for r in d["results"]
        if r["router"] == router and _ok(r) and r.get("bound_hit_rate") is not None
    ]
    return paired(gaps)


def _pm(x: tuple[float, float] | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x[0]:+.{digits}f} ± {x[1]:.{digits}f}"


def combine(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of different seed windows as one: their draws by seed, pooled again, over the routers every
    run has (the others are named in ``left_out``: a variant one run added is not pooled with draws
    that never ran it). A seed run twice is refused rather than counted twice or picked by outcome."""
    if len(payloads) == 1:  # pooled again: a file written before a figure was added gets it too
        return {**payloads[0], "pooled": pooled(payloads[0]["draws"], payloads[0]["routers"])}
    routers = [r for r in payloads[0]["routers"] if all(r in p["routers"] for p in payloads)]
    if KVSTRATA not in routers or len(routers) < 2:
        raise SystemExit(f"--report: the runs share no comparison of {KVSTRATA} with another router")
    left_out = sorted({r for p in payloads for r in p["routers"]} - set(routers))
    draws = sorted(
        (
            {**d, "results": [row for row in d["results"] if row["router"] in routers]}
            for p in payloads
            for d in p["draws"]
        ),
        key=lambda d: d["seed"],
    )
    seeds = [d["seed"] for d in draws]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--report: a seed appears in more than one run: {seeds}")
    return {
        **payloads[0],
        "routers": routers,
        "left_out": left_out,
        "draws_planned": sum(p["draws_planned"] for p in payloads),
        "draws": draws,
        "pooled": pooled(draws, routers),
        "total_s": sum(p["total_s"] for p in payloads),
        "runs": [p["machine"] for p in payloads],
    }


def render(payload: dict[str, Any]) -> str:
    if payload.get("dry_run"):
        return f"{len(payload['draws'])} draws (dry run)"
    routers = payload["routers"]
    lines = [
        f"router family benchmark, {len(payload['draws'])} of {payload.get('draws_planned', len(payload['draws']))} draws: per draw, "
        "hit % / TTFT mean / p99 ms / errors / split (max/mean)"
    ]
    if payload.get("left_out"):
        lines.append(f"(not in every run, so not pooled: {', '.join(payload['left_out'])})")
    rows = []
    for d in payload["draws"]:
        cells = []
        by = {r["router"]: r for r in d["results"]}
        for name in routers:
            r = by.get(name)
            if r is None or not _ok(r):
                cells.append("FAILED" if r else "-")
                continue
            cells.append(
                f"{fmt(100 * r['hit_rate'])} / {fmt(r['ttft_ms_mean'], 0)} / {fmt(r['ttft_ms_p99'], 0)} / "
                f"{r['errors']} / {fmt(r['split_max_over_mean'], 2)}"
            )
        kv = by.get(KVSTRATA) or {}
        counters = kv.get("router_counters") or {}
        predicted = counters.get("kvstrata_router_predicted_cached_tokens_total")
        reported = kv.get("prompt_tokens_reported")
        pred_actual = (
            f"{100 * predicted / reported:.0f} / {100 * kv['cached_tokens_reported'] / reported:.0f}"
            if predicted is not None and reported
            else "-"
        )
        bound = kv.get("bound_hit_rate")
        rows.append(
            [
                f"{d['seed']} {d['regime'][:5]} {d['capacity_actual']:.2f}x {d['api'][:4]} {d['arrival'][:5]} "
                f"{d['tenants']}t",
                fmt(100 * d["oracle_hit_rate"]),
                "-" if bound is None else fmt(100 * bound),
                *cells,
                pred_actual,
            ]
        )
    lines.append(
        table(
            [
                "draw (seed regime capacity api arrival tenants)",
                "oracle %",
                "kvstrata bound %",
                *routers,
                "kvstrata pred/actual %",
            ],
            rows,
        )
    )
    for regime_name, sec in payload["pooled"].items():
        lines.append(
            f"{regime_name}: {sec['draws']} draws; kvstrata hit ≥ best peer in {sec['hit_ge_best_peer_draws']}, "
            f"vs best peer {_pm(sec['vs_best_peer_hit_points'])} points, TTFT mean ratio "
            f"{_pm(sec.get('vs_best_peer_ttft_mean_ratio'), 2)}, p99 ratio "
            f"{_pm(sec.get('vs_best_peer_ttft_p99_ratio'), 2)}; errors {sec['errors']}"
        )
        for peer, v in sec["vs"].items():
            lines.append(
                f"  vs {peer} ({v['pairs']} pairs): hit {_pm(v['hit_points'])} points, TTFT mean ratio "
                f"{_pm(v['ttft_mean_ratio'], 2)}, p99 ratio {_pm(v['ttft_p99_ratio'], 2)}"
            )
        for name, aa in (sec.get("rerun_spread") or {}).items():
            if aa["pairs"]:
                lo_mean, hi_mean = aa["ttft_mean_ratio_range"]
                lo_p99, hi_p99 = aa["ttft_p99_ratio_range"]
                lines.append(
                    f"  {name} against its rerun ({aa['pairs']} draws): hit differs by "
                    f"{aa['hit_points_abs_mean']:.1f} points on average, {aa['hit_points_abs_max']:.1f} at most; "
                    f"TTFT mean ratio {lo_mean:.2f}-{hi_mean:.2f}, p99 ratio {lo_p99:.2f}-{hi_p99:.2f}"
                )
        below = {r: v for r, v in (sec.get("below_bound_points") or {}).items() if v is not None}
        if below:
            lines.append(
                "  hit below the capacity bound of its own run: "
                + ", ".join(f"{r} {_pm(v)} points" for r, v in below.items())
            )
        yardstick = sec.get("every_draw_yardstick") or {}
        if len(yardstick) > 1:
            lines.append(
                "  each router against the best of the others, draw by draw: "
                + "; ".join(
                    f"{r} hit ≥ in {v['hit_ge_best_other']} of {v['draws']}, no worse on every figure in "
                    f"{v['no_worse_on_every_figure']}"
                    for r, v in yardstick.items()
                )
            )
        for key, what in (
            ("by_admission", "kvstrata's requests by admission"),
            (
                "follow_ups_by_move",
                "kvstrata's follow-ups by engine (stayed with the previous turn's or moved)",
            ),
        ):
            if kinds := sec.get(key):
                lines.append(
                    f"  {what}, against the same requests through the best peer (TTFT mean ms, cached % of "
                    "prompt): "
                    + "; ".join(
                        f"{kind} {v['requests']} ({100 * v['share']:.0f} %) {v['ttft_ms']:.0f} against "
                        f"{v['peer_ttft_ms']:.0f}, {100 * v['cached_share']:.1f} against "
                        f"{100 * v['peer_cached_share']:.1f}"
                        for kind, v in kinds.items()
                    )
                )
        beyond = sec.get("hit_losses_beyond_rerun")
        if beyond is not None:
            lines.append(
                f"  kvstrata's hit rate below the best peer's in {beyond[0]} draws; in {beyond[1]} of them by "
                "more than either router differs from its own rerun"
            )
    lines.append(f"total {payload['total_s']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(render(combine([read_json(path) for path in args.report])))
        return 0
    return bench_main("bench-router", lambda: run(args), render, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
