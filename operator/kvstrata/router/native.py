"""The router's native core (``native/``, Rust via PyO3): per-endpoint block tables whose bulk
operations walk a long prompt's thousands of blocks in one native pass, vLLM's block digests
computed with the GIL released, and the incremental encoder (router/incremental_native.py).

`make venv` builds and installs it from the repository (maturin, pinned crates); a bare
``pip install .`` of kvstrata does not, hence the explicit error."""

from __future__ import annotations

try:
    from kvstrata_native import (
        CPU,
        GPU,
        PREDICTED,
        STORAGE,
        BlockTable,
        Encoder,
        FollowUps,
        Prediction,
        Predictions,
        Ranker,
        Recency,
        Walk,
        block_digests,
    )
except ImportError as exc:  # pragma: no cover - only without the native package
    raise ImportError(
        "kvstrata's router needs its native core (kvstrata_native): `make venv`, or "
        "`pip install ./native` from the repository (needs Rust's cargo)"
    ) from exc

__all__ = [
    "CPU",
    "GPU",
    "PREDICTED",
    "STORAGE",
    "BlockTable",
    "Encoder",
    "FollowUps",
    "Prediction",
    "Predictions",
    "Ranker",
    "Recency",
    "Walk",
    "block_digests",
]
