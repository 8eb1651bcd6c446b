"""Label (model, topology) pairs with MCTS, in parallel processes or on a Ray cluster
(:mod:`tag.dispatch`), resumably.

Layout of a dataset folder::

    graphs/<key>.json     captured OpGraphs (OpGraph.to_json), shared by every sample of a model
    raw/<index>.json      one labelled episode: the pair, and per decision the partial plan, the
                          simulator feedback, the MCTS visit distribution and the value target
    processed/...         the PyG dataset built from raw/ (see tag.data.dataset.PlanDataset)

A sample is written atomically (by the process that started the generation, whichever worker
labelled it) when its episode ends, so a killed generation resumes by skipping the samples whose
file exists: nothing finished is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..dispatch import Backend, run_tasks
from ..io import write_atomic, write_json
from .pairs import PairSpec, check_large_inputs, sample_pair

MAX_WORKERS = 256
"""Most labelling processes: each imports torch and captures graphs (hundreds of MiB apiece), so
a larger count would exhaust any single machine before it labels a pair."""


@dataclass
class GenConfig:
    """How to label pairs."""

    samples: int = 64
    """Number of (model, topology) pairs (episodes)."""
    seed: int = 0
    """Seed of the pair stream and of the searches."""
    playouts_per_step: int = 32
    """MCTS playouts per decision of an episode."""
    max_steps: int = 8
    """Decisions labelled per episode (the first, most important, groups in decision order)."""
    max_groups: int = 32
    """Largest op-group count drawn."""
    temperature_steps: int = 2
    """Early decisions sampled from the visit distribution (exploration) instead of argmax."""
    dirichlet: float = 0.25
    """Dirichlet noise weight on the root prior."""
    workers: int = 2
    """Parallel processes."""
    optimizer: str = "adam"
    """Optimizer captured into the graphs."""
    models: list[str] | None = None
    """Override the training models: ``["zoo-spec@batch", ...]`` (default: :data:`tag.data.pairs.TRAIN_MODELS`)."""
    simulator: str = "sim"
    """``sim`` (:class:`tag.sim.Simulator`) or ``toy`` (:class:`tag.search.toy.ToySimulator`, tests only)."""
    large_fraction: float = 0.0
    """Share of the pairs drawn at scale (:func:`tag.data.pairs.random_large_topology`, 48-256 GPUs,
    :data:`tag.data.pairs.LARGE_MODELS`); the others are the pairs of ``0``."""
    label_children: int = 0
    """Labelled decisions, the first ones, at which every action the search tells apart
    (:func:`tag.search.mcts.search_actions`) gets its own completed plan simulated once after the
    episode (:func:`tag.search.mcts.evaluate_children`), so that the reward half of the policy
    target (:class:`tag.data.dataset.PolicyTarget`) ranks every action and not only the few the
    search tried; 0: only the children the search simulated (the records of before 2026-11-27,
    byte for byte); ``max_steps`` or more: every labelled decision. Costs one simulator call per
    action not yet simulated (records: ``label_sim_calls``, ``label_seconds``): on 2026-11-27 a
    median 89 calls / 0.11 s more per small pair, 1,085 / 4.4 s per pair at scale (over round 0's
    98 pairs at scale 2.5x the seconds of their searches).
    ``tag train`` labels with 8 (:data:`tag.training.config.RECIPE_GEN`)."""
    large_inputs: str = "zoo"
    """Inputs of the models of the pairs at scale: ``zoo`` (the zoo's defaults, 64 tokens / 32x32
    images: the pairs of before 2026-11-27) or ``full`` (:data:`tag.data.pairs.LARGE_INPUTS`:
    512 tokens, 224x224 images, so that compute per sample against parameter bytes is that of
    models trained at scale); the pairs drawn are the same, their graphs are captured anew."""

    def __post_init__(self):
        if self.samples < 0:
            raise ValueError(f"samples: expected >= 0, got {self.samples}")
        if self.playouts_per_step < 1:
            raise ValueError(f"playouts_per_step: expected >= 1, got {self.playouts_per_step}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps: expected >= 1, got {self.max_steps}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers: expected 1..{MAX_WORKERS} processes, got {self.workers}")
        if self.seed < 0:
            raise ValueError(f"seed: expected >= 0, got {self.seed}")
        if not 0 <= self.dirichlet < 1:
            raise ValueError(f"dirichlet: expected in [0, 1), got {self.dirichlet}")
        for m in self.models or []:
            spec, _, b = m.rpartition("@")
            if not spec or not b.isdigit() or int(b) < 1:
                raise ValueError(f"models: expected 'zoo-spec@batch', got {m!r}")
        if not 0 <= self.large_fraction <= 1:
            raise ValueError(f"large_fraction: expected in [0, 1], got {self.large_fraction}")
        check_large_inputs(self.large_inputs)
        if self.label_children < 0:
            raise ValueError(f"label_children: expected >= 0, got {self.label_children}")
        if self.simulator not in ("sim", "toy"):
            raise ValueError(f"simulator: expected 'sim' or 'toy', got {self.simulator!r}")


def graph_key(model: str, batch: int, optimizer: str) -> str:
    return hashlib.sha256(f"{model}|{batch}|{optimizer}".encode()).hexdigest()[:16]


def graphs_dir(root: str | os.PathLike) -> Path:
    """Folder of cached graphs of a dataset (``gen_config.json``'s ``graphs_dir``, else ``root/graphs``)."""
    root = Path(root)
    cfg = root / "gen_config.json"
    if cfg.exists():
        g = json.loads(cfg.read_text()).get("graphs_dir")
        if g:
            return Path(g) if Path(g).is_absolute() else root / g
    return root / "graphs"


def load_graph(gdir: str | os.PathLike | Mapping[str, str], model: str, batch: int, groups: int,
               optimizer: str = "adam"):
    """The captured graph of ``model`` at ``batch``, regrouped into ``groups`` (cached as JSON in
    ``gdir``; or ``gdir`` maps :func:`graph_key` to that JSON, as labelling workers hold it)."""
    from ..graph import OpGraph, group_ops
    if isinstance(gdir, Mapping) and graph_key(model, batch, optimizer) in gdir:
        g = OpGraph.from_json(gdir[graph_key(model, batch, optimizer)])
        group_ops(g, groups)
        return g
    if isinstance(gdir, Mapping):
        raise KeyError(f"graph of {model} at batch {batch} was not captured")
    path = Path(gdir) / f"{graph_key(model, batch, optimizer)}.json"
    if path.exists():
        g = OpGraph.from_json(path.read_text())
    else:
        from ..graph import capture
        from ..workloads import load_workload
        g = capture(load_workload(model, batch=batch, seed=0), optimizer=optimizer, num_groups=groups).graph
        from ..io import write_atomic
        write_atomic(path, g.to_json())
    group_ops(g, groups)
    return g


def label_pair(gdir: Path | Mapping[str, str], spec: PairSpec, cfg: GenConfig, prior=None, simulator_factory=None) -> dict:
    """Run one labelling episode; returns the JSON-able record."""
    from ..gnn.model import reward_to_value
    from ..search.evaluate import Evaluator
    from ..search.mcts import MCTSConfig, evaluate_children, run_episode, uniform_prior
    from ..search.space import ActionSpace
    from ..topology import load_topology

    t0 = time.perf_counter()
    graph = load_graph(gdir, spec.model, spec.batch, spec.groups, cfg.optimizer)
    topo = load_topology(spec.topology)
    space = ActionSpace(graph, topo)
    if simulator_factory is not None:
        sim = simulator_factory(graph, topo)
    elif cfg.simulator == "toy":
        from ..search.toy import ToySimulator
        sim = ToySimulator(graph, topo, space.costs)
    else:
        sim = None
    ev = Evaluator(space, sim)
    prior_fn = uniform_prior if prior is None else prior.bind(space, ev.t_ref)
    rng = np.random.default_rng([cfg.seed, spec.index, 7])
    mcfg = MCTSConfig(value_cut=False, dirichlet=cfg.dirichlet if prior is not None else 0.0)
    decisions, tree, stats = run_episode(space, ev, prior_fn, rng, playouts_per_step=cfg.playouts_per_step,
                                         cfg=mcfg, temperature_steps=cfg.temperature_steps,
                                         max_steps=cfg.max_steps)
    search_calls, t_label = ev.sim_calls, time.perf_counter()
    for d in decisions[:cfg.label_children]:  # after the episode: the search is the unlabelled one
        evaluate_children(tree, d.node, space, ev)
    label = {"label_sim_calls": ev.sim_calls - search_calls,
             "label_seconds": time.perf_counter() - t_label} if cfg.label_children else {}
    recs = []
    for d in decisions:
        best = float(tree.best[d.node])
        # reward of each child's own completed plan (None: not evaluated, or cut by the value head)
        child_reward = [ev.reward(tree.feedback[c].iteration_time_s, tree.feedback[c].oom)
                        if c >= 0 and tree.feedback[c] is not None else None for c in tree.children[d.node]]
        recs.append({
            "assign": d.assign.tolist(), "group": int(d.group), "visits": np.round(d.visits, 6).tolist(),
            "child_reward": child_reward,
            "value": reward_to_value(best if np.isfinite(best) else -1.0),
            "best_reward": best if np.isfinite(best) else -1.0,
            "feedback": {"util": d.feedback.device_util.tolist(), "mem": d.feedback.device_mem.tolist(),
                         "comm": d.feedback.device_comm.tolist(), "finish": d.feedback.group_finish.tolist()},
        })
    return {"pair": spec.to_dict(), "graph_signature": graph.signature(), "num_actions": space.num_actions,
            "t_ref": ev.t_ref, "dp_even_s": ev.dp_even_out.time_s, "dp_prop_s": ev.dp_prop_out.time_s,
            "best_time_s": ev.best.time_s, "best_oom": ev.best.oom, "best_reward": ev.best_reward,
            "sim_calls": ev.sim_calls, "playouts": stats.playouts, **label, "seconds": time.perf_counter() - t0,
            "decisions": recs}


# ---------------------------------------------------------------------------------- workers
def label_setup(shared: dict) -> dict:
    """A labelling worker's context (once per worker): the config, the prior's network, the graphs."""
    import torch
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return {**shared, "cfg": GenConfig(**shared["cfg"])}


def label_task(ctx: dict, index: int) -> dict:
    """Label pair ``index``: ``{"record": ...}``, or ``{"failed": ...}`` for a pair whose search
    raised (written to ``failed/``, never retried: it would raise again)."""
    cfg = ctx["cfg"]
    spec = _spec(cfg, index)
    lost = ctx["capture_errors"].get(graph_key(spec.model, spec.batch, cfg.optimizer))
    if lost is not None:  # its graph's capture raised: so would the pair's
        return {"failed": {"pair": spec.to_dict(), "error": lost[:500]}}
    try:
        return {"record": label_pair(ctx["graphs"], spec, cfg, ctx["prior"])}
    except Exception as e:  # noqa: BLE001 - a bad pair must not stop the whole run
        return {"failed": {"pair": spec.to_dict(), "error": repr(e)[:500]}}


def capture_task(ctx: dict, key: tuple[str, int, int]) -> str:
    """The captured graph of ``(model, batch, groups)`` as JSON (written to the cache by the caller)."""
    from ..graph import capture
    from ..workloads import load_workload
    model, batch, groups = key
    return capture(load_workload(model, batch=batch, seed=0), optimizer=ctx["cfg"].optimizer,
                   num_groups=groups).graph.to_json()


def _spec(cfg: GenConfig, index: int) -> PairSpec:
    return sample_pair(cfg.seed, index, max_groups=cfg.max_groups, models=_models(cfg),
                       large_fraction=cfg.large_fraction, large_inputs=cfg.large_inputs)


def _models(cfg: GenConfig):
    from .pairs import TRAIN_MODELS
    if not cfg.models:
        return TRAIN_MODELS
    return tuple((m.rpartition("@")[0], (int(m.rpartition("@")[2]),)) for m in cfg.models)


def pending(root: Path, cfg: GenConfig) -> list[int]:
    raw = Path(root) / "raw"
    failed = Path(root) / "failed"
    return [i for i in range(cfg.samples)
            if not (raw / f"{i:05d}.json").exists() and not (failed / f"{i:05d}.json").exists()]


def generate(root: str | os.PathLike, cfg: GenConfig, net_path: str | None = None, *,
             progress: bool = True, graphs: str | os.PathLike | None = None, backend: Backend | None = None,
             log: Callable[[dict], None] | None = None) -> dict:
    """Label ``cfg.samples`` pairs into ``root`` (resuming) on ``backend`` (default: a local pool
    of ``cfg.workers`` processes).

    Two jobs: the graphs no pair to label finds in the cache are captured (one item per model and
    batch), then the pairs are labelled, every worker given the network and the graphs once.
    ``graphs``: folder of cached captured graphs (default ``root/graphs``), shareable by datasets;
    ``log``: receives the progress records."""
    root = Path(root)
    backend = backend or Backend(workers=cfg.workers)
    (root / "raw").mkdir(parents=True, exist_ok=True)
    gdir = os.path.relpath(Path(graphs).resolve(), root.resolve()) if graphs is not None else "graphs"
    write_json(root / "gen_config.json", {**asdict(cfg), "net": net_path, "graphs_dir": gdir})
    todo = pending(root, cfg)
    t0 = time.perf_counter()
    texts, lost = _graph_texts(root, cfg, todo, backend, progress, log)
    shared = {"cfg": asdict(cfg), "graphs": texts, "capture_errors": lost, "prior": None}
    if todo and net_path:
        from ..gnn.predictor import Predictor
        shared["prior"] = Predictor.load(net_path)
    errors = 0
    for out in run_tasks(label_task, todo, setup=label_setup, shared=shared, backend=backend,
                         desc=f"label {root.name}", progress=progress, log=log,
                         done_before=cfg.samples - len(todo), total=cfg.samples):
        if out.error is not None:  # its worker lost (more than Ray's retries): labelled by the next run
            errors += 1
        elif "failed" in out.result:
            errors += 1
            write_json(root / "failed" / f"{out.item:05d}.json", out.result["failed"])
        else:
            write_json(root / "raw" / f"{out.item:05d}.json", out.result["record"], indent=None)
    done = len(list((root / "raw").glob("*.json")))
    return {"samples": done, "errors": errors, "seconds": time.perf_counter() - t0}


def _graph_texts(root: Path, cfg: GenConfig, todo: list[int], backend: Backend, progress: bool,
                 log) -> tuple[dict[str, str], dict[str, str]]:
    """``{graph_key: OpGraph JSON}`` of the pairs ``todo`` and ``{graph_key: error}`` of those
    whose capture failed; those not in the cache are captured first, each at the op-group count of
    its first pair (:func:`load_graph` regroups every pair's graph to its own count)."""
    gdir = graphs_dir(root)
    first: dict[str, tuple[str, int, int]] = {}
    for i in todo:
        spec = _spec(cfg, i)
        first.setdefault(graph_key(spec.model, spec.batch, cfg.optimizer), (spec.model, spec.batch, spec.groups))
    missing = {k: v for k, v in first.items() if not (gdir / f"{k}.json").exists()}
    lost = {}
    for out in run_tasks(capture_task, list(missing.values()), setup=label_setup, shared={"cfg": asdict(cfg)},
                         backend=backend, desc=f"capture {root.name}", progress=progress, log=log):
        model, batch, _ = out.item
        if out.error is not None:
            lost[graph_key(model, batch, cfg.optimizer)] = out.error
        else:
            write_atomic(gdir / f"{graph_key(model, batch, cfg.optimizer)}.json", out.result)
    return {k: (gdir / f"{k}.json").read_text() for k in first if k not in lost}, lost


def read_records(root: str | os.PathLike) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((Path(root) / "raw").glob("*.json"))]
