"""`make bench-proxy`: what each router costs on the data path.

Every router sits in front of the same static nginx backend on loopback (three listen ports = three
"workers"); `wrk` drives POST /v1/completions at a pinned connection count for a pinned duration, first
straight at one backend port (the baseline), then through each router. Non-streaming requests get a
canned completion; streaming requests (`"stream": true`) get a canned SSE stream of SSE_CHUNKS events.
Figures: requests/s, latency p50/p90/p99, latency added over the direct baseline, SSE chunks/s, errors,
and the router's own CPU use. Generator, router and backend share the machine's cores: say so when quoting.

With ``--rounds N`` every router is measured N times per mode, in an order reversed every other round
(ABBA), and each kvstrata router's CPU per request is paired with each peer's of the same round: on a
machine whose neighbours come and go, one row per router minutes apart let the ratio swing from 0.8 to
1.2 between runs of the same code, and a pair measured seconds apart is the comparison that holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import nginx_backend
from bench.family import paired
from bench.procs import BenchError, ProcGroup, bench_main, http_post
from bench.profile import record
from bench.report import alternating, fmt, group_cpu_seconds, machine, table
from bench.routers import RouterConfig, Worker, kvstrata_router_available, start_router
from bench.wrk import UNIQUE, run_wrk, write_script

DEFAULT_ROUTERS = (
    "sglang-router/cache_aware",
    "vllm-router/cache_aware",
    "vllm-router/round_robin",
    "kvstrata/kv-aware",
    "kvstrata/round-robin",
)
# A fixed ~130-token prompt: long enough that prefix-aware routers have something to match.
PROMPT = (
    "You are a careful assistant. Read the following notes about the quarterly maintenance window and "
    "answer in one short sentence. Notes: the storage cluster is drained node by node, each node is "
    "cordoned, its volumes are migrated, firmware is updated, and it is returned to service after a "
    "health check. Question: what happens right before a node returns to service?"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.proxy_bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--routers",
        default=os.environ.get("BENCH_PROXY_ROUTERS", ",".join(DEFAULT_ROUTERS)),
        help="comma-separated <impl>/<policy> list (default: %(default)s)",
    )
    p.add_argument("--connections", type=int, default=int(os.environ.get("BENCH_CONNECTIONS", "64")))
    p.add_argument(
        "--duration",
        type=float,
        default=float(os.environ.get("BENCH_DURATION", "10")),
        help="seconds measured per target and mode",
    )
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of unmeasured load first")
    p.add_argument("--threads", type=int, default=1, help="wrk threads (2 cores are shared by everything)")
    p.add_argument("--workers", type=int, default=3, help="backend listen ports the routers balance over")
    p.add_argument("--modes", default="json,sse", help="json (non-streaming), sse (streaming), or both")
    p.add_argument(
        "--rounds",
        type=int,
        default=int(os.environ.get("BENCH_PROXY_ROUNDS", "1")),
        help="times each router is measured per mode, the order reversed every other round, with CPU "
        "per request paired per round (default: %(default)s)",
    )
    p.add_argument(
        "--profile",
        type=float,
        default=float(os.environ.get("BENCH_PROFILE", "8")),
        help="seconds of py-spy sampling of each kvstrata router under load (0 = off)",
    )
    p.add_argument(
        "--same-prompt",
        dest="unique_prompts",
        action="store_false",
        help="send one fixed prompt (default: a shared ~130-token prefix + a unique counter)",
    )
    p.add_argument("--out", type=Path, default=Path(".bench/proxy.json"))
    p.add_argument("--workdir", type=Path, default=Path(".bench/proxy"))
    return p.parse_args(argv)


def request_body(stream: bool, unique: bool = False) -> str:
    """The POST body; with `unique`, the prompt ends in a per-request counter (filled in by wrk)."""
    prompt = PROMPT + (f" Ticket {UNIQUE}." if unique else "")
    return json.dumps({"model": nginx_backend.MODEL, "prompt": prompt, "max_tokens": 16, "stream": stream})


def _check_once(url: str, stream: bool) -> str | None:
    """One request before load: returns a problem description, or None if the answer is intact."""
    status, body = http_post(url + "/v1/completions", request_body(stream).encode(), timeout=10)
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    if stream:
        events = body.count(b"data: ")
        if events != nginx_backend.SSE_CHUNKS + 1:
            return f"expected {nginx_backend.SSE_CHUNKS + 1} SSE events, got {events}: {body[:200]!r}"
    elif b'"text_completion"' not in body:
        return f"unexpected body {body[:200]!r}"
    return None


def _measure(url: str, script: Path, args: argparse.Namespace, pgid: int | None) -> dict[str, Any]:
    if args.warmup > 0:
        run_wrk(url + "/v1/completions", script, args.connections, args.warmup, args.threads)
    cpu0, t0 = (group_cpu_seconds(pgid), time.monotonic()) if pgid else (0.0, 0.0)
    res = run_wrk(url + "/v1/completions", script, args.connections, args.duration, args.threads)
    row: dict[str, Any] = res.as_dict()
    if pgid:
        cpu = group_cpu_seconds(pgid) - cpu0
        row["router_cpu_cores"] = round(cpu / (time.monotonic() - t0), 2)
        # CPU per request barely depends on how busy the rest of the machine is, unlike req/s.
        ok = res.requests - res.non_2xx
        row["router_cpu_us_per_req"] = round(cpu / ok * 1e6, 1) if ok else None
    return row


def _profile(
    url: str, pid: int, script: Path, args: argparse.Namespace, label: str, mode: str
) -> dict[str, Any]:
    """py-spy on the router while wrk keeps it busy (a separate, unmeasured load run)."""
    out = args.workdir / f"{label.replace('/', '_')}-{mode}.pyspy.txt"
    wrk = subprocess.Popen(
        [
            "wrk",
            "-t",
            str(args.threads),
            "-c",
            str(args.connections),
            "-d",
            f"{args.profile + 3:g}s",
            "-s",
            str(script),
            url + "/v1/completions",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1)
        prof = record(pid, args.profile, out)
    except BenchError as exc:
        return {"problem": str(exc)}
    finally:
        wrk.wait(timeout=args.profile + 30)
    return {
        "samples": prof.samples,
        "self_top": prof.self_top,
        "inclusive_top": prof.inclusive_top,
        "raw_file": prof.raw_file,
    }


DIRECT = "direct (nginx)"


def _row(
    procs: ProcGroup,
    router: str | None,
    mode: str,
    urls: list[str],
    script: Path,
    cfg: RouterConfig,
    args: argparse.Namespace,
    profile: bool,
) -> dict[str, Any]:
    """One measured row: ``router`` started in front of ``urls`` (None: ``urls[0]`` straight), loaded,
    stopped."""
    stream = mode == "sse"
    label = router or DIRECT
    row: dict[str, Any] = {"target": label, "mode": mode}
    running = None
    try:
        if router is None:
            url, pgid = urls[0], None
        else:
            running = start_router(procs, router, [Worker(u) for u in urls], cfg, probe_prompt=PROMPT)
            url, pgid = running.url, running.proc.popen.pid
            row["ready_seconds"] = running.ready_seconds
        if problem := _check_once(url, stream):
            row["problem"] = problem
        print(f"  {mode:4} {label:28} ...", end="", flush=True)
        row.update(_measure(url, script, args, pgid))
        print(
            f" {row['rps']:>9.0f} req/s  p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms"
            f"  errors {row['errors']}",
            flush=True,
        )
        if running is not None and label.startswith("kvstrata/") and args.profile > 0 and profile:
            row["profile"] = _profile(running.url, running.proc.popen.pid, script, args, label, mode)
    except BenchError as exc:
        row["problem"] = str(exc).splitlines()[0]
        row["detail"] = str(exc)
        print(f"  {mode:4} {label:28} FAILED: {row['problem']}", flush=True)
    finally:
        if running is not None:
            procs.stop(running.proc)
    if stream and "rps" in row:
        row["sse_chunks_per_s"] = round(row["rps"] * (nginx_backend.SSE_CHUNKS + 1), 1)
    return row


def _paired_cpu(results: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """Per mode, each kvstrata router's CPU per request over each peer's, round by round."""
    if rounds < 2:
        return []
    cpu: dict[tuple[str, str, int], float] = {
        (r["mode"], r["target"], r["round"]): r["router_cpu_us_per_req"]
        for r in results
        if r.get("router_cpu_us_per_req") and "problem" not in r
    }
    out = []
    for mode in dict.fromkeys(m for m, _, _ in cpu):
        names = list(dict.fromkeys(t for m, t, _ in cpu if m == mode))
        for ours in (t for t in names if t.startswith("kvstrata/")):
            for peer in (t for t in names if not t.startswith("kvstrata/")):
                both = [n for n in range(rounds) if (mode, ours, n) in cpu and (mode, peer, n) in cpu]
                ratios = [cpu[(mode, ours, n)] / cpu[(mode, peer, n)] for n in both]
                got = paired(ratios)
                if got is None:
                    continue
                mean, se = got
                out.append(
                    {
                        "mode": mode,
                        "router": ours,
                        "peer": peer,
                        "ratios": [round(x, 3) for x in ratios],
                        "mean": round(mean, 3),
                        "se": round(se, 3),
                        "rounds_at_or_under": sum(x <= 1.0 for x in ratios),
                    }
                )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in ("json", "sse")]:
        raise BenchError(f"unknown mode(s) {bad}: use json and/or sse")
    skipped: dict[str, str] = {}
    if any(r.startswith("kvstrata/") for r in routers) and not kvstrata_router_available():
        for r in [r for r in routers if r.startswith("kvstrata/")]:
            skipped[r] = "`kvstrata router --help` does not work yet"
            routers.remove(r)
    tokenizer_dir = None
    if any(r.startswith("kvstrata/") for r in routers):
        from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model

        tokenizer_dir = ensure_tiny_model(default_tiny_model_dir())
    cfg = RouterConfig(model=nginx_backend.MODEL, tokenizer_dir=tokenizer_dir, block_size=32)
    results: list[dict[str, Any]] = []
    args.workdir.mkdir(parents=True, exist_ok=True)
    with ProcGroup(args.workdir / "logs") as procs:
        backend = nginx_backend.start_backend(procs, args.workdir, args.workers)
        for mode in modes:
            stream = mode == "sse"
            script = write_script(args.workdir / f"wrk-{mode}.lua", request_body(stream, args.unique_prompts))
            urls = backend.sse_urls if stream else backend.json_urls
            for round_ in range(args.rounds):
                for router in [None, *alternating(routers, round_)]:
                    row = _row(procs, router, mode, urls, script, cfg, args, profile=round_ == 0)
                    row["round"] = round_
                    results.append(row)
    _add_overhead(results)
    return {
        "paired_cpu": _paired_cpu(results, args.rounds),
        "benchmark": "proxy",
        "machine": machine(),
        "settings": {
            "connections": args.connections,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "wrk_threads": args.threads,
            "rounds": args.rounds,
            "unique_prompts": args.unique_prompts,
            "backend_workers": args.workers,
            "backend": "nginx (Debian nginx-light), 1 worker process, canned bodies via `return`",
            "sse_events_per_response": nginx_backend.SSE_CHUNKS + 1,
            "note": "load generator, router and backend share the same cores",
        },
        "skipped": skipped,
        "results": results,
    }


def _add_overhead(results: list[dict[str, Any]]) -> None:
    # Against the straight run of the same mode and round.
    base = {(r["mode"], r["round"]): r for r in results if r["target"] == DIRECT and "p50_ms" in r}
    for r in results:
        b = base.get((r["mode"], r["round"]))
        if b is None or "p50_ms" not in r or r is b:
            continue
        r["added_p50_ms"] = round(r["p50_ms"] - b["p50_ms"], 3)
        r["added_p99_ms"] = round(r["p99_ms"] - b["p99_ms"], 3)
        r["rps_vs_direct"] = round(r["rps"] / b["rps"], 3) if b["rps"] else None


def render(payload: dict[str, Any]) -> str:
    headers = [
        "target",
        "mode",
        "req/s",
        "p50 ms",
        "p99 ms",
        "+p50 ms",
        "+p99 ms",
        "chunks/s",
        "errors",
        "router cores",
        "cpu us/req",
    ]
    rows = []
    for r in payload["results"]:
        rows.append(
            [
                r["target"],
                r["mode"],
                fmt(r.get("rps"), 0),
                fmt(r.get("p50_ms"), 2),
                fmt(r.get("p99_ms"), 2),
                fmt(r.get("added_p50_ms"), 2),
                fmt(r.get("added_p99_ms"), 2),
                fmt(r.get("sse_chunks_per_s"), 0),
                fmt(r.get("errors")),
                fmt(r.get("router_cpu_cores"), 2),
                fmt(r.get("router_cpu_us_per_req"), 0),
            ]
        )
    s = payload["settings"]
    lines = [
        f"proxy overhead: {s['connections']} connections, {s['duration_s']:g} s per row, "
        f"wrk threads {s['wrk_threads']}, {payload['machine']['cpus']} CPUs shared by wrk + router + nginx",
        table(headers, rows),
    ]
    if payload.get("paired_cpu"):
        lines.append("\ncpu us/req paired per round (router / peer; ABBA order; ± one standard error)")
        lines.append(
            table(
                ["mode", "router", "peer", "per round", "mean", "rounds <= 1.00"],
                [
                    [
                        p["mode"],
                        p["router"],
                        p["peer"],
                        " ".join(f"{x:.2f}" for x in p["ratios"]),
                        f"{p['mean']:.2f} ± {p['se']:.2f}",
                        f"{p['rounds_at_or_under']} of {len(p['ratios'])}",
                    ]
                    for p in payload["paired_cpu"]
                ],
            )
        )
    for r in payload["results"]:
        if "problem" in r:
            lines.append(f"! {r['target']} ({r['mode']}): {r['problem']}")
    for name, why in payload["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    for r in payload["results"]:
        prof = r.get("profile")
        if not prof:
            continue
        lines.append(f"\npy-spy, {r['target']} ({r['mode']}), {prof.get('samples', 0)} samples:")
        if "problem" in prof:
            lines.append(f"  {prof['problem']}")
            continue
        lines.append("  self (leaf) frames:")
        lines += [f"    {100 * share:5.1f}%  {frame}" for frame, share in prof["self_top"][:12]]
        lines.append("  inclusive frames:")
        lines += [f"    {100 * share:5.1f}%  {frame}" for frame, share in prof["inclusive_top"][:12]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return bench_main("bench-proxy", lambda: run(args), render, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
