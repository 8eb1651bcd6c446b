"""The labelled decisions as a PyG ``InMemoryDataset`` (read with ``weights_only=True`` only).

Each item is one decision of an MCTS episode: the joint encoding of (graph, topology, partial
plan, simulator feedback) (:meth:`tag.gnn.JointContext.encode`) with targets ``action.pi`` (the
visit distribution over the candidate actions, sharpened towards the children whose own plan
simulated best: :class:`PolicyTarget`) and ``value`` (``log(t / t_ref)`` of the best plan
found below that decision). Raw episodes live in ``<root>/raw/*.json`` (see
:mod:`tag.data.generate`); ``process()`` rebuilds the encodings from them, so a feature change needs
no new searches. Normalisation is a transform (default :class:`tag.gnn.JointNormalize`, applied
once as ``pre_transform``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch_geometric.data import HeteroData, InMemoryDataset

from ..errors import TagError
from ..gnn.features import COARSE_ABOVE, SCHEMA, coarse_level, with_unit_mult
from ..gnn.model import VALUE_CLIP, reward_to_value
from ..gnn.transforms import JointNormalize
from ..io import load_tensors, save_tensors
from .generate import graphs_dir, load_graph

_SCHEMA_TAG = hashlib.sha256(json.dumps([SCHEMA, VALUE_CLIP]).encode()).hexdigest()[:8]


class _State:
    __slots__ = ("assign", "group", "feedback", "resolved")

    def __init__(self, assign, group, feedback):
        self.assign, self.group, self.feedback, self.resolved = assign, group, feedback, None


@dataclass(frozen=True)
class PolicyTarget:
    """How a labelled decision's policy target is made from its search.

    ``pi = (1 - mix) * visits + mix * softmax((log(1 + r_a) - max_b log(1 + r_b)) / tau)``, the
    softmax over the children the search evaluated (``r_a``: the reward of child ``a``'s own
    completed plan, ``t_ref / t - 1``, so ``log(1 + r)`` is ``-log t`` up to a constant).

    The visit counts alone say little where rewards are nearly flat: 32 playouts over ~10
    actions give every child a few visits. The second term says which decision improved the
    plan at once, in units of log iteration time. Measured on 30 held-out random pairs (seed
    7777, training models on unseen clusters), GNN-MCTS at 50 playouts matched uniform-prior
    MCTS at 2,000 on 30 (geomean 0.998) with ``mix = 0.5`` and on 28 (1.0006) with visits
    alone (``mix = 0``): two networks trained alike otherwise (the ``mix = 0`` one before fitting
    went to one thread, so its float noise differs too).
    """

    mix: float = 0.5
    """Weight of the reward softmax (0: visit counts alone, as AlphaZero)."""
    tau: float = 0.01
    """Temperature of the softmax in log iteration time (0.01: a child 1% slower weighs 1/e)."""

    def __post_init__(self):
        if not 0 <= self.mix <= 1:
            raise ValueError(f"target.mix: expected in [0, 1], got {self.mix}")
        if not self.tau > 0:
            raise ValueError(f"target.tau: expected > 0, got {self.tau}")

    @property
    def tag(self) -> str:
        return f"m{self.mix:g}t{self.tau:g}"

    def __call__(self, decision: dict) -> list[float]:
        """The target over the actions of one raw decision record."""
        visits = np.asarray(decision["visits"], dtype=np.float64)
        rewards = decision.get("child_reward")  # absent in records labelled before it was stored
        if self.mix == 0 or rewards is None:
            return visits.tolist()
        v = np.array([np.log1p(r) if r is not None and r > -1.0 else -np.inf for r in rewards])
        if not np.isfinite(v).any():
            return visits.tolist()
        w = np.where(np.isfinite(v), np.exp((v - v[np.isfinite(v)].max()) / self.tau), 0.0)
        return ((1 - self.mix) * visits + self.mix * w / w.sum()).tolist()


def records_to_data(root: Path, rec: dict, target: PolicyTarget | None = None,
                    coarse_above: int = COARSE_ABOVE) -> list:
    """Encodings of every decision of one raw episode record (clusters of more than
    ``coarse_above`` devices with one device node per machine, as the predictor encodes them)."""
    target = target or PolicyTarget()
    from ..search.evaluate import Feedback
    from ..search.space import ActionSpace
    from ..topology import load_topology
    pair = rec["pair"]
    graph = load_graph(graphs_dir(root), pair["model"], pair["batch"], pair["groups"])
    topo = load_topology(pair["topology"])
    space = ActionSpace(graph, topo)
    if space.num_actions != rec["num_actions"]:
        return []  # action space changed since labelling; skip the stale record
    from ..gnn.features import JointContext
    ctx = JointContext(space, rec["t_ref"], coarse=coarse_level(space.num_devices, coarse_above))
    out = []
    for d in rec["decisions"]:
        f = d["feedback"]
        fb = Feedback(np.nan, False, np.asarray(f["util"]), np.asarray(f["mem"]), np.asarray(f["comm"]),
                      np.asarray(f["finish"]))
        st = _State(np.asarray(d["assign"]), d["group"], fb)
        value = reward_to_value(d["best_reward"]) if "best_reward" in d else d["value"]
        data = with_unit_mult(ctx.encode([st], targets=[(target(d), value)]))  # collates with coarse states
        for nt in ("group", "device", "action"):
            del data[nt].batch
        out.append(data)
    return out


class DatasetError(TagError):
    """A dataset folder or its processed file is malformed."""


class PlanDataset(InMemoryDataset):
    """Decisions labelled by MCTS under ``root`` (``root/raw/*.json``).

    The encodings are cached in ``root/processed/`` as tensors and plain containers only
    (:func:`tag.io.save_tensors`) and read back with ``weights_only=True``
    (:func:`tag.io.load_tensors`): a dataset folder someone handed over never runs code. The class
    defines no ``process()`` / ``download()``, so PyG's own processing, which unpickles
    ``pre_transform.pt`` / ``pre_filter.pt`` and falls back to ``weights_only=False`` for the data
    file, never runs; files it left in older folders are ignored.

    Args:
        root: dataset folder written by :func:`tag.data.generate.generate`.
        transform: applied on access.
        pre_transform: applied once when processing (default: :class:`JointNormalize`).
        force_reload: rebuild the processed file from ``raw/`` even if it exists.
        target: how the policy targets are made (:class:`PolicyTarget`).
        coarse_above: clusters of more devices are encoded with one node per machine
            (:func:`tag.gnn.features.coarse_level`).
    """

    FORMAT = "tag-dataset"

    def __init__(self, root, transform=None, pre_transform=None, force_reload: bool = False,
                 target: PolicyTarget | None = None, coarse_above: int = COARSE_ABOVE):
        self._raw = sorted((Path(root) / "raw").glob("*.json"))
        self.target = target or PolicyTarget()
        self.coarse_above = coarse_above
        super().__init__(str(root), transform, pre_transform or JointNormalize(), force_reload=force_reload)
        path = Path(self.processed_paths[0])
        if force_reload or not path.exists():
            self._build(path)
        self._read(path)

    @property
    def raw_file_names(self) -> list[str]:
        return [p.name for p in self._raw]

    @property
    def processed_file_names(self) -> list[str]:
        # "tensors_": the safe format; files of the pickled format (decisions_*.pt) are never read.
        return [f"tensors_{len(self._raw)}_{_SCHEMA_TAG}_{self.target.tag}_c{self.coarse_above}.pt"]

    def _build(self, path: Path) -> None:
        items = []
        root = Path(self.root)
        for p in self._raw:
            rec = json.loads(p.read_text())
            for d in records_to_data(root, rec, self.target, self.coarse_above):
                items.append(self.pre_transform(d) if self.pre_transform is not None else d)
        if not items:
            raise DatasetError(f"{self.root}: no labelled decisions in raw/")
        data, slices = self.collate(items)
        save_tensors(path, {"format": self.FORMAT, "version": 1, "data": data.to_dict(), "slices": slices})

    def _read(self, path: Path) -> None:
        obj = load_tensors(path, DatasetError, "TAG dataset file")
        if not (isinstance(obj, dict) and obj.get("format") == self.FORMAT and isinstance(obj.get("data"), dict)
                and isinstance(obj.get("slices"), (dict, type(None)))):
            raise DatasetError(f"{path}: format: expected a {self.FORMAT!r} file (delete it to rebuild from raw/)")
        try:
            self.data = HeteroData.from_dict(obj["data"])
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise DatasetError(f"{path}: data: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self.slices = obj["slices"]


def split(dataset, val_fraction: float, seed: int) -> tuple:
    """Deterministic train / validation index split."""
    n = len(dataset)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    nv = max(1, int(round(n * val_fraction))) if n > 1 else 0
    return dataset[perm[nv:]], dataset[perm[:nv]]
