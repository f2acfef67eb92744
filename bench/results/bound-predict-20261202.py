"""In process: an index at its bound (2M blocks over three engines, all confirmed by events), then a
4 MB prompt's 38,000 new blocks predicted on one engine: the predict evicts 38,000 entries. Times the
predict (which runs under the router lock). Five repeats, each on a fresh index."""

import random
import sys
import time

from kvstrata.router.events import BlockStored
from kvstrata.router.index import BlockIndex


def one(seed):
    random.Random(seed)
    idx = BlockIndex(2_000_000)
    h = 1
    for ep in "abc":
        for _ in range(667):
            hs = list(range(h, h + 1000))
            h += 1000
            idx.apply(
                ep,
                BlockStored(
                    block_hashes=tuple(hs),
                    parent_block_hash=None,
                    token_ids=(),
                    block_size=32,
                    lora_id=None,
                    medium="GPU",
                ),
            )
    new = list(range(h, h + 38_000))
    t = time.perf_counter()
    idx.predict("a", new, ttl=60)
    dt = time.perf_counter() - t
    return dt * 1000, len(idx), idx.evictions


out = [one(s) for s in range(5)]
print(
    sys.argv[1],
    "predict ms:",
    " ".join(f"{ms:.1f}" for ms, _, _ in out),
    "| size",
    out[0][1],
    "evictions",
    out[0][2],
)
