"""The InferenceCluster API (pydantic models, the single source of truth for the CRD)."""

from kvstrata.api.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    InferenceCluster,
    InferenceClusterSpec,
    InferenceClusterStatus,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "InferenceCluster",
    "InferenceClusterSpec",
    "InferenceClusterStatus",
]
