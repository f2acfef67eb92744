"""`kvstrata-dev cluster build|up|down|env|status`: the local control plane from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstrata_dev.localcluster import build, cluster, versions
from kvstrata_dev.localcluster.layout import Layout, State


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstrata-dev cluster", description="the local Kubernetes control plane (kwok nodes)"
    )
    state_help = "where kubeconfig, certs, logs and PIDs live (default $KVSTRATA_CLUSTER_DIR or $KVSTRATA_CACHE/cluster)"
    p.add_argument("--state-dir", type=Path, default=None, help=state_help)
    # also accepted after the subcommand (`kvstrata-dev cluster up --state-dir DIR`)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS, help=state_help)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "build", parents=[common], help="build the binaries (cached; `up` does this when needed)"
    )
    b.add_argument("--force", action="store_true", help="rebuild even if the stamp exists")
    b.add_argument("--keep-gocache", action="store_true", help="keep the Go build cache (faster rebuilds)")
    up = sub.add_parser("up", parents=[common], help="start the cluster (no-op when it already runs)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each readiness step")
    down = sub.add_parser("down", parents=[common], help="stop the cluster and remove its state")
    down.add_argument("--purge", action="store_true", help="also remove the logs")
    sub.add_parser("env", parents=[common], help="print `export KUBECONFIG=... PATH=...` lines (eval them)")
    st = sub.add_parser("status", parents=[common], help="tell what runs")
    st.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    layout = Layout((args.state_dir or versions.default_state_dir()).expanduser().resolve())
    try:
        return _dispatch(args, layout)
    except (cluster.ClusterError, build.BuildError, OSError) as e:
        print(f"kvstrata-dev cluster {args.cmd}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace, layout: Layout) -> int:
    if args.cmd == "build":
        print(build.build(force=args.force, keep_gocache=args.keep_gocache))
        return 0
    if args.cmd == "up":
        state = cluster.up(layout, timeout=args.timeout)
        print("\n".join(cluster.env_lines(layout, Path(state.bin_dir))))
        return 0
    if args.cmd == "down":
        stopped = cluster.down(layout, keep_logs=not args.purge)
        print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
        return 0
    if args.cmd == "env":
        state = State.load(layout)
        if state is None or not cluster.status(layout).all_up:
            print(
                f"kvstrata-dev cluster env: no running cluster in {layout.root} (run `kvstrata-dev cluster up`)",
                file=sys.stderr,
            )
            return 1
        print("\n".join(cluster.env_lines(layout, Path(state.bin_dir))))
        return 0
    if args.cmd == "status":
        return _status(layout, as_json=args.json)
    raise AssertionError(args.cmd)


def _status(layout: Layout, as_json: bool) -> int:
    st = cluster.status(layout)
    state = State.load(layout)
    if as_json:
        print(
            json.dumps(
                {
                    "state_dir": str(layout.root),
                    "up": st.all_up,
                    "processes": st.running,
                    "server": state.server if state else None,
                    "ports": state.ports if state else None,
                    "pod_cidr": state.pod_cidr if state else None,
                    "versions": state.versions if state else None,
                },
                indent=2,
            )
        )
        return 0 if st.all_up else 3
    verdict = "up" if st.all_up else "partly up" if st.any_up else "down"
    print(f"local cluster in {layout.root}: {verdict}")
    if state and st.any_up:
        print(f"  server     {state.server}")
        print(f"  kubeconfig {layout.kubeconfig}")
        print(f"  pod CIDR   {state.pod_cidr}   service CIDR {state.service_cidr}")
        print(f"  versions   {', '.join(f'{k} {v}' for k, v in state.versions.items())}")
    for name, pid in st.running.items():
        print(f"  {name:<24} {'pid ' + str(pid) if pid else 'not running'}")
    return 0 if st.all_up else 3
