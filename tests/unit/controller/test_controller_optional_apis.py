"""Whether the Prometheus Operator's CRDs are served: asked by discovery, remembered for a while."""

from __future__ import annotations

from typing import Any

from kvstrata.controller.kube import KubeError
from kvstrata.controller.optional_apis import ServedApi
from kvstrata.render.objects import MONITORING_API


class Discovery:
    def __init__(self) -> None:
        self.answers: list[bool | KubeError] = []
        self.asked = 0

    def serves(self, api_version: str, kind: str) -> bool:
        assert (api_version, kind) == (MONITORING_API, "ServiceMonitor")
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, KubeError):
            raise answer
        return answer


def test_asked_once_per_ttl_and_a_failed_ask_keeps_the_last_answer() -> None:
    now = [0.0]
    kube: Any = Discovery()
    served = ServedApi(kube, MONITORING_API, "ServiceMonitor", ttl=15, clock=lambda: now[0])
    kube.answers = [False, True, KubeError(503, "ServiceUnavailable", "etcd", "GET", "/apis")]
    assert served() is False and served() is False and kube.asked == 1
    now[0] = 16  # the CRDs were installed meanwhile
    assert served() is True and kube.asked == 2
    now[0] = 32
    assert served() is True and kube.asked == 3  # unknown: the last answer stands


def test_not_known_and_the_api_server_fails_means_not_served() -> None:
    kube: Any = Discovery()
    kube.answers = [KubeError(0, "ConnectionRefused", "down", "GET", "/apis")]
    assert ServedApi(kube, MONITORING_API, "ServiceMonitor")() is False
