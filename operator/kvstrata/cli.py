"""`kvstrata` command line: one entry point, one module per subcommand.

Subcommands import their module lazily so that `kvstrata plan` never pays for the router's or the
operator's imports.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help). Each module exposes `main(argv: list[str]) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("kvstrata.planner.cli", "print the memory-tier plan of InferenceCluster manifests"),
    "render": ("kvstrata.render.cli", "print the Kubernetes objects an InferenceCluster becomes"),
    "crd": ("kvstrata.api.crd", "print the generated CustomResourceDefinition"),
    "operator": ("kvstrata.controller.main", "run the operator (kopf)"),
    "router": ("kvstrata.router.main", "run the prefix-affinity router"),
}


def usage() -> str:
    lines = ["usage: kvstrata <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help"}:
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvstrata: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
