"""(spec, plan) → Kubernetes objects. Pure functions, no I/O."""

from kvstrata.render.objects import (
    CONFIG_DIGEST_ANNOTATION,
    FLAGS_DIGEST_ANNOTATION,
    engine_name,
    engine_selector,
    labels,
    monitors,
    render,
    router_name,
    router_settings,
    selector_string,
    service_monitor,
)

__all__ = [
    "CONFIG_DIGEST_ANNOTATION",
    "FLAGS_DIGEST_ANNOTATION",
    "engine_name",
    "engine_selector",
    "labels",
    "monitors",
    "render",
    "router_name",
    "router_settings",
    "selector_string",
    "service_monitor",
]
