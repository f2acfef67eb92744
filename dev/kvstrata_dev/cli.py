"""`kvstrata-dev`: the development harness's command line (the product's is `kvstrata`)."""

from __future__ import annotations

import sys

from kvstrata_dev.localcluster import main as cluster_main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["cluster"]:
        print("usage: kvstrata-dev cluster build|up|down|env|status [args]", file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    return int(cluster_main.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
