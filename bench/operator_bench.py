"""`make bench-operator`: how fast InferenceClusters become Ready, and what the operator costs in memory.

On the local control plane (kwok nodes) with the chart installed and the operator running as its
ServiceAccount (kvstrata_dev.localrun), it measures:

- apply→Ready for 1 InferenceCluster, then for a burst of 100 created at once (time from each create to its
  Ready=True with the current generation observed, and the wall time until all 100 are Ready);
- the operator's peak and current RSS (VmHWM, VmRSS) once 200 InferenceClusters exist and are Ready.

Each cluster is the tiny CPU example with 1 engine pod, no router pod and small resource requests, so 200 of
them fit the simulated nodes; pods are kwok's (Ready as soon as scheduled), so the figures are the control
loop's: operator + apiserver + controller-manager + scheduler, not model start-up.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from bench.report import fmt, group_cpu_seconds, machine, mean, percentile, table, write_json
from kvstrata.controller.kube import Kube
from kvstrata_dev.localcluster import procs
from kvstrata_dev.localcluster.layout import Layout
from kvstrata_dev.localcluster.session import acquire, fresh_namespace, release
from kvstrata_dev.localrun import (
    ensure_model_claim,
    install_chart,
    run_operator,
    uninstall_chart,
    wait_webhook_serving,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"
API = "kvstrata.io/v1alpha1"


def manifest(name: str, namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["replicas"] = 1
    doc["spec"]["router"]["replicas"] = 0
    doc["spec"]["engine"]["resources"] = {"cpu": "50m", "memory": "128Mi"}
    return doc


def is_ready(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    if st.get("observedGeneration") != obj["metadata"].get("generation"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def create_and_time(kube: Kube, namespace: str, names: list[str], timeout: float) -> dict[str, Any]:
    """Create `names` at once (8 client threads) and time each one until Ready."""
    created: dict[str, float] = {}
    path = f"/apis/{API}/namespaces/{namespace}/inferenceclusters"

    def create(name: str) -> None:
        kube.request("POST", path, body=manifest(name, namespace))
        created[name] = time.monotonic()

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, names))
    ready_at: dict[str, float] = {}
    wanted = set(names)
    deadline = start + timeout
    while len(ready_at) < len(wanted) and time.monotonic() < deadline:
        now = time.monotonic()
        for obj in kube.request("GET", path).get("items", []):
            name = obj["metadata"]["name"]
            if name in wanted and name not in ready_at and is_ready(obj):
                ready_at[name] = now
        time.sleep(0.05)
    if len(ready_at) < len(wanted):
        raise TimeoutError(f"{len(wanted) - len(ready_at)} of {len(wanted)} not Ready after {timeout}s")
    latencies = [ready_at[n] - created[n] for n in names]
    return {
        "count": len(names),
        "all_ready_s": round(max(ready_at.values()) - start, 3),
        "p50_s": round(percentile(latencies, 50) or 0, 3),
        "p95_s": round(percentile(latencies, 95) or 0, 3),
        "max_s": round(max(latencies), 3),
        "mean_s": round(mean(latencies) or 0, 3),
    }


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(operator_pid: int, lc: Any) -> dict[str, float]:
    """CPU seconds so far of the operator's and kube-apiserver's process groups (both lead their own)."""
    layout = Layout(lc.state_dir)
    apiserver = procs.alive_pid(layout, "kube-apiserver") or 0
    return {
        "operator": group_cpu_seconds(operator_pid),
        "kube-apiserver": group_cpu_seconds(apiserver) if apiserver else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.operator_bench", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(".bench/operator.json"))
    p.add_argument("--burst", type=int, default=100, help="InferenceClusters created at once")
    p.add_argument("--total", type=int, default=200, help="InferenceClusters alive for the RSS figure")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)

    lc = acquire()
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-bench-operator-"))
    inst = install_chart(lc, release="kvstrata-bench", namespace="kvstrata-bench")
    op = None
    try:
        op = run_operator(inst, workdir)
        kube = Kube.from_environment(str(lc.kubeconfig))
        with fresh_namespace(lc, "bench-operator") as ns:
            ensure_model_claim(lc, ns)
            wait_webhook_serving(lc, ns)
            rss_idle = rss_kib(op.pid or 0)
            one = create_and_time(kube, ns, ["one"], args.timeout)
            # CPU seconds spent during the burst by the operator and by kube-apiserver: who is the bottleneck
            cpu_before = cpu_seconds(op.pid or 0, lc)
            burst = create_and_time(kube, ns, [f"b{i:03d}" for i in range(args.burst)], args.timeout)
            cpu_after = cpu_seconds(op.pid or 0, lc)
            burst["cpu_s"] = {k: round(cpu_after[k] - cpu_before[k], 1) for k in cpu_before}
            rest = max(0, args.total - args.burst - 1)
            fill = (
                create_and_time(kube, ns, [f"f{i:03d}" for i in range(rest)], args.timeout) if rest else None
            )
            time.sleep(5)  # status loop settles
            rss = rss_kib(op.pid or 0)
            alive = len(kube.request("GET", f"/apis/{API}/namespaces/{ns}/inferenceclusters")["items"])
            lc.kubectl("delete", "inferenceclusters", "--all", "-n", ns, "--wait=true", timeout=600)
    finally:
        if op is not None:
            op.stop()
        uninstall_chart(inst, delete_namespace=True)
        release(lc)

    rows = [
        ["1 InferenceCluster", fmt(one["all_ready_s"], 2), fmt(one["p50_s"], 2), fmt(one["p95_s"], 2), "-"],
        [
            f"{args.burst} at once",
            fmt(burst["all_ready_s"], 2),
            fmt(burst["p50_s"], 2),
            fmt(burst["p95_s"], 2),
            "-",
        ],
        [
            f"{alive} alive",
            "-",
            "-",
            "-",
            f"{rss['VmHWM'] / 1024:.0f} MiB peak, {rss['VmRSS'] / 1024:.0f} MiB now",
        ],
    ]
    print(table(["scenario", "all Ready (s)", "p50 (s)", "p95 (s)", "operator RSS"], rows))
    print(f"operator RSS before any InferenceCluster: {rss_idle['VmRSS'] / 1024:.0f} MiB")
    cpu = burst["cpu_s"]
    print(
        f"CPU seconds during the burst of {args.burst}: operator {cpu['operator']}, kube-apiserver "
        f"{cpu['kube-apiserver']} (wall {burst['all_ready_s']} s on {os.cpu_count()} cores; load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    payload = {
        "machine": machine(),
        "one": one,
        "burst": burst,
        "fill": fill,
        "alive": alive,
        "rss_kib": {"idle": rss_idle, "with_all": rss},
        "operator_log": str(op.log_path if op else ""),
    }
    write_json(args.out, copy.deepcopy(payload))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
