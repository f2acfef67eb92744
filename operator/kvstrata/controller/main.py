"""`kvstrata operator`: start the kopf operator with kvstrata's handlers, metrics and webhook.

Exit codes: 0 after a clean stop (SIGTERM/SIGINT), 2 for a configuration problem (reported in one line).
"""

from __future__ import annotations

import logging
import os
import re
import sys

from kvstrata.controller import metrics
from kvstrata.controller.settings import OperatorConfig, parse


def _fail(message: str) -> int:
    print(f"kvstrata operator: {message}", file=sys.stderr)
    return 2


class _QuietWatchHandlers(logging.Filter):
    """kopf logs every watch-event handler call at INFO; for the status feeders that is one line per pod
    change (their failures still get through). And kopf logs each admission refusal as an ERROR."""

    NOISE = re.compile(r"^Handler '[a-z]+-status' succeeded\.$")

    # A refused manifest is the user's mistake, reported to kubectl: not an operator error.
    DENIAL = re.compile(r"^Webhook '[a-z-]+' failed permanently: ")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno == logging.ERROR and self.DENIAL.match(message):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return self.verbose or not self.NOISE.match(message)

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose


def _configure_logging(config: OperatorConfig) -> None:
    import kopf

    fmt = kopf.LogFormat.JSON if config.log_format == "json" else kopf.LogFormat.FULL
    kopf.configure(verbose=config.verbose, log_format=fmt)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_QuietWatchHandlers(config.verbose))
    # aiohttp logs every webhook call at INFO; the admission counter already counts them.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _check(config: OperatorConfig) -> str | None:
    if config.webhook:
        assert config.webhook_cert_dir is not None
        missing = [f for f in ("tls.crt", "tls.key") if not (config.webhook_cert_dir / f).is_file()]
        if missing:
            return (
                f"webhook certificate files {', '.join(missing)} not found in {config.webhook_cert_dir}: mount "
                "the chart's webhook Secret there (--webhook-cert-dir) or run with --no-webhook"
            )
    if config.kubeconfig and not os.path.isfile(config.kubeconfig):
        return f"kubeconfig {config.kubeconfig} does not exist"
    return None


def main(argv: list[str]) -> int:
    config = parse(argv)
    if problem := _check(config):
        return _fail(problem)

    import kopf

    from kvstrata.controller import handlers
    from kvstrata.controller.kube import Kube

    _configure_logging(config)
    if config.kubeconfig:
        # kopf logs in on its own, through the same kubeconfig.
        os.environ["KUBECONFIG"] = config.kubeconfig
    try:
        kube = Kube.from_environment(config.kubeconfig, pool_size=max(16, config.workers * 2))
    except Exception as err:  # malformed kubeconfig, no in-cluster token: one line, no traceback
        return _fail(f"cannot load Kubernetes credentials: {err}")
    runtime = handlers.build_runtime(config, kube)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, runtime)
    try:
        metrics.serve(config.metrics_addr, config.metrics_port)
    except OSError as err:
        return _fail(f"cannot serve metrics on {config.metrics_addr}:{config.metrics_port}: {err}")
    kopf.run(
        registry=registry,
        settings=handlers.kopf_settings(config),
        standalone=True,
        clusterwide=not config.namespaces,
        namespaces=list(config.namespaces),
        liveness_endpoint=config.liveness_endpoint,
    )
    return 0
