"""`kvstrata plan FILE_OR_DIR [-o table|json|yaml]`: the plan a user wants to see before applying."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from kvstrata.api.manifest import Document, ManifestError, iter_documents, validate
from kvstrata.api.quantity import gib
from kvstrata.planner.plan import Plan, plan


def plan_dict(name: str, p: Plan) -> dict[str, Any]:
    return {
        "name": name,
        "verdict": p.verdict,
        "kvBytesPerToken": p.kv_bytes_per_token,
        "kvBytesPerTokenPerRank": p.kv_bytes_per_token_per_rank,
        "blockSize": p.block_size,
        "tiers": [asdict(t) for t in p.tiers],
        "maxConcurrency": round(p.max_concurrency, 2),
        "sequenceBytes": p.sequence_bytes,
        "weightsBytesPerRank": p.weights_bytes_per_rank,
        "offloadBackend": p.offload_backend,
        "offloadReason": p.offload_reason,
        "engineArgs": p.engine_args,
        "engineEnv": p.engine_env,
        "lmcacheArgs": list(p.lmcache.args) if p.lmcache else None,
        "podMemoryBytes": p.memory_bytes,
        "shmBytes": p.shm_bytes,
        "pvcBytes": p.pvc_bytes,
        "gpusPerPod": p.gpus,
        "flagsDigest": p.flags_digest if p.feasible else None,
        "problems": [pr.message() for pr in p.problems],
        "warnings": p.warnings,
    }


def table(name: str, p: Plan) -> str:
    lines = [f"== {name}: {p.verdict.upper()}"]
    if p.architecture:
        a = p.architecture
        lines.append(
            f"   model     {a.attention} · {a.num_layers} layers · KV {p.kv_bytes_per_token:,} B/token "
            f"({p.kv_bytes_per_token_per_rank:,} per rank) · block {p.block_size}"
        )
    for t in p.tiers:
        lines.append(f"   tier {t.name:<5}{gib(t.bytes):>12}  {t.tokens:>14,} tokens  {t.blocks:>10,} blocks")
    if p.feasible:
        lines.append(
            f"   one max-length sequence needs {gib(p.sequence_bytes)}; concurrency {p.max_concurrency:.2f}x"
        )
        if p.offload_backend:
            lines.append(f"   offload   {p.offload_reason}")
        lines.append(
            f"   pod       memory {gib(p.memory_bytes)} · /dev/shm {gib(p.shm_bytes)}"
            + (f" · PVC {gib(p.pvc_bytes)}" if p.pvc_bytes else "")
            + (f" · {p.gpus} GPU" if p.gpus else "")
        )
        lines.append("   vllm      " + " ".join(p.engine_args))
        if p.engine_env:
            lines.append("   env       " + " ".join(f"{k}={v}" for k, v in sorted(p.engine_env.items())))
        if p.lmcache:
            lines.append("   lmcache   " + " ".join(p.lmcache.args))
    for pr in p.problems:
        lines.append(f"   ERROR     {pr.message()}")
    for w in p.warnings:
        lines.append(f"   warning   {w}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstrata plan", description=__doc__)
    parser.add_argument("path", type=Path, help="manifest file or directory of manifests")
    parser.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")
    args = parser.parse_args(argv)
    if not args.path.exists():
        print(f"kvstrata plan: {args.path}: no such file or directory", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    failed = False
    try:
        docs: list[Document] = list(iter_documents(args.path))
    except ManifestError as err:
        print(f"kvstrata plan: {err}", file=sys.stderr)
        return 1
    for doc in docs:
        try:
            ic = validate(doc.body)
        except ManifestError as err:
            failed = True
            print(f"{doc.source}: invalid: {err}", file=sys.stderr)
            continue
        name = f"{ic.metadata.name} ({doc.source})"
        p = plan(ic.spec)
        failed |= not p.feasible
        if args.output == "table":
            print(table(name, p) + "\n")
        else:
            results.append(plan_dict(ic.metadata.name, p))
    if args.output == "json":
        print(json.dumps(results, indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump(results, sort_keys=False))
    return 1 if failed else 0
