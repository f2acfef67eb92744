"""Fixtures for tests that run real vLLM CPU engines (marker ``vllm``).

The vLLM venv is a hard requirement here: a missing venv is an error that says how to install it
(``make vllm``), never a skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata_dev.testing.engines import VllmEngine, free_port, vllm_python
from kvstrata_dev.testing.tinymodel import default_tiny_model_dir, ensure_tiny_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_py() -> Path:
    return vllm_python()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model(default_tiny_model_dir())


@pytest.fixture(scope="module")
def engine(tiny_model: Path, vllm_py: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    """One real engine on the tiny model with KV events and replay, shared by a test module."""
    log_dir = tmp_path_factory.mktemp("engine")
    eng = VllmEngine(
        tiny_model,
        port=free_port(),
        kv_events_port=free_port(),
        kv_replay_port=free_port(),
        log_path=log_dir / "engine.log",
    )
    with eng:
        eng.wait_ready(timeout=600)
        yield eng
