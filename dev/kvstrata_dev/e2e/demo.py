"""`make demo`: the whole stack on the local cluster with real vLLM engines, a workload, live hit rates.

    python -m kvstrata_dev.e2e.demo up [--example examples/tiny-cpu-tiered.yaml] [--workload auto] [--exit]
    python -m kvstrata_dev.e2e.demo down

`up` brings the local control plane up (building it on first use), installs the CRD, runs the operator,
creates the model PVC, applies the example, runs the launcher (real engine and router processes for the
kwok pods), waits for READY n/n, drives a workload through the router (for an example with CPU/NVMe
tiers: distinct prompts revisited at distances that reach each tier; otherwise shared-prefix groups), prints
`kubectl get ic` and a per-tier table, then keeps everything running until Ctrl-C (or `--exit`).
`down` (from another shell) stops whatever a running or crashed `up` left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvstrata_dev.e2e import workload
from kvstrata_dev.e2e.stack import Stack, StackError, load_manifest, say, stop_recorded
from kvstrata_dev.localcluster import cluster, versions
from kvstrata_dev.localcluster.layout import Layout
from kvstrata_dev.localcluster.session import CommandError
from kvstrata_dev.repo import REPO
from kvstrata_dev.testing.engines import group_pids
from kvstrata_dev.testing.tinymodel import kvstrata_cache

# Two engines with all three KV tiers: the pool, a CPU DRAM tier and an NVMe tier (with its janitor).
DEFAULT_EXAMPLE = REPO / "examples" / "tiny-cpu-tiered.yaml"
NAMESPACE = "kvstrata-demo"


def demo_dir() -> Path:
    return kvstrata_cache() / "demo"


# ------------------------------------------------------------------------------------- measuring
def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _tree(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(_children(pid))
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """Peak of the summed RSS of this process tree, the processes the launcher started and the local
    control plane, sampled every second in a thread."""

    def __init__(self, layout: Layout, launcher_state: Path) -> None:
        self.layout = layout
        self.launcher_state = launcher_state
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def sample(self) -> int:
        pids = set(_tree(os.getpid()))
        for pid in cluster.status(self.layout).running.values():
            if pid:
                pids.update(_tree(pid))
        with contextlib.suppress(OSError, ValueError):
            for entry in json.loads((self.launcher_state / "procs.json").read_text()).values():
                if entry.get("pid"):
                    pids.update(group_pids(entry["pid"]))
        return sum(_rss(p) for p in pids)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()


# ---------------------------------------------------------------------------------------- output
def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.1f}%"


def tier_table(ic: dict[str, Any]) -> str:
    spec, st = ic["spec"], ic.get("status") or {}
    cache = st.get("cache") or {}
    tiers = (spec.get("kvCache") or {}).get("tiers") or {}
    rows = [("tier", "configured", "hit rate (window)")]
    rows.append(("gpu (engine KV pool)", "yes", _pct(cache.get("gpuHitRate"))))
    # Each tier's share of all queried prompt tokens (the engines' prompt_tokens_cached_by_source_total).
    for tier, label, key in (
        ("cpu", "cpu (DRAM offload)", "cpuHitRate"),
        ("nvme", "nvme (fs offload)", "nvmeHitRate"),
    ):
        configured = tier in tiers
        rows.append((label, "yes" if configured else "no", _pct(cache.get(key)) if configured else "-"))
    rows.append(("all tiers", "", _pct(cache.get("hitRate"))))
    lines = _table(rows)
    lines.append("")
    pod_rows = [("pod", "ready", "hit rate", "kv usage", "running", "waiting")]
    for p in cache.get("pods") or []:
        pod_rows.append(
            (
                p["pod"],
                "yes" if p.get("ready") else "no",
                _pct(p.get("hitRate")),
                _pct(p.get("kvUsage")),
                str(p.get("running", "-")),
                str(p.get("waiting", "-")),
            )
        )
    lines += _table(pod_rows)
    router = st.get("router") or {}
    lines.append("")
    lines.append(
        f"router: {router.get('requests', '-')} requests, affinity-routed {_pct(router.get('affinityShare'))}, "
        f"{router.get('fallbacks', '-')} fallbacks; since start: {_pct(cache.get('hitRateTotal'))} of "
        f"{cache.get('queriedTokens', '-')} prompt tokens from cache"
    )
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


# ------------------------------------------------------------------------------------------ steps
def up(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    state = demo_dir()
    state.mkdir(parents=True, exist_ok=True)
    (state / "demo.pid").write_text(str(os.getpid()))
    manifest = load_manifest(args.example)
    from kvstrata_dev.localcluster.session import acquire, release

    layout = Layout(versions.default_state_dir().resolve())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    say("local control plane: building on first use, else reusing (kvstrata-dev cluster up)")
    lc = acquire()
    from kvstrata_dev.localcluster.session import FIXTURE_MARK

    with contextlib.suppress(OSError):
        if (Path(lc.state_dir) / FIXTURE_MARK).read_text().strip() == str(os.getpid()):
            (state / "started-cluster").write_text(str(lc.state_dir))
    stack = Stack(
        lc,
        args.namespace,
        manifest,
        state,
        status_interval=args.status_interval,
        release=args.release,
        release_namespace=args.release_namespace,
    )
    try:
        with PeakMemory(layout, state / "launcher") as mem:
            stack.install_operator()
            stack.prepare_model()
            stack.apply_cluster()
            say(
                f"applied {args.example.relative_to(REPO) if args.example.is_relative_to(REPO) else args.example}"
            )
            stack.start_launcher()
            say(
                "starting real vLLM engines for the kwok pods (about 100 s for three on an idle 2-core machine) ..."
            )
            shown = [""]

            def tick(ic: dict[str, Any]) -> None:
                ready = (ic.get("status") or {}).get("ready") or "-"
                if ready != shown[0]:
                    say(f"READY {ready}  ({time.monotonic() - t0:.0f}s)")
                    shown[0] = ready
                if stop.is_set():
                    raise KeyboardInterrupt

            stack.wait_ready(timeout=args.ready_timeout, on_tick=tick)
            ready_s = time.monotonic() - t0
            url, model = stack.router_url(), stack.served_model()
            kind = args.workload
            if kind == "auto":
                offload = {"cpu", "nvme"} & set((manifest["spec"].get("kvCache") or {}).get("tiers") or {})
                kind = "tiers" if offload else "shared-prefix"
            if kind == "tiers":
                reqs = workload.tier_revisit_requests(new=args.new_prompts)
                what = f"{args.new_prompts} distinct prompts revisited later (a working set beyond the pools)"
            else:
                reqs = workload.shared_prefix_requests(
                    groups=args.groups,
                    per_group=max(1, args.requests // args.groups),
                    tokenizer_json=_tokenizer_json(stack),
                )
                what = "shared-prefix requests"
            say(f"ready after {ready_s:.0f}s; {len(reqs)} requests, {what}, through the router at {url}")
            mark = stack.cache_mark()
            result = asyncio.run(
                workload.run(
                    url, model, reqs, concurrency=args.concurrency, max_tokens=1 if kind == "tiers" else 8
                )
            )
            if result.failed:
                say(f"{result.failed} request(s) failed, e.g. {result.errors[0]}")
            say("waiting for the operator's next scrape of the engines' /metrics ...")
            ic, _ = stack.wait_cache_caught_up(mark)
            total_s = time.monotonic() - t0
            peak = max(mem.peak, mem.sample())
        print()
        print(lc.kubectl("get", "ic", "-n", args.namespace).stdout.rstrip())
        print()
        print(tier_table(ic))
        print()
        print(
            f"demo: ready in {ready_s:.0f}s, workload {result.ok}/{len(reqs)} ok in {result.seconds:.1f}s, "
            f"total {total_s:.0f}s, peak memory {peak / 2**30:.1f} GiB"
        )
        (state / "last-run.json").write_text(
            json.dumps(
                {
                    "ready_seconds": round(ready_s, 1),
                    "total_seconds": round(total_s, 1),
                    "peak_rss_bytes": peak,
                    "requests_ok": result.ok,
                    "requests_failed": result.failed,
                    "hit_rate": (ic["status"]["cache"] or {}).get("hitRate"),
                    "tier_hit_rates": {
                        t: (ic["status"]["cache"] or {}).get(f"{t}HitRate") for t in ("gpu", "cpu", "nvme")
                    },
                },
                indent=2,
            )
        )
        if not args.exit:
            print(
                f"\nThe stack keeps running: kubectl -n {args.namespace} get ic,pods (after "
                f"`eval $(kvstrata-dev cluster env)`), curl {url}/v1/completions ...\n"
                "Press Ctrl-C here, or run `make demo-down`, to stop everything.",
                flush=True,
            )
            stop.wait()
        return 0 if not result.failed else 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except (StackError, CommandError, OSError, RuntimeError) as e:
        say(f"failed: {e}")
        return 1
    finally:
        say("stopping launcher (engines, router) and operator ...")
        stack.stop()
        lc.kubectl("delete", "namespace", args.namespace, "--wait=false", "--ignore-not-found", check=False)
        if release(lc):
            say("stopped the local control plane (the demo had started it)")
            (state / "started-cluster").unlink(missing_ok=True)
        (state / "demo.pid").unlink(missing_ok=True)


def _tokenizer_json(stack: Stack) -> Path | None:
    procs = stack.launcher_procs()
    for entry in procs.values():
        argv = entry.get("argv") or []
        if entry.get("component") == "engine" and "--model" in argv:
            path = Path(argv[argv.index("--model") + 1]) / "tokenizer.json"
            return path if path.exists() else None
    return None


def down(_: argparse.Namespace) -> int:
    state = demo_dir()
    pid_file = state / "demo.pid"
    with contextlib.suppress(OSError, ValueError, ProcessLookupError):
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        say(f"asked the running demo (pid {pid}) to stop; waiting ...")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.5)
    stopped = stop_recorded(state)
    if stopped:
        say(f"stopped leftovers: {', '.join(stopped)}")
    # The control plane only if this demo started it (a crashed `up` could not stop it) and nobody else
    # (a test session) uses it.
    marker = state / "started-cluster"
    if marker.exists():
        layout = Layout(Path(marker.read_text().strip()))
        from kvstrata_dev.localcluster.session import FIXTURE_MARK, _live_users

        if cluster.status(layout).any_up and not _live_users(layout):
            cluster.down(layout)
            (layout.root / FIXTURE_MARK).unlink(missing_ok=True)
            say("stopped the local control plane")
        marker.unlink(missing_ok=True)
    say("demo is down")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstrata_dev.e2e.demo", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="bring the demo up, run the workload, print hit rates, wait for Ctrl-C")
    u.add_argument("--example", type=Path, default=DEFAULT_EXAMPLE)
    u.add_argument("--namespace", default=NAMESPACE)
    u.add_argument(
        "--workload",
        choices=("auto", "tiers", "shared-prefix"),
        default="auto",
        help="auto: tiers when the example has a cpu or nvme tier, else shared-prefix",
    )
    u.add_argument("--new-prompts", type=int, default=24, help="tiers workload: distinct prompts")
    u.add_argument("--requests", type=int, default=32, help="shared-prefix workload: requests")
    u.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    u.add_argument("--concurrency", type=int, default=4)
    u.add_argument("--status-interval", type=float, default=5.0, help="operator cache-status scrape period")
    u.add_argument("--ready-timeout", type=float, default=900.0)
    u.add_argument("--release", default="kvstrata", help="Helm release of the chart")
    u.add_argument("--release-namespace", default="kvstrata-system")
    u.add_argument("--exit", action="store_true", help="stop everything after printing the results")
    sub.add_parser("down", help="stop a running demo and everything it started")
    args = p.parse_args(argv)
    if args.cmd == "up":
        args.example = args.example.resolve()
        return up(args)
    return down(args)


if __name__ == "__main__":
    sys.exit(main())
