"""Which optional APIs the cluster serves (the Prometheus Operator's CRDs), checked by discovery and
remembered for a while: a reconcile must not ask the API server every time, and a CRD installed after
the operator started is picked up within ``ttl`` seconds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstrata.controller.kube import Kube, KubeError
from kvstrata.render.objects import MONITORING_API

log = logging.getLogger("kvstrata.operator")


class ServedApi:
    """``bool(self())``: whether ``kind`` of ``api_version`` is served, at most ``ttl`` seconds old."""

    def __init__(
        self,
        kube: Kube,
        api_version: str,
        kind: str,
        ttl: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.api_version = api_version
        self.kind = kind
        self.ttl = ttl
        self.clock = clock
        self._known: tuple[float, bool] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        with self._lock:
            now = self.clock()
            if self._known is not None and now - self._known[0] < self.ttl:
                return self._known[1]
            try:
                served = self.kube.serves(self.api_version, self.kind)
            except KubeError as err:
                # Unknown: keep the last answer (none: assume not served) and ask again next time.
                log.warning("could not tell whether %s %s is served: %s", self.api_version, self.kind, err)
                return self._known[1] if self._known is not None else False
            if self._known is None or self._known[1] != served:
                log.info("%s %s %s served", self.api_version, self.kind, "is" if served else "is not")
            self._known = (now, served)
            return served


def monitoring(kube: Kube) -> ServedApi:
    """The Prometheus Operator's ServiceMonitor (its PodMonitor comes with the same CRD bundle)."""
    return ServedApi(kube, MONITORING_API, "ServiceMonitor", ttl=15.0)
