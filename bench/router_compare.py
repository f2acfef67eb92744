"""Compare routers across `make bench-router` JSON files, round by round.

One run's pooled TTFT moves by seconds with which prompts share an engine step, so compare routers on
rounds paired within a run (same engines, same minutes, same seed, rotated order). Rounds of one seed
replay nearly the same arrivals and decisions, so they are not independent samples: read the standard
error only over rounds of different seeds (the default run gives each round its own, ``BENCH_SEEDS``).

    python -m bench.router_compare .bench/router.json more-runs/*.json [--against kvstrata/kv-aware]

Prints, per file and router, the engines' uncached prefill rate and, for closed-loop runs, the slowest
first token of the burst each round starts with and mean TTFT of the burst vs the rest (open loop: first
turns vs later turns); then, over all files, the per-round difference in mean TTFT (and p99 TTFT, for
files that have it) between ``--against`` and each other router (how often lower, mean ± standard error). Needs files written with
``requests_detail`` (since 2026-11-23).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import mean

BURST_S = 0.1  # requests sent this soon after a round's start belong to its opening burst


def burst_profile(result: dict[str, Any]) -> dict[str, Any]:
    """Uncached tokens/s, slowest burst TTFT per round (s), mean TTFT of burst vs later requests (ms)."""
    detail = result["requests_detail"]  # [round, conversation, turn, sent s, TTFT ms]
    rounds = result["rounds"]
    queries = sum(e["queries"] for e in result["engines"])
    hits = sum(e["hits"] for e in result["engines"])
    timed = [d for d in detail if d[4] is not None]
    burst = [d for d in timed if d[3] < BURST_S]
    return {
        "uncached_tokens_per_s": (queries - hits) / rounds / result["wall_s"] if result["wall_s"] else None,
        "burst_max_s_by_round": [
            max((d[4] for d in burst if d[0] == i), default=0.0) / 1000 for i in range(rounds)
        ],
        "burst_mean_ms": mean([d[4] for d in burst]),
        "later_mean_ms": mean([d[4] for d in timed if d[3] >= BURST_S]),
    }


def paired_differences(
    runs: Sequence[dict[str, Any]], a: str, b: str, key: str = "ttft_ms_mean_by_round"
) -> list[float]:
    """Per-round ``key`` (a per-round TTFT figure) of ``a`` minus ``b`` (ms), over every run that has both."""
    out: list[float] = []
    for run in runs:
        by = {r["router"]: r for r in run["results"] if key in r}
        if a in by and b in by:
            pairs = zip(by[a][key], by[b][key], strict=False)
            out += [x - y for x, y in pairs if x is not None and y is not None]
    return out


def summarize(diffs: Sequence[float]) -> tuple[int, int, float, float] | None:
    """(rounds, rounds where the difference < 0, mean, standard error); None below two rounds."""
    if len(diffs) < 2:
        return None
    m = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (len(diffs) - 1))
    return len(diffs), sum(d < 0 for d in diffs), m, sd / math.sqrt(len(diffs))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--against", default="kvstrata/kv-aware", help="the router compared with the others")
    args = p.parse_args(argv)
    try:
        runs = [json.loads(f.read_text()) for f in args.files]
    except (OSError, ValueError) as exc:
        p.error(f"cannot read a bench-router JSON: {exc}")
    routers: list[str] = []
    for f, run in zip(args.files, runs, strict=True):
        print(f"{f}:")
        for r in run["results"]:
            if "requests_detail" not in r:
                continue
            routers += [r["router"]] if r["router"] not in routers else []
            b = burst_profile(r)
            if run["workload"].get("arrival_rate"):  # open loop: no opening burst
                split = f"first turns {r['ttft_ms_first_turn_mean']:.0f}, later {r['ttft_ms_later_turns_mean']:.0f}"
            else:
                maxima = "/".join(f"{x:.1f}" for x in b["burst_max_s_by_round"])
                split = (
                    f"burst {b['burst_mean_ms']:.0f}, later {b['later_mean_ms']:.0f}; burst max s {maxima}"
                )
            print(
                f"  {r['router']:28s} uncached {b['uncached_tokens_per_s']:.0f} tok/s  mean TTFT ms: {split}"
            )
    for other in routers:
        if other == args.against:
            continue
        for figure, key in (("mean", "ttft_ms_mean_by_round"), ("p99", "ttft_ms_p99_by_round")):
            s = summarize(paired_differences(runs, args.against, other, key))
            if s is not None:
                n, lower, m, se = s
                print(
                    f"{args.against} - {other}, {figure} TTFT: lower in {lower} of {n} rounds, "
                    f"by {m:+.0f} ± {se:.0f} ms"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
