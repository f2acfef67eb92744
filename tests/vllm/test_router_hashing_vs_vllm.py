"""The router's block hashes equal vLLM 0.32.0's own ``hash_block_tokens`` chain for every hash algorithm
the API admits (run in the vLLM venv, with vLLM's ``init_none_hash``, PYTHONHASHSEED unset as in the
rendered engine pods)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvstrata.api.router_config import HASH_ALGOS, HashAlgo
from kvstrata.router.hashing import block_hashes

_VLLM_CHAIN = """
import json, sys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
algo, block_size, tokens = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
fn = get_hash_fn_by_name(algo)
k.init_none_hash(fn)
out, parent = [], None
for start in range(0, len(tokens) - block_size + 1, block_size):
    parent = k.hash_block_tokens(fn, parent, tokens[start : start + block_size], None)
    out.append(int.from_bytes(parent, "big") & (2**64 - 1))
print(json.dumps(out))
"""


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_router_block_hashes_equal_vllms(vllm_py: Path, algo: HashAlgo) -> None:
    # Token ids across CBOR's integer widths (1, 2, 3, 5 bytes) and a partial tail block.
    tokens = [0, 1, 23, 24, 255, 256, 65535, 65536, 151_000, 7, 8, 9, 10, 11, 12, 13, 2**32 + 5, 3]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    done = subprocess.run(
        [str(vllm_py), "-c", _VLLM_CHAIN, algo, "4", json.dumps(tokens)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(want) == 4
    assert list(block_hashes(tokens, 4, algo)) == want
