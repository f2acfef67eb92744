"""vLLM's native KV offloading (CPU DRAM tier + fs/NVMe tier) on vLLM's CPU platform.

vLLM 0.32's offloading stack (OffloadingConnector, the tiering manager, its fs tier, events and metrics)
is platform-neutral except one piece: the worker that copies blocks between the engine's KV pool and
the host region. `CPUOffloadingSpec.get_worker` refuses every platform but CUDA/XPU, because its worker
drives CUDA streams and a DMA kernel. On the CPU platform the engine's KV pool is itself host memory,
so that worker's job is a plain memory copy: `HostCopyWorker` below is the CPU platform's stand-in for
the CUDA copy kernel. Everything else — the spec's sizing, the shared region, the managers, the fs
tier — is vLLM's own code, unchanged.

vLLM loads this module by name from `--kv-transfer-config`:
`{"spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "kvstrata.engine.cpu_offload", ...}`.
Both the API server (it builds the offload metrics from the spec class) and the engine core import it,
so it must import nothing of kvstrata but this package (no pydantic, no kopf): only vLLM, torch, numpy.

Copies run synchronously inside `submit_*`. That is safe on this platform: the connector submits loads
before the step's forward pass and stores at the start of the next step (after the forward that wrote
those blocks has returned — CPU execution is synchronous), and the scheduler fences block reuse until
a store's job is reported finished.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

# Under vLLM's logger tree, so these lines get its format and level like the rest of the engine log.
logger = init_logger(f"vllm.{__name__}")

SHM_REGION_GLOB = "/dev/shm/vllm_offload_*.mmap"
SPEC_NAME = "CpuTieringOffloadingSpec"
SPEC_MODULE = __name__


@dataclass(frozen=True)
class _Ref:
    """One layer (or layer group) of a KV cache group: which tensor pair, and its unpadded page bytes."""

    tensor_idx: int
    page_bytes: int


def sub_block_coords(
    chunk_ids: np.ndarray, blocks_per_chunk: int, skip: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """(chunk, slot) of `count` consecutive engine-sized pages starting `skip` pages into `chunk_ids[0]`.

    The same enumeration as vLLM's `compute_sub_block_ptrs`: an offloaded chunk holds `blocks_per_chunk`
    engine pages back to back, and a transfer may start or end part-way through its first/last chunk."""
    flat = (chunk_ids.astype(np.int64)[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    flat = flat[skip : skip + count]
    return flat // blocks_per_chunk, flat % blocks_per_chunk


def _paths_in_use() -> set[str]:
    """Every file some visible process has open or mapped (/proc/*/fd and /proc/*/maps)."""
    used: set[str] = set()
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    used.add(os.readlink(f"{proc}/fd/{fd}"))
                except OSError:
                    continue
            with open(f"{proc}/maps") as maps:
                # address perms offset dev inode [path]: anonymous mappings have no path.
                fields = (line.split(maxsplit=5) for line in maps)
                used.update(f[5].strip() for f in fields if len(f) == 6)
        except OSError:
            continue
    return {u.removesuffix(" (deleted)") for u in used}


def remove_stale_regions(pattern: str = SHM_REGION_GLOB) -> list[str]:
    """Remove offload region files that no process has open or mapped: left by a killed engine.

    vLLM's tiering spec keeps its region's name until a clean shutdown, so a crash leaves the file (and
    its memory, charged to the pod's memory-backed /dev/shm) behind (vllm#54002). A restarted container
    gets a new engine id, so the leftover never collides by name, but each crash would strand another
    region's worth of /dev/shm until the next one no longer fits. An in-use region is always open or
    mapped by its engine (from O_EXCL create to cleanup), so it is never removed here."""
    candidates = glob.glob(pattern)
    if not candidates:
        return []
    in_use = _paths_in_use()
    removed = []
    for path in candidates:
        if path in in_use:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


class HostCopyWorker(OffloadingWorker):
    """Copies KV pages between the engine's pool tensors and the host region with torch indexing."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        self._blocks_per_chunk = blocks_per_chunk
        # Engine side: (num_blocks, page) int8; host side: (num_chunks, blocks_per_chunk, page) int8 with
        # the region's row stride (vLLM's layout: each chunk row holds every worker's slots, then padding).
        self._engine: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for kv in kv_caches.tensors:
            page = kv.page_size_bytes
            engine = kv.tensor.view(torch.int8).view((-1, page))
            if engine.device.type != "cpu":
                raise RuntimeError(f"HostCopyWorker copies host memory only, got a {engine.device} KV tensor")
            host = region.create_next_worker_view(page * blocks_per_chunk)
            self._engine.append(engine)
            self._host.append(host.unflatten(1, (blocks_per_chunk, page)))
        self._groups = [
            [_Ref(r.tensor_idx, r.page_size_bytes) for r in refs] for refs in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        self._finished.append(self._transfer(job_id, src_spec, dst_spec, to_host=True))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self._finished.append(self._transfer(job_id, dst_spec, src_spec, to_host=False))
        return True

    def _transfer(
        self, job_id: int, engine_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, *, to_host: bool
    ) -> TransferResult:
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        engine_ids, chunk_ids = engine_spec.block_ids, host_spec.block_ids
        e_off = h_off = 0
        nbytes = 0
        for refs, size, first in zip(
            self._groups, engine_spec.group_sizes, engine_spec.block_indices, strict=True
        ):
            if size == 0:
                continue
            skip = first % self._blocks_per_chunk
            n_chunks = -(-(size + skip) // self._blocks_per_chunk)
            blocks = torch.from_numpy(engine_ids[e_off : e_off + size].astype(np.int64))
            chunk, slot = (
                torch.from_numpy(a)
                for a in sub_block_coords(
                    chunk_ids[h_off : h_off + n_chunks], self._blocks_per_chunk, skip, size
                )
            )
            for ref in refs:
                engine, host, n = self._engine[ref.tensor_idx], self._host[ref.tensor_idx], ref.page_bytes
                if to_host:
                    host[chunk, slot, :n] = engine[blocks, :n]
                else:
                    engine[blocks, :n] = host[chunk, slot, :n]
                nbytes += size * n
            e_off += size
            h_off += n_chunks
        if e_off != len(engine_ids) or h_off != len(chunk_ids):
            raise RuntimeError(
                f"job {job_id}: transfer covered {e_off}/{len(engine_ids)} blocks, {h_off}/{len(chunk_ids)} chunks"
            )
        return TransferResult(
            job_id=job_id, success=True, transfer_size=nbytes, transfer_time=time.perf_counter() - start
        )

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy completed inside submit_*

    def shutdown(self) -> None:
        self._engine.clear()
        self._host.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec (CPU tier + secondary tiers) with the host-copy worker on device cpu.

    On CUDA/XPU it defers to vLLM's own worker, so the same flags stay valid on a GPU platform."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host_worker: OffloadingWorker | None = None

    def get_manager(self) -> Any:
        # The scheduler creates the region first (before any worker): clear a killed engine's leftovers.
        if self._manager is None:
            for path in remove_stale_regions():
                logger.warning("kvstrata: removed stale offload region %s (left by a killed engine)", path)
        return super().get_manager()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if self._host_worker is None:
            if self.config.canonical_layout:
                raise RuntimeError("canonical_layout is not supported by the CPU-platform offloading worker")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._host_worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except Exception:
                region.cleanup()
                raise
            logger.info("kvstrata: CPU-platform offloading worker over %d host chunks", self.num_chunks)
        return self._host_worker
