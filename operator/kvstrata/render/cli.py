"""`kvstrata render FILE [-n NAMESPACE]`: the objects an InferenceCluster becomes, as YAML for kubectl."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from kvstrata.api.manifest import ManifestError, iter_documents, validate
from kvstrata.planner import plan
from kvstrata.render.objects import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstrata render", description=__doc__)
    parser.add_argument("path", type=Path)
    parser.add_argument("-n", "--namespace", default="default")
    args = parser.parse_args(argv)
    if not args.path.exists():
        print(f"kvstrata render: {args.path}: no such file or directory", file=sys.stderr)
        return 2
    objects = []
    try:
        for doc in iter_documents(args.path):
            ic = validate(doc.body)
            p = plan(ic.spec)
            if not p.feasible:
                print(f"{doc.source}: infeasible: {p.summary()}", file=sys.stderr)
                return 1
            objects += render(ic.metadata.name, ic.metadata.namespace or args.namespace, ic.spec, p)
    except ManifestError as err:
        print(f"kvstrata render: invalid: {err}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0
