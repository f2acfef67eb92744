"""Where a running local cluster keeps its files, and the recorded facts about it (state.json)."""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstrata_dev.localcluster.pki import Pki

# Pods get IPs from here (kwok allocates them from each node's spec.podCIDR): a loopback range, so
# an e2e launcher can bind a real process to a pod's IP and nothing leaves the machine.
POD_CIDR = "127.10.0.0/16"
# ClusterIPs are allocated but never dialled (no kube-proxy). A loopback range keeps any stray
# connection attempt on this machine.
SERVICE_CIDR = "127.96.0.0/16"
SERVICE_IP = "127.96.0.1"

# Preferred ports (unusual on purpose); a busy one is replaced by a free one at `up`.
PREFERRED_PORTS: dict[str, int] = {
    "apiserver": 26443,
    "etcd": 22379,
    "etcd-peer": 22380,
    "controller-manager": 20257,
    "scheduler": 20259,
}


@dataclass(frozen=True)
class Layout:
    """Paths inside a state dir."""

    root: Path

    @property
    def state_json(self) -> Path:
        return self.root / "state.json"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def env_file(self) -> Path:
        return self.root / "env"

    @property
    def pki(self) -> Pki:
        return Pki(self.root / "pki")

    @property
    def kubeconfigs(self) -> Path:
        return self.root / "kubeconfigs"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def volumes(self) -> Path:
        return self.root / "volumes"

    def component_kubeconfig(self, name: str) -> Path:
        return self.kubeconfigs / f"{name}.kubeconfig"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def pid_file(self, name: str) -> Path:
        return self.pids / f"{name}.pid"


@dataclass
class State:
    """What `up` recorded; read by `status`, `env`, `down` and the pytest fixture."""

    bin_dir: str
    ports: dict[str, int]
    pod_cidr: str = POD_CIDR
    service_cidr: str = SERVICE_CIDR
    versions: dict[str, str] = field(default_factory=dict)
    started_at: str = ""
    up_seconds: float = 0.0

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def save(self, layout: Layout) -> None:
        layout.state_json.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, layout: Layout) -> State | None:
        try:
            return cls(**json.loads(layout.state_json.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, from the kernel's ephemeral range: fine for a socket bound at once, racy for one
    that a server binds later (`service_port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Below the kernel's ephemeral range and above the well-known ports: see `service_port`.
_SERVICE_PORTS_FROM = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def service_port(taken: Collection[int] = (), rng: random.Random | None = None) -> int:
    """A port for a server that binds it later, possibly on another address (an operator on its pod IP).

    A port from `free_port` is in the ephemeral range, so between the check and the server's bind the
    kernel may hand it to any outgoing connection or port-0 bind (a clean-clone CI run lost the
    operator's webhook port that way: EADDRINUSE on 127.10.1.2). The kernel never picks a port below
    that range on its own, so one chosen there stays free unless somebody names it."""
    pick = rng or random.SystemRandom()
    high = _ephemeral_low() - 1
    for _ in range(1000):
        port = pick.randint(_SERVICE_PORTS_FROM, high)
        if port not in taken and port not in PREFERRED_PORTS.values() and port_is_free(port, "0.0.0.0"):
            return port
    raise RuntimeError(f"no free port in {_SERVICE_PORTS_FROM}-{high}")


def choose_ports(preferred: dict[str, int] = PREFERRED_PORTS) -> dict[str, int]:
    chosen: dict[str, int] = {}
    for name, port in preferred.items():
        candidate = port
        if candidate in chosen.values() or not port_is_free(candidate):
            candidate = service_port(taken=chosen.values())
        chosen[name] = candidate
    return chosen
