"""Whether the Prometheus Operator's CRDs are served: asked by discovery, remembered for a while."""

from __future__ import annotations

from typing import Any

from kvstrata.controller.kube import KubeError
from kvstrata.controller.optional_apis import ServedKinds

MON = "monitoring.coreos.com/v1"


class Discovery:
    def __init__(self) -> None:
        self.answers: list[bool | KubeError] = []
        self.asked: list[str] = []

    def serves(self, api_version: str, kind: str) -> bool:
        assert api_version == MON
        self.asked.append(kind)
        answer = self.answers.pop(0)
        if isinstance(answer, KubeError):
            raise answer
        return answer


def test_asked_once_per_ttl_and_kind_and_a_failed_ask_keeps_the_last_answer() -> None:
    now = [0.0]
    kube: Any = Discovery()
    served = ServedKinds(kube, ttl=15, clock=lambda: now[0])
    kube.answers = [False, True, KubeError(503, "ServiceUnavailable", "etcd", "GET", "/apis"), False]
    assert served(MON, "ServiceMonitor") is False and served(MON, "ServiceMonitor") is False
    assert kube.asked == ["ServiceMonitor"]
    now[0] = 16  # the CRDs were installed meanwhile
    assert served(MON, "ServiceMonitor") is True
    now[0] = 32
    assert served(MON, "ServiceMonitor") is True  # unknown: the last answer stands
    assert served(MON, "PodMonitor") is False  # each kind on its own (a bundle may lack one)
    assert kube.asked == ["ServiceMonitor", "ServiceMonitor", "ServiceMonitor", "PodMonitor"]


def test_not_known_and_the_api_server_fails_means_not_served() -> None:
    kube: Any = Discovery()
    kube.answers = [KubeError(0, "ConnectionRefused", "down", "GET", "/apis")]
    assert ServedKinds(kube)(MON, "ServiceMonitor") is False
