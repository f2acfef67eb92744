"""Loaded at interpreter start by processes the e2e launcher runs for a kwok pod (PYTHONPATH).

kwok pods share this machine's one network namespace, so two pods that both bind `tcp://*:5557` would
collide. In a real pod the wildcard means "every address of this pod", i.e. the pod IP; this shim makes a
wildcard ZMQ TCP bind mean exactly that (`KVSTRATA_POD_IP`). Nothing else is changed: concrete
addresses, ipc:// and connects pass through untouched.
"""

import os

_POD_IP = os.environ.get("KVSTRATA_POD_IP")

if _POD_IP:
    try:
        import zmq
    except ImportError:  # a process without pyzmq has no ZMQ binds to move
        zmq = None
    if zmq is not None:
        _original_bind = zmq.Socket.bind

        def _bind_pod_ip(self, addr, *args, **kwargs):
            if isinstance(addr, bytes):
                addr = addr.decode()
            if isinstance(addr, str) and addr.startswith("tcp://*:"):
                addr = f"tcp://{_POD_IP}:{addr[len('tcp://*:') :]}"
            return _original_bind(self, addr, *args, **kwargs)

        zmq.Socket.bind = _bind_pod_ip
