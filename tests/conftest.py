"""Shared fixtures: captured zoo graphs are expensive (1-6 s each), so capture once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def captured():
    """``captured(spec, batch=None, groups=16, optimizer="adam", precision="fp32")`` -> cached :class:`Captured`."""
    from tag.graph import capture
    from tag.workloads import load_workload

    cache = {}

    def get(spec: str, batch: int | None = None, groups: int = 16, optimizer: str = "adam", precision: str = "fp32"):
        key = (spec, batch, groups, optimizer, precision)
        if key not in cache:
            cache[key] = capture(load_workload(spec, batch=batch), optimizer=optimizer, num_groups=groups,
                                 precision=precision)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def topo4():
    """The shipped 4-rank local CPU topology."""
    from tag.topology import load_topology

    return load_topology("topologies/local-cpu4.yaml")


@pytest.fixture
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test's own process group or torchrun rendezvous)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def forked():
    """``forked(fn, args, nprocs)``: ``fn(rank, *args)`` in ``nprocs`` processes forked from the fork
    server the executor starts its gloo ranks from (:func:`tag.executor.launch.forkserver_preload`'s
    modules imported there once), joined; a rank's exception is raised. ``torch.multiprocessing.spawn``
    would start each in a fresh interpreter importing torch (~3 s of CPU a process)."""
    import multiprocessing

    import torch.multiprocessing as mp

    from tag.executor.launch import forkserver_preload

    multiprocessing.set_forkserver_preload(forkserver_preload())

    def run(fn, args: tuple, nprocs: int) -> None:
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")

    return run


@pytest.fixture(autouse=True)
def _tag_cache(tmp_path_factory, monkeypatch):
    """Keep TAG's user cache (measured CPU spec, ...) inside the test session."""
    monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tag-cache"))
