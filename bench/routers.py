"""The routers under test and how to start each one: kvstrata's own and the peers (vllm-router, sglang-router).

A router is named `<implementation>/<policy>`, e.g. `vllm-router/kv_aware` or `kvstrata/kv-aware`. Each is
started on a fresh port in front of the same workers and counted ready only once a real completion
request through it succeeds (sglang-router answers 503 until it has found its workers).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.procs import BenchError, Proc, ProcGroup, free_port, http_get, http_post, wait_until

VENV_BIN = Path(sys.executable).parent

PEER_POLICIES = {
    "vllm-router": ("round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash"),
    "sglang-router": ("round_robin", "cache_aware", "power_of_two", "random"),
    "kvstrata": ("kv-aware", "prefix-hash", "least-load", "round-robin"),
}
# kvstrata with one setting changed, named `kvstrata/<policy>@<variant>`: an ablation in the same run,
# paired per draw like a peer (the router's settings come from KVSTRATA_ROUTER_<FIELD> variables).
KVSTRATA_VARIANTS: dict[str, dict[str, str]] = {
    "no-admission": {"KVSTRATA_ROUTER_ADMISSION": '{"enabled": false}'},
    # The conversation bound (conversationBound, off by default; twenty-sixth session).
    "conversation-bound": {"KVSTRATA_ROUTER_CONVERSATION_BOUND": "true"},
    # The fit scorer's projection of live conversations' next turns (projectedFit, off by default;
    # twenty-eighth session).
    "projected-fit": {"KVSTRATA_ROUTER_PROJECTED_FIT": "true"},
    # The rent-or-buy move of a held request (off by default) as it was built.
    "wait-move": {"KVSTRATA_ROUTER_ADMISSION": '{"moveWhenHeldPastPrefill": true}'},
    # A held request moved where its blocks fit beside everything routed there lately, after waiting
    # its extra prefill there (moveToSpareRoom, off by default; forty-seventh session).
    "move-to-spare-room": {"KVSTRATA_ROUTER_ADMISSION": '{"moveToSpareRoom": true}'},
    # Anticipation keeping a room for every group followed in time (seventeenth session), and none at all:
    # the default keeps one only for groups whose turns evict each other (anticipateOnlyEvicted).
    "anticipate": {
        "KVSTRATA_ROUTER_ADMISSION": '{"anticipateSeconds": 0.25, "anticipateOnlyEvicted": false}'
    },
    "no-anticipate": {"KVSTRATA_ROUTER_ADMISSION": '{"anticipateSeconds": 0}'},
    # The prefill scorer counting an uncached token once where the engine has room for the copy
    # (copyWithRoom, off by default; eighteenth session).
    "copy-with-room": {"KVSTRATA_ROUTER_COPY_WITH_ROOM": "true"},
    # A held request's wait bounded by its own prefill (overdueAfterPrefills, off by default) as it was
    # built and measured (twenty-first session).
    "overdue": {"KVSTRATA_ROUTER_ADMISSION": '{"overdueAfterPrefills": 1.0}'},
    # Without the evicts scorer (twenty-third session): a cold prompt placed as before it.
    "no-evicts": {"KVSTRATA_ROUTER_WEIGHTS": '{"evicts": 0}'},
    # A held request never stolen by another engine while its own is in rotation (thirty-fourth session:
    # in family draws 714 and 725 each steal evicted a live conversation elsewhere, whose next turn then
    # went cold or was stolen in turn).
    "no-steal": {"KVSTRATA_ROUTER_ADMISSION": '{"stealWhenHomeHoldsNoMore": false}'},
    # Steals only to an engine with room beside what was routed there lately (stealOnlyToSpareRoom; off
    # by default: it failed its held-out rule in the fifty-first session, hit -0.2 +- 0.7 points).
    "steal-spare": {"KVSTRATA_ROUTER_ADMISSION": '{"stealOnlyToSpareRoom": true}'},
    # Steals only to an engine serving at most its share of the live conversations
    # (stealKeepsConversationsEven; off by default: it failed its held-out rule in the fifty-third session,
    # hit +0.1 +- 0.7 points).
    "steal-even": {"KVSTRATA_ROUTER_ADMISSION": '{"stealKeepsConversationsEven": true}'},
    # A follow-up kept on its conversation's engine by routing and by the gate (stickyConversations; off
    # by default: it failed its held-out rule in the fifty-second session, hit -0.6 +- 1.0 points).
    "sticky": {"KVSTRATA_ROUTER_STICKY_CONVERSATIONS": "true"},
    # Prefills one after another on each engine, the cheapest held first (admission.prefillInTurn; off by
    # default: it failed its held-out rule in the fifty-seventh session, TTFT mean 1.03x, hit -1.5 +- 1.0).
    "prefill-in-turn": {"KVSTRATA_ROUTER_ADMISSION": '{"prefillInTurn": true}'},
    # Cached prefixes scored by what will survive the requests running beside them (survivingMatch): the
    # forty-sixth session ran it on as `@surviving-match` against the default then (off); on by default
    # since, and `@no-surviving-match` is the router before it.
    "surviving-match": {"KVSTRATA_ROUTER_SURVIVING_MATCH": "true"},
    "no-surviving-match": {"KVSTRATA_ROUTER_SURVIVING_MATCH": "false"},
    # The share bound (off by default) at the factor it was built with.
    "share-bound": {"KVSTRATA_ROUTER_SHARE_BOUND_FACTOR": "1.3"},
    # The Python app alone serving HTTP (dataPlane: python), as before the native front became the
    # default (forty-first session): the same decisions.
    "python-http": {"KVSTRATA_ROUTER_DATA_PLANE": "python"},
}
# `<router>@rerun`, for any router: the same router again in the same draw (an A/A pair). What two runs
# of one router differ by is the yardstick for a per-draw difference between two routers.
RERUN = "rerun"


@dataclass(frozen=True)
class Worker:
    url: str
    kv_events: str | None = None  # tcp://127.0.0.1:PORT (ZMQ PUB)
    kv_replay: str | None = None  # tcp://127.0.0.1:PORT (ZMQ ROUTER)


@dataclass(frozen=True)
class RouterConfig:
    model: str
    tokenizer_dir: Path | None
    block_size: int
    # kvstrata only: one log line per decision, the evidence of why a run hit or missed. Off where the
    # router's own CPU is measured (bench-proxy): formatting and writing a line per request is not free.
    log_decisions: bool = False


@dataclass(frozen=True)
class RunningRouter:
    name: str
    url: str
    metrics_url: str
    proc: Proc
    ready_seconds: float


def split_name(name: str) -> tuple[str, str]:
    impl, _, policy = name.partition("/")
    policy, _, variant = policy.partition("@")
    if impl not in PEER_POLICIES or policy not in PEER_POLICIES[impl]:
        known = ", ".join(f"{i}/{p}" for i, ps in PEER_POLICIES.items() for p in ps)
        raise BenchError(f"unknown router {name!r}; known: {known}")
    if variant and variant != RERUN and (impl != "kvstrata" or variant not in KVSTRATA_VARIANTS):
        known = ", ".join([f"<router>@{RERUN}", *(f"kvstrata/<policy>@{v}" for v in KVSTRATA_VARIANTS)])
        raise BenchError(f"unknown router variant {name!r}; known: {known}")
    return impl, policy


def variant_env(name: str) -> dict[str, str]:
    """The environment a `kvstrata/<policy>@<variant>` router runs with (empty for every other)."""
    split_name(name)
    return dict(KVSTRATA_VARIANTS.get(name.partition("@")[2], {}))


def router_argv(
    name: str, port: int, workers: list[Worker], cfg: RouterConfig, metrics_port: int
) -> list[str]:
    impl, policy = split_name(name)
    urls = [w.url for w in workers]
    if impl == "vllm-router":
        argv = [
            str(VENV_BIN / "vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            policy,
            "--worker-urls",
            *urls,
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            "warning",
        ]
        if policy == "kv_aware":
            for w in workers:
                if w.kv_events is None:
                    raise BenchError(
                        f"vllm-router/kv_aware needs KV events from every worker ({w.url} has none)"
                    )
                argv += ["--kv-event-source", f"{w.url}={w.kv_events}"]
                if w.kv_replay:
                    argv += ["--kv-event-replay-source", f"{w.url}={w.kv_replay}"]
            argv += ["--kv-event-block-size", str(cfg.block_size), "--kv-event-model", cfg.model]
        return argv
    if impl == "sglang-router":
        return [
            str(VENV_BIN / "sglang-router"),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            policy,
            "--worker-urls",
            *urls,
            "--prometheus-port",
            str(metrics_port),
            "--prometheus-host",
            "127.0.0.1",
            "--log-level",
            "warn",
        ]
    argv = [
        str(VENV_BIN / "kvstrata"),
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        cfg.model,
        "--block-size",
        str(cfg.block_size),
        "--policy",
        policy,
        "--log-level",
        "WARNING",  # every router logs at warning level: request logging is not what is measured
    ]
    if cfg.log_decisions:
        argv.append("--log-decisions")
    if cfg.tokenizer_dir is not None:
        argv += ["--tokenizer", str(cfg.tokenizer_dir)]
    for w in workers:
        spec = w.url
        if w.kv_events:
            spec += f",events={w.kv_events}"
        if w.kv_replay:
            spec += f",replay={w.kv_replay}"
        argv += ["--endpoint", spec]
    return argv


def kvstrata_router_available() -> bool:
    """True once `kvstrata router --help` works (the router is written concurrently with this harness)."""
    try:
        out = subprocess.run(
            [str(VENV_BIN / "kvstrata"), "router", "--help"], capture_output=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def start_router(
    procs: ProcGroup,
    name: str,
    workers: list[Worker],
    cfg: RouterConfig,
    probe_prompt: str = "ping",
    timeout: float = 90.0,
    env: Mapping[str, str] | None = None,
) -> RunningRouter:
    """``env``: more of the router's environment; KVSTRATA_ROUTER_* variables set kvstrata's settings
    (peers ignore them)."""
    port, metrics_port = free_port(), free_port()
    proc = procs.start(
        name.replace("/", "_"),
        router_argv(name, port, workers, cfg, metrics_port),
        env={"RUST_LOG": "warn", **(env or {}), **variant_env(name)},
    )
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": cfg.model, "prompt": probe_prompt, "max_tokens": 1}).encode()

    def ready() -> bool:
        return http_post(url + "/v1/completions", body, timeout=10)[0] == 200

    waited = wait_until(f"{name} to route a request", ready, timeout, [proc], interval=0.5)
    # The peers serve Prometheus metrics on a port of their own; kvstrata on its main port.
    metrics_url = (
        f"{url}/metrics" if name.startswith("kvstrata/") else f"http://127.0.0.1:{metrics_port}/metrics"
    )
    return RunningRouter(name, url, metrics_url, proc, round(waited, 2))


_INTERESTING = re.compile(r"kv|event|cache|hit|decision|route|fallback|predict|block|index", re.IGNORECASE)


def scrape_router_metrics(router: RunningRouter, save_to: Path, limit: int = 60) -> list[str]:
    """Save the router's own /metrics text and return its non-zero samples about caches, events and
    routing decisions: evidence of whether a cache-aware policy actually saw the engines' KV events."""
    status, body = http_get(router.metrics_url, timeout=5)
    if status != 200:
        return [f"(metrics: HTTP {status})"]
    text = body.decode(errors="replace")
    save_to.write_text(text)
    picked = []
    for line in text.splitlines():
        if line.startswith("#") or not _INTERESTING.search(line.split("{", 1)[0].split(" ", 1)[0]):
            continue
        value = line.rsplit(" ", 1)[-1]
        if value not in ("0", "0.0") and "_bucket" not in line:
            picked.append(line)
    return picked[:limit]
