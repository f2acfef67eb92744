"""The demo's path, asserted: real engines behind the router, live hit rates in the status, failover,
a tier-budget edit rolled out to the engines, and deletion stopping every process.

Tests run in file order against one module-scoped stack (see conftest.py); the last one deletes it.
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import signal
import threading
import time

import pytest

from kvstrata.controller.hitrate import HitRates
from kvstrata_dev.e2e import workload
from kvstrata_dev.e2e.stack import Stack
from kvstrata_dev.testing.engines import group_alive

pytestmark = pytest.mark.timeout(1800)


def _tokenizer(stack: Stack):
    from pathlib import Path

    argv = next(e["argv"] for e in stack.launcher_procs().values() if e["component"] == "engine")
    return Path(argv[argv.index("--model") + 1]) / "tokenizer.json"


def _requests(stack: Stack, seed: int, groups: int = 4, per_group: int = 8) -> list[workload.Request]:
    return workload.shared_prefix_requests(
        groups=groups, per_group=per_group, seed=seed, tokenizer_json=_tokenizer(stack)
    )


def _drive(
    stack: Stack, reqs: list[workload.Request], result: workload.Result | None = None, max_tokens: int = 8
) -> workload.Result:
    return asyncio.run(
        workload.run(
            stack.router_url(),
            stack.served_model(),
            reqs,
            concurrency=4,
            max_tokens=max_tokens,
            show_progress=False,
            result=result,
        )
    )


def _wait(what: str, predicate, timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def test_status_hit_rate_rises_and_matches_the_engines(stack: Stack) -> None:
    mark = stack.cache_mark()
    before = mark[1]
    result = _drive(stack, _requests(stack, seed=1))
    assert result.failed == 0, result.errors[:3]

    ic, after = stack.wait_cache_caught_up(mark)
    cache = ic["status"]["cache"]
    engines_window = HitRates.of(after - before).hit_rate
    engines_total = HitRates.of(after).hit_rate
    assert engines_window is not None and engines_total is not None
    assert cache["hitRate"] > 0.5
    assert abs(cache["hitRate"] - engines_window) <= 0.02
    assert abs(cache["hitRateTotal"] - engines_total) <= 0.02
    assert cache["hitRatePercent"] == round(cache["hitRate"] * 100)
    assert cache["tokensFromCache"] == int(after.hits + after.external_hits)
    assert {p["pod"] for p in cache["pods"]} == {p["metadata"]["name"] for p in stack.pods("engine")}
    assert all(p["ready"] for p in cache["pods"])
    cond = stack.condition("MetricsAvailable")
    assert cond is not None and cond["status"] == "True", cond
    # The router counts a request when its response completes, after the engine counted the prompt:
    # its figures may reach the status one scrape later.
    router = _wait(
        "the router's figures in status",
        lambda: (r := stack.ic()["status"].get("router") or {}).get("requests", 0) >= result.ok and r,
        timeout=60,
    )
    assert router["affinityShare"] > 0

    # The printer columns show the same figure.
    table = stack.lc.kubectl("get", "ic", stack.name, "-n", stack.namespace).stdout
    header, row = table.strip().splitlines()[:2]
    columns = dict(zip(re.split(r"\s{2,}", header.strip()), re.split(r"\s{2,}", row.strip()), strict=False))
    assert columns["HIT%"] == str(cache["hitRatePercent"])


def test_killed_engine_fails_over_and_comes_back(stack: Stack) -> None:
    victim = next(e for e in stack.launcher_procs().values() if e["component"] == "engine")
    reqs = _requests(stack, seed=2, groups=3, per_group=20)
    progress = workload.Result()
    runner = threading.Thread(target=_drive, args=(stack, reqs, progress, 32))
    runner.start()
    _wait("the workload to get going", lambda: progress.ok + progress.failed >= 6, timeout=300, interval=0.2)
    os.killpg(victim["pid"], signal.SIGKILL)
    done_at_kill = progress.ok + progress.failed
    runner.join(timeout=900)
    assert not runner.is_alive(), "workload did not finish"
    assert done_at_kill < len(reqs), "the engine died after the workload: nothing was tested"
    # Non-streaming requests never started streaming, so none of them may fail: the router retries.
    assert progress.failed == 0, progress.errors[:3]
    assert progress.ok == len(reqs)

    def pod_ready() -> bool:
        pod = next(p for p in stack.pods("engine") if p["metadata"]["name"] == victim["pod"])
        conds = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        return conds.get("Ready") == "True"

    def status_row() -> dict:
        rows = (stack.ic()["status"].get("cache") or {}).get("pods") or []
        return next((r for r in rows if r["pod"] == victim["pod"]), {})

    # The launcher saw the exit and restarted it; until the new engine answers, the pod is not ready.
    _wait("the restarted engine", lambda: stack.launcher_procs()[_uid(stack, victim)]["restarts"] >= 1, 60)
    replicas = int(stack.manifest["spec"]["replicas"])
    saw_not_ready = _wait(
        "the status to show the pod not ready",
        lambda: (
            (not pod_ready() and stack.ic()["status"].get("ready") != f"{replicas}/{replicas}")
            or status_row().get("ready") is False
        ),
        timeout=60,
        interval=0.5,
    )
    assert saw_not_ready
    _wait("the pod ready again", pod_ready, timeout=600, interval=2)
    _wait(
        "the status to show it ready again",
        lambda: (
            stack.ic()["status"].get("ready") == f"{replicas}/{replicas}"
            and status_row().get("ready") is True
        ),
        timeout=120,
    )
    pod = next(p for p in stack.pods("engine") if p["metadata"]["name"] == victim["pod"])
    assert pod["status"]["containerStatuses"][0]["restartCount"] >= 1


def _uid(stack: Stack, entry: dict) -> str:
    return next(uid for uid, e in stack.launcher_procs().items() if e["pod"] == entry["pod"])


def test_tier_budget_edit_reaches_plan_flags_engines_and_status(stack: Stack) -> None:
    old = stack.ic()
    old_digest = old["status"]["plan"]["flagsDigest"]
    edited = copy.deepcopy(stack.manifest)
    gpu_tier = edited["spec"]["kvCache"]["tiers"]["gpu"]
    blocks = int(gpu_tier["numBlocks"]) + 32
    gpu_tier["numBlocks"] = blocks
    stack.apply_cluster(edited)

    def planned() -> dict | None:
        ic = stack.ic()
        st = ic.get("status") or {}
        gpu = next((t for t in (st.get("plan") or {}).get("tiers", []) if t["name"] == "gpu"), None)
        ok = st.get("observedGeneration") == ic["metadata"]["generation"] and gpu and gpu["blocks"] == blocks
        return ic if ok else None

    ic = _wait("the new plan in status", planned, timeout=60)
    assert ic["status"]["plan"]["flagsDigest"] != old_digest
    sts = stack.lc.kubectl_json("get", "statefulset", f"{stack.name}-engine", "-n", stack.namespace)
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--num-gpu-blocks-override") + 1] == str(blocks)

    # The StatefulSet rolls the pods one by one; the launcher runs each new pod's new flags.
    stack.wait_ready(timeout=1200)

    def engines_rolled() -> bool:
        procs = [e for e in stack.launcher_procs().values() if e["component"] == "engine"]
        return len(procs) == int(edited["spec"]["replicas"]) and all(
            e["argv"][e["argv"].index("--num-gpu-blocks-override") + 1] == str(blocks) and e["ready"]
            for e in procs
        )

    _wait("every engine process on the new flags", engines_rolled, timeout=600, interval=2)
    for pod, text in stack.engine_metrics().items():
        assert re.search(rf'vllm:cache_config_info\{{[^}}]*num_gpu_blocks="{blocks}"', text), pod
    # Status keeps working on the new engines.
    mark = stack.cache_mark()
    result = _drive(stack, _requests(stack, seed=3, groups=2, per_group=4))
    assert result.failed == 0, result.errors[:3]
    ic, _ = stack.wait_cache_caught_up(mark)
    assert ic["status"]["cache"]["hitRate"] is not None


def test_deleting_the_cluster_stops_everything_it_owns(stack: Stack) -> None:
    procs = stack.launcher_procs()
    pids = [e["pid"] for e in procs.values() if e["pid"]]
    assert len(pids) == int(stack.manifest["spec"]["replicas"]) + 1  # engines + router
    stack.lc.kubectl(
        "delete", "inferencecluster", stack.name, "-n", stack.namespace, "--wait=true", timeout=300
    )
    _wait(
        "every engine and router process to stop", lambda: not any(group_alive(p) for p in pids), timeout=300
    )
    _wait("no pods left", lambda: not stack.pods("engine") and not stack.pods("router"), timeout=120)
    left = stack.lc.kubectl(
        "get", "statefulsets,deployments,services,configmaps", "-n", stack.namespace,
        "-l", f"app.kubernetes.io/instance={stack.name}", "-o", "name",
    ).stdout.strip()  # fmt: skip
    assert left == ""
    assert stack.launcher_procs() == {}
