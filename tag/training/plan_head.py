"""Fit the plan head (:class:`tag.gnn.TagNet`'s prior over plan-level pipeline decisions).

Labels: for each labelled pair of a training run (``round<r>/raw/*.json``), every pipeline the
search's plan-level decisions can reach (stage count > 1 x cut x stage deployment x micro-batches
x schedule: 12-132 plans on the pairs of 2026-11-27, 0.02-1 s of simulation) is simulated, and
"no pipeline" takes the best plan of the pair's labelling episode (TAG's per-group search).
Each decision node of that small tree (the stage count; then, under each choice so far, the cut,
the stage deployment, the micro-batch count, the schedule) gets the target

    pi(o) ∝ exp(log(t_ref / t*(o)) / PLAN_TARGET_TAU)

where ``t*(o)`` is the fastest plan below option ``o`` (its max-marginal; out of memory: no mass),
and its loss is weighted so that every depth of a pair's tree counts as much as its root.
Only the plan head learns: the encoder, the policy and the value head stay as trained (``z`` of
each pair is computed once, from the pair's empty plan with the simulator's feedback on it, as
:meth:`tag.gnn.Predictor.bind_plan` computes it in the search).

    python -m tag.training.plan_head --run-dir runs/predictor --checkpoint IN.pt --rounds 0,1,2 --out OUT.pt
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

PLAN_TARGET_TAU = 0.05
"""Temperature of the targets, in log iteration time: options 5% apart differ by a factor ~e."""


@dataclass
class PlanHeadConfig:
    """Fitting of the plan head."""

    epochs: int = 400
    """Full-batch Adam steps."""
    lr: float = 3e-3
    """Adam learning rate."""
    val_fraction: float = 0.1
    """Share of the pairs held out to report the fit (by pair, seeded)."""
    seed: int = 0
    """Seeds the split and the head's training."""

    def __post_init__(self):
        if self.epochs < 1:
            raise ValueError(f"epochs: expected >= 1, got {self.epochs}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction: expected in [0, 1), got {self.val_fraction}")


def pipeline_keys(space) -> list:
    """Every pipeline key (:class:`tag.search.space.PipelineChoice`) the plan-level decisions reach
    with every decision made."""
    from ..search.space import PipelineChoice
    out = []
    for p in space.options("stages", 1)[1:]:
        for cut in space.options("cut", p):
            for t in space.options("stage_sync", p):
                for m in space.options("micro", p, t):
                    for s, k in space.options("schedule", p):
                        out.append(PipelineChoice(p, m, t, s, k, cut))
    return out


def decision_targets(space, rewards: dict[tuple, float], no_pipeline: float,
                     tau: float = PLAN_TARGET_TAU) -> list[tuple[int, dict, np.ndarray, float]]:
    """``(decision, chosen, target [O], weight)`` of every plan-level decision node, from the
    reward (``t_ref / t - 1``; -1: out of memory) of every pipeline key and of the best plan
    without a pipeline (module docstring)."""
    from ..search.space import PLAN_DECISIONS
    choices = [({"stages": p, "cut": cut, "stage_sync": t, "micro": m, "schedule": (s, k)}, r)
               for (p, m, t, s, k, cut), r in rewards.items()]

    def value(c: dict) -> float:  # the best reward below the choices c
        if c.get("stages", 1) == 1:
            return no_pipeline
        return max((r for kc, r in choices if all(kc[n] == v for n, v in c.items())), default=-1.0)

    nodes: list[tuple[int, dict]] = [(0, {})]
    out, depth_count = [], {}
    while nodes:
        d, chosen = nodes.pop(0)
        name = PLAN_DECISIONS[d]
        opts = space.options_at(name, chosen)
        vals = np.array([value({**chosen, name: o}) for o in opts])
        ok = vals > -1.0
        if ok.any():
            logit = np.where(ok, np.log1p(np.where(ok, vals, 0.0)) / tau, -np.inf)
            pi = np.exp(logit - logit[ok].max())
            out.append((d, dict(chosen), pi / pi.sum(), 0.0))
            depth_count[d] = depth_count.get(d, 0) + 1
        if d + 1 < len(PLAN_DECISIONS):
            for o, v in zip(opts, vals):
                c = {**chosen, name: o}
                if v > -1.0 and c.get("stages", 1) > 1:
                    nodes.append((d + 1, c))
    return [(d, c, pi, 1.0 / depth_count[d]) for d, c, pi, _ in out]


def pair_space(record: dict, graphs: Path):
    """The search space of a labelled pair, with the plan-level decisions."""
    from ..data.generate import load_graph
    from ..search.space import ActionSpace
    from ..topology import load_topology
    pair = record["pair"]
    graph = load_graph(graphs, pair["model"], pair["batch"], pair["groups"])
    return ActionSpace(graph, load_topology(pair["topology"]), tensor_parallel=True, pipelines=True)


def pair_labels(record: dict, space) -> dict | None:
    """The network-independent part of a pair's plan-head examples (None: the pair's ``space``,
    :func:`pair_space`, has no plan-level decisions): ``options`` [N, O, F], ``mask`` [N, O],
    ``target`` [N, O], ``weight`` [N] of its N decision nodes, the simulator's ``feedback`` on the
    search's root plan (what ``z`` is computed from), ``pipeline_best`` / ``no_pipeline`` rewards;
    numpy arrays only."""
    from ..gnn.plan_head import PLAN_FEATURES, plan_option_features, simulator_bound
    from ..search.evaluate import Evaluator
    from ..sim import lower_bound
    if not space.plan_options:
        return None
    ev = Evaluator(space, None)
    rewards = {}
    for key in pipeline_keys(space):
        o = ev.evaluate(key)
        rewards[key] = ev.reward(o.time_s, o.oom)
    no_pipe = -1.0 if record["best_oom"] else ev.reward(record["best_time_s"], False)
    nodes = decision_targets(space, rewards, no_pipe)
    bound = simulator_bound(space, ev.simulator)
    lb = float(lower_bound(space.graph, space.topology, space.cost_model))
    width = max(len(t) for _, _, t, _ in nodes)
    opts = np.zeros((len(nodes), width, PLAN_FEATURES))
    mask = np.zeros((len(nodes), width), bool)
    target = np.zeros((len(nodes), width))
    for i, (d, c, pi, _) in enumerate(nodes):
        f = plan_option_features(space, c, d, bound, ev.t_ref, lb)
        opts[i, : len(f)], mask[i, : len(f)], target[i, : len(pi)] = f, True, pi
    fb = ev.evaluate(space.resolve_path([])).feedback  # the search's root plan
    return {"options": opts, "mask": mask, "target": target, "weight": np.array([w for *_, w in nodes]),
            "fb_util": fb.device_util, "fb_mem": fb.device_mem, "fb_comm": fb.device_comm,
            "fb_finish": fb.group_finish, "fb_time_oom": np.array([fb.iteration_time_s, float(fb.oom)]),
            "t_ref": np.array(ev.t_ref),
            "pipeline_best": np.array(max(rewards.values(), default=-1.0)), "no_pipeline": np.array(no_pipe)}


def _save_labels(path: Path, lab: dict | None) -> None:
    import io

    from ..io import write_atomic
    buf = io.BytesIO()
    if lab is not None:
        np.savez(buf, **lab)
    write_atomic(path, buf.getvalue())


def label_task(ctx: dict, key: tuple[int, int]) -> dict | None:
    """:func:`pair_labels` of pair ``key`` = (round, index) of ``ctx["records"]`` (a worker's job)."""
    rec = ctx["records"][key]
    return pair_labels(rec, pair_space(rec, ctx["graphs"]))


def _label_setup(shared: dict) -> dict:
    torch.set_num_threads(1)
    return shared


def label_pairs(run_dir: Path, records: list[tuple[int, dict]], backend, *, progress: bool, log=None) -> None:
    """Label the pairs of ``records`` whose ``round<r>/plan/<index>.npz`` is missing, on ``backend``
    (:mod:`tag.dispatch`), each worker given the pairs and their graphs once; the files are written
    here, so a killed job keeps what finished."""
    from ..data.generate import graph_key
    from ..dispatch import run_tasks
    path = lambda r, i: run_dir / f"round{r}" / "plan" / f"{i:05d}.npz"  # noqa: E731
    todo = {(r, rec["pair"]["index"]): {k: rec[k] for k in ("pair", "best_oom", "best_time_s")}
            for r, rec in records if not path(r, rec["pair"]["index"]).exists()}
    if not todo:
        return
    keys = {graph_key(rec["pair"]["model"], rec["pair"]["batch"], "adam") for rec in todo.values()}
    graphs = {k: (run_dir / "graphs" / f"{k}.json").read_text() for k in keys}
    for out in run_tasks(label_task, list(todo), setup=_label_setup, shared={"records": todo, "graphs": graphs},
                         backend=backend, desc="plan head labels", progress=progress, log=log,
                         done_before=len(records) - len(todo), total=len(records)):
        if out.error is None:  # else labelled in this process below
            _save_labels(path(*out.item), out.result)


def cached_labels(record: dict, space, path: Path) -> dict | None:
    """:func:`pair_labels`, kept in ``path`` (``.npz``, written atomically; read without pickle), so
    a killed or repeated fit labels each pair once. A pair without plan-level decisions is kept
    as an empty file."""
    if path.exists():
        if path.stat().st_size == 0:
            return None
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    lab = pair_labels(record, space)
    _save_labels(path, lab)
    return lab


def pair_examples(record: dict, space, predictor, labels: dict | None = None) -> dict | None:
    """The plan head's examples of one labelled pair (None: its ``space`` has no plan-level
    decisions): :func:`pair_labels` (given, or computed) with ``z`` [2H], the network's pooled
    embedding of the pair's empty plan with the root plan's feedback (as
    :meth:`tag.gnn.Predictor.bind_plan` computes it in the search)."""
    from ..search.evaluate import Feedback
    lab = labels if labels is not None else pair_labels(record, space)
    if lab is None:
        return None
    fb = Feedback(float(lab["fb_time_oom"][0]), bool(lab["fb_time_oom"][1]), lab["fb_util"], lab["fb_mem"],
                  lab["fb_comm"], lab["fb_finish"])
    return {**lab, "z": predictor.plan_z(predictor.context(space, float(lab["t_ref"])), fb)[0].numpy()}


def _stack(examples: list[dict]) -> dict[str, torch.Tensor]:
    width = max(e["options"].shape[1] for e in examples)
    pad = lambda a, fill=0: np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2),  # noqa: E731
                                   constant_values=fill)
    return {"z": torch.as_tensor(np.concatenate([np.repeat(e["z"][None], len(e["weight"]), 0) for e in examples])),
            "options": torch.as_tensor(np.concatenate([pad(e["options"]) for e in examples]), dtype=torch.float32),
            "mask": torch.as_tensor(np.concatenate([pad(e["mask"], False) for e in examples])),
            "target": torch.as_tensor(np.concatenate([pad(e["target"]) for e in examples]), dtype=torch.float32),
            "weight": torch.as_tensor(np.concatenate([e["weight"] for e in examples]), dtype=torch.float32)}


def plan_loss(net, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted cross-entropy, top-1 agreement of the head's best option with the target's)."""
    logits = net.plan_logits(batch["z"], batch["options"]).masked_fill(~batch["mask"], -1e9)
    logp = torch.log_softmax(logits, 1)
    ce = -(batch["target"] * logp).sum(1)
    w = batch["weight"]
    top1 = (logits.argmax(1) == batch["target"].argmax(1)).float()
    return (w * ce).sum() / w.sum(), (w * top1).sum() / w.sum()


def fit_plan_head(net, examples: list[dict], cfg: PlanHeadConfig | None = None, log=None) -> dict:
    """Train ``net.plan`` alone on ``examples`` (:func:`pair_examples`), in place, on one thread
    (reproducible, as :func:`tag.training.train.fit`); returns the train / validation
    cross-entropy and top-1 agreement before and after."""
    from ..gnn.predictor import one_thread
    cfg = cfg or PlanHeadConfig()
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(examples))
    n_val = int(round(cfg.val_fraction * len(examples)))
    val = _stack([examples[i] for i in order[:n_val]]) if n_val else None
    train = _stack([examples[i] for i in order[n_val:]])
    torch.manual_seed(cfg.seed)
    for m in net.plan.modules():  # the head starts afresh: the fit depends on the examples and seed alone
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    with one_thread():
        opt = torch.optim.Adam(net.plan.parameters(), lr=cfg.lr)

        def report() -> dict:
            out = {}
            with torch.no_grad():
                for name, batch in (("train", train), ("val", val)):
                    if batch is not None:
                        ce, top1 = plan_loss(net, batch)
                        out.update({f"{name}_ce": float(ce), f"{name}_top1": float(top1)})
            return out
        before = report()
        for epoch in range(cfg.epochs):
            loss, _ = plan_loss(net, train)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if log is not None and (epoch + 1) % 100 == 0:
                log({"stage": "plan head", "epoch": epoch + 1, **report()})
        after = report()
    return {"before": before, "after": after, "pairs": len(examples), "val_pairs": n_val,
            "decisions": int(train["weight"].numel()) + (int(val["weight"].numel()) if val is not None else 0)}


def add_plan_head(run_dir: str | Path, checkpoint: str | Path, rounds: list[int], out: str | Path,
                  cfg: PlanHeadConfig | None = None, *, progress: bool = True, backend=None,
                  log=None) -> dict | None:
    """Fit the plan head of ``checkpoint`` on the labelled pairs of ``rounds`` of a ``tag train``
    run folder and write the network with it to ``out`` (``meta["plan_head"]``: what it fitted).
    None, and nothing written, where no pair has plan-level decisions (one device or one group).
    The pairs' labels not cached yet are made on ``backend`` (:class:`tag.dispatch.Backend`;
    default: in this process, one after the other), ``log`` receiving its progress records."""
    from ..data.generate import read_records
    from ..gnn.predictor import Predictor, checkpoint_coarse_above, load_net, save_checkpoint
    run_dir = Path(run_dir)
    net, meta = load_net(checkpoint)
    pred = Predictor(net, checkpoint_coarse_above(meta, checkpoint))
    examples, t0 = [], time.perf_counter()
    records = [(r, rec) for r in rounds for rec in read_records(run_dir / f"round{r}")]
    if backend is not None:
        label_pairs(run_dir, records, backend, progress=progress, log=log)
    for i, (r, rec) in enumerate(records):
        space = pair_space(rec, run_dir / "graphs")  # one per pair: the labels' and z's
        lab = cached_labels(rec, space, run_dir / f"round{r}" / "plan" / f"{rec['pair']['index']:05d}.npz")
        ex = pair_examples(rec, space, pred, lab) if lab is not None else None
        if ex is not None:
            examples.append(ex)
        if progress and ((i + 1) % 25 == 0 or i + 1 == len(records)):
            print(f"plan head: labelled {i + 1}/{len(records)} pairs ({time.perf_counter() - t0:.0f} s)", flush=True)
    if not examples:
        return None
    res = fit_plan_head(net, examples, cfg)
    res["label_seconds"] = time.perf_counter() - t0
    res["pipeline_pays_pairs"] = int(sum(float(e["pipeline_best"]) > float(e["no_pipeline"]) for e in examples))
    save_checkpoint(out, net, {**meta, "plan_head": {**res, "rounds": list(rounds)}})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tag.training.plan_head", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, help="a `tag train` run folder (graphs/, round<r>/raw/)")
    ap.add_argument("--checkpoint", required=True, help="predictor checkpoint whose plan head is fitted")
    ap.add_argument("--rounds", required=True, help="comma-separated rounds whose labelled pairs are used")
    ap.add_argument("--out", required=True, help="checkpoint written (never the input)")
    ap.add_argument("--epochs", type=int, default=PlanHeadConfig.epochs)
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    a = ap.parse_args(argv)
    if Path(a.out).resolve() == Path(a.checkpoint).resolve():
        raise SystemExit(f"--out {a.out}: expected a path other than --checkpoint")
    try:
        rounds = [int(r) for r in a.rounds.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--rounds {a.rounds}: expected comma-separated round numbers") from None
    for r in rounds:
        if not (Path(a.run_dir) / f"round{r}" / "raw").is_dir():
            raise SystemExit(f"--run-dir {a.run_dir}: round{r}/raw not found (expected a `tag train` run folder "
                             "with that round labelled)")
    from ..errors import TagError
    try:
        res = add_plan_head(a.run_dir, a.checkpoint, rounds, a.out, PlanHeadConfig(epochs=a.epochs))
    except (TagError, ValueError) as e:
        if a.debug:
            raise
        raise SystemExit(str(e).splitlines()[0]) from None
    if res is None:
        raise SystemExit(f"{a.run_dir}: rounds {a.rounds}: no labelled pair has plan-level decisions; nothing written")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["PLAN_TARGET_TAU", "PlanHeadConfig", "add_plan_head", "cached_labels", "decision_targets", "label_pairs",
           "fit_plan_head", "pair_examples", "pair_labels", "pair_space", "pipeline_keys", "plan_loss"]
