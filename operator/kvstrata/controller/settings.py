"""`kvstrata operator` options: command-line flags, each with a KVSTRATA_* environment fallback."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CacheStatusSettings:
    """The status.cache scraper's timing (cache_status.py), seconds."""

    interval: float = 15.0
    window: float = 300.0
    timeout: float = 3.0
    heartbeat: float = 300.0


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    kubeconfig: str | None = None
    webhook: bool = True
    webhook_addr: str = "0.0.0.0"
    webhook_port: int = 9443
    webhook_cert_dir: Path | None = None
    metrics_addr: str = "0.0.0.0"
    metrics_port: int = 9090
    health_addr: str = "0.0.0.0"
    health_port: int = 8080
    log_format: str = "json"
    verbose: bool = False
    workers: int = 8
    status_min_interval: float = 1.0
    resync_interval: float = 600.0
    cache_status: CacheStatusSettings = field(default_factory=CacheStatusSettings)

    @property
    def liveness_endpoint(self) -> str | None:
        return f"http://{self.health_addr}:{self.health_port}/healthz" if self.health_port else None


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KVSTRATA_{name}", default)


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from KVSTRATA_<name>; unset or empty is the default."""
    raw = os.environ.get(f"KVSTRATA_{name}")
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"KVSTRATA_{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"KVSTRATA_{name} must be > 0, got {value}")
    return value


def cache_status_from_env() -> CacheStatusSettings:
    d = CacheStatusSettings()
    return CacheStatusSettings(
        interval=_env_seconds("CACHE_STATUS_INTERVAL", d.interval),
        window=_env_seconds("CACHE_STATUS_WINDOW", d.window),
        timeout=_env_seconds("CACHE_STATUS_TIMEOUT", d.timeout),
        heartbeat=_env_seconds("CACHE_STATUS_HEARTBEAT", d.heartbeat),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstrata operator",
        description="Run the InferenceCluster operator: reconcile, status and the validating webhook.",
    )
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=None,
        help="watch only this namespace (repeatable; default: all namespaces, env KVSTRATA_NAMESPACES=a,b)",
    )
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: in-cluster config")
    p.add_argument("--no-webhook", action="store_true", help="do not serve the validating webhook")
    p.add_argument("--webhook-addr", default=_env("WEBHOOK_ADDR", "0.0.0.0"))
    p.add_argument("--webhook-port", type=int, default=int(_env("WEBHOOK_PORT", "9443")))
    p.add_argument(
        "--webhook-cert-dir",
        type=Path,
        default=Path(_env("WEBHOOK_CERT_DIR", "/etc/kvstrata/webhook")),
        help="directory with tls.crt and tls.key (the chart mounts its generated Secret here)",
    )
    p.add_argument("--metrics-addr", default=_env("METRICS_ADDR", "0.0.0.0"))
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "9090")), help="0 disables")
    p.add_argument("--health-addr", default=_env("HEALTH_ADDR", "0.0.0.0"))
    p.add_argument(
        "--health-port",
        type=int,
        default=int(_env("HEALTH_PORT", "8080")),
        help="/healthz (kopf); 0 disables",
    )
    p.add_argument("--log-format", choices=("json", "text"), default=_env("LOG_FORMAT", "json"))
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--workers", type=int, default=int(_env("WORKERS", "8")), help="reconcile threads")
    p.add_argument(
        "--status-min-interval",
        type=float,
        default=float(_env("STATUS_MIN_INTERVAL", "1.0")),
        help="seconds between two status writes of one InferenceCluster",
    )
    p.add_argument(
        "--resync-interval",
        type=float,
        default=float(_env("RESYNC_INTERVAL", "600")),
        help="seconds between re-applies of every cluster (repairs drift); 0 disables",
    )
    return p


def parse(argv: list[str]) -> OperatorConfig:
    args = parser().parse_args(argv)
    namespaces = args.namespace or [n for n in _env("NAMESPACES", "").split(",") if n]
    return OperatorConfig(
        namespaces=tuple(namespaces),
        kubeconfig=args.kubeconfig,
        webhook=not args.no_webhook,
        webhook_addr=args.webhook_addr,
        webhook_port=args.webhook_port,
        webhook_cert_dir=args.webhook_cert_dir,
        metrics_addr=args.metrics_addr,
        metrics_port=args.metrics_port,
        health_addr=args.health_addr,
        health_port=args.health_port,
        log_format=args.log_format,
        verbose=args.verbose,
        workers=max(1, args.workers),
        status_min_interval=max(0.0, args.status_min_interval),
        resync_interval=max(0.0, args.resync_interval),
        cache_status=cache_status_from_env(),
    )
