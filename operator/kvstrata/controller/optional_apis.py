"""Which optional APIs the cluster serves (the Prometheus Operator's CRDs), checked by discovery and
remembered for a while: a reconcile must not ask the API server every time, and a CRD installed after
the operator started is picked up within ``ttl`` seconds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstrata.controller.kube import Kube, KubeError

log = logging.getLogger("kvstrata.operator")


class ServedKinds:
    """``served(api_version, kind)``: whether the API server serves that kind, an answer at most ``ttl``
    seconds old per kind."""

    def __init__(self, kube: Kube, ttl: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.ttl = ttl
        self.clock = clock
        self._known: dict[tuple[str, str], tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def __call__(self, api_version: str, kind: str) -> bool:
        key = (api_version, kind)
        with self._lock:
            now = self.clock()
            known = self._known.get(key)
            if known is not None and now - known[0] < self.ttl:
                return known[1]
            try:
                served = self.kube.serves(api_version, kind)
            except KubeError as err:
                # Unknown: keep the last answer (none: assume not served) and ask again next time.
                log.warning("could not tell whether %s %s is served: %s", api_version, kind, err)
                return known[1] if known is not None else False
            if known is None or known[1] != served:
                log.info("%s %s %s served", api_version, kind, "is" if served else "is not")
            self._known[key] = (now, served)
            return served
