"""The simulated nodes and the default StorageClass that `up` applies (pure data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STORAGE_CLASS = "kvstrata-local"
PROVISIONER = "kvstrata.io/local-static"
# label values may not contain "/": same shape as the built-in "endpointslice-controller.k8s.io"
MANAGED_BY = "localcluster.kvstrata.io"


@dataclass(frozen=True)
class NodeShape:
    prefix: str
    count: int
    cpu: str
    memory: str
    gpus: int = 0


NODE_SHAPES: tuple[NodeShape, ...] = (
    NodeShape("kwok-gpu", 2, cpu="64", memory="512Gi", gpus=8),
    NodeShape("kwok-cpu", 2, cpu="32", memory="128Gi"),
)
# What GPU nodes claim to carry (NVIDIA GPU feature discovery label names), for planners to read.
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_MEMORY_MIB = "81559"


def node_names(shapes: tuple[NodeShape, ...] = NODE_SHAPES) -> list[str]:
    return [f"{s.prefix}-{i}" for s in shapes for i in range(s.count)]


def node(name: str, shape: NodeShape, pod_cidr: str) -> dict[str, Any]:
    resources: dict[str, str] = {
        "cpu": shape.cpu,
        "memory": shape.memory,
        "pods": "110",
        "ephemeral-storage": "1Ti",
    }
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": f"{shape.prefix}-sim",
        "type": "kwok",
        "kvstrata.io/pool": "gpu" if shape.gpus else "cpu",
    }
    if shape.gpus:
        resources["nvidia.com/gpu"] = str(shape.gpus)
        labels |= {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.count": str(shape.gpus),
            "nvidia.com/gpu.product": GPU_PRODUCT,
            "nvidia.com/gpu.memory": GPU_MEMORY_MIB,
        }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        # kwok hands out pod IPs from the node's podCIDR
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "kwok",
                "kubeProxyVersion": "kwok",
            },
        },
    }


def nodes(shapes: tuple[NodeShape, ...] = NODE_SHAPES) -> list[dict[str, Any]]:
    """Every node gets its own /24 of 127.10.0.0/16: 127.10.1.0/24, 127.10.2.0/24, ..."""
    out = []
    index = 1
    for shape in shapes:
        for i in range(shape.count):
            out.append(node(f"{shape.prefix}-{i}", shape, f"127.10.{index}.0/24"))
            index += 1
    return out


def storage_class() -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": PROVISIONER,
        "volumeBindingMode": "Immediate",
        "reclaimPolicy": "Delete",
        "allowVolumeExpansion": True,
    }


def bootstrap_objects() -> list[dict[str, Any]]:
    return [*nodes(), storage_class()]
