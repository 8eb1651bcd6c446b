"""On-disk cache of captured op graphs, so that ``tag plan`` after ``tag inspect`` (or a
dataset generator revisiting a model) does not capture the same model again.

A graph is stored as ``OpGraph`` JSON under ``<folder>/<key>.json``, regrouped on load
(grouping is deterministic). The key hashes everything the graph depends on:

* the workload spec as given, the batch (``None``: the workload's default), the optimizer and
  the precision (``fp32`` until captures under autocast record it);
* the factory's source file for ``file.py:function`` and ``package.module:function`` specs
  (the module's own file; code it imports is not hashed: pass ``--no-cache`` after editing it);
  the seed for factories (a zoo graph does not depend on it: weights are random values);
* the versions of torch and transformers and the source of the capture (``tag/graph`` and
  ``tag/workloads``), so a change to any of them misses instead of serving a stale graph.

The default folder is ``cache_dir()/graphs`` (``$TAG_CACHE_DIR``, see :func:`tag.io.cache_dir`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..io import cache_dir, write_atomic
from .ir import OpGraph

FORMAT = 1
"""Bumped when the stored JSON changes meaning."""


@functools.cache
def _code_digest() -> str:
    """Hash of the capture's own source: tag/graph and tag/workloads, and library versions."""
    h = hashlib.sha256(f"format={FORMAT}".encode())
    for pkg in ("torch", "transformers"):
        try:
            h.update(f"{pkg}={importlib.metadata.version(pkg)};".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{pkg}=none;".encode())
    root = Path(__file__).resolve().parent.parent
    for sub in ("graph", "workloads"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _factory_source(spec: str) -> bytes:
    """Bytes of the file defining a factory spec (empty for zoo specs and unresolvable ones)."""
    target, colon, attr = spec.rpartition(":")
    if not colon or not target:
        return b""
    path: str | None = target if target.endswith(".py") else None
    if path is None:
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            found = None
        path = found.origin if found is not None else None
    try:
        return Path(path).read_bytes() if path and os.path.isfile(path) else b""
    except OSError:
        return b""


def graph_key(spec: str, batch: int | None, optimizer: str, *, precision: str = "fp32",
              seed: int = 0, zoo: bool = True) -> str:
    """Cache key of the graph of ``spec`` (see the module docstring for what it covers)."""
    parts = {"spec": spec.strip(), "batch": batch, "optimizer": optimizer, "precision": precision,
             "code": _code_digest()}
    if not zoo:
        parts["seed"] = seed
        parts["source"] = hashlib.sha256(_factory_source(spec.strip())).hexdigest()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def default_folder() -> Path:
    return cache_dir() / "graphs"


def cached_graph(key: str, capture: Callable[[], OpGraph], num_groups: int, *, folder: str | os.PathLike | None = None,
                 use_cache: bool = True) -> tuple[OpGraph, float, bool]:
    """The graph stored under ``key``, else ``capture()`` (stored unless ``use_cache`` is False).

    Returns ``(graph grouped into num_groups, seconds spent, whether it came from the cache)``.
    A stored file that cannot be read as a graph counts as a miss and is replaced.
    """
    from .grouping import group_ops

    path = Path(folder if folder is not None else default_folder()) / f"{key}.json"
    t0 = time.perf_counter()
    graph = None
    if use_cache and path.is_file():
        try:
            graph = OpGraph.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            graph = None
    hit = graph is not None
    if graph is None:
        graph = capture()
        if use_cache:
            write_atomic(path, graph.to_json())
    group_ops(graph, num_groups)
    return graph, time.perf_counter() - t0, hit
