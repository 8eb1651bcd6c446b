"""The labelled decisions as a PyG ``InMemoryDataset``.

Each item is one decision of an MCTS episode: the joint encoding of (graph, topology, partial
plan, simulator feedback) (:meth:`tag.gnn.JointContext.encode`) with targets ``action.pi`` (the
visit distribution over the candidate actions) and ``value`` (``log(t / t_ref)`` of the best plan
found below that decision). Raw episodes live in ``<root>/raw/*.json`` (see
:mod:`data.generate`); ``process()`` rebuilds the encodings from them, so a feature change needs
no new searches. Normalisation is a transform (default :class:`tag.gnn.JointNormalize`, applied
once as ``pre_transform``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch_geometric.data import InMemoryDataset

from tag.gnn.features import SCHEMA
from tag.gnn.model import VALUE_CLIP, reward_to_value
from tag.gnn.transforms import JointNormalize

from .generate import graphs_dir, load_graph

_SCHEMA_TAG = hashlib.sha256(json.dumps([SCHEMA, VALUE_CLIP]).encode()).hexdigest()[:8]


class _State:
    __slots__ = ("assign", "group", "feedback", "resolved")

    def __init__(self, assign, group, feedback):
        self.assign, self.group, self.feedback, self.resolved = assign, group, feedback, None


def records_to_data(root: Path, rec: dict) -> list:
    """Encodings of every decision of one raw episode record."""
    from tag.search.evaluate import Feedback
    from tag.search.space import ActionSpace
    from tag.topology import load_topology
    pair = rec["pair"]
    graph = load_graph(graphs_dir(root), pair["model"], pair["batch"], pair["groups"])
    topo = load_topology(pair["topology"])
    space = ActionSpace(graph, topo)
    if space.num_actions != rec["num_actions"]:
        return []  # action space changed since labelling; skip the stale record
    from tag.gnn.features import JointContext
    ctx = JointContext(space, rec["t_ref"])
    out = []
    for d in rec["decisions"]:
        f = d["feedback"]
        fb = Feedback(np.nan, False, np.asarray(f["util"]), np.asarray(f["mem"]), np.asarray(f["comm"]),
                      np.asarray(f["finish"]))
        st = _State(np.asarray(d["assign"]), d["group"], fb)
        value = reward_to_value(d["best_reward"]) if "best_reward" in d else d["value"]
        data = ctx.encode([st], targets=[(d["visits"], value)])
        for nt in ("group", "device", "action"):
            del data[nt].batch
        out.append(data)
    return out


class PlanDataset(InMemoryDataset):
    """Decisions labelled by MCTS under ``root`` (``root/raw/*.json``).

    Args:
        root: dataset folder written by :func:`data.generate.generate`.
        transform: applied on access.
        pre_transform: applied once when processing (default: :class:`JointNormalize`).
    """

    def __init__(self, root, transform=None, pre_transform=None, force_reload: bool = False):
        self._raw = sorted((Path(root) / "raw").glob("*.json"))
        super().__init__(str(root), transform, pre_transform or JointNormalize(), force_reload=force_reload)
        self.load(self.processed_paths[0])

    @property
    def raw_file_names(self) -> list[str]:
        return [p.name for p in self._raw]

    @property
    def processed_file_names(self) -> list[str]:
        return [f"decisions_{len(self._raw)}_{_SCHEMA_TAG}.pt"]

    def download(self) -> None:  # raw files come from data.generate
        return

    def process(self) -> None:
        items = []
        root = Path(self.root)
        for p in self._raw:
            rec = json.loads(p.read_text())
            for d in records_to_data(root, rec):
                items.append(self.pre_transform(d) if self.pre_transform is not None else d)
        if not items:
            raise ValueError(f"{self.root}: no labelled decisions in raw/")
        self.save(items, self.processed_paths[0])


def split(dataset, val_fraction: float, seed: int) -> tuple:
    """Deterministic train / validation index split."""
    n = len(dataset)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    nv = max(1, int(round(n * val_fraction))) if n > 1 else 0
    return dataset[perm[nv:]], dataset[perm[:nv]]
