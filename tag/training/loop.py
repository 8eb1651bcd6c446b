"""AlphaZero-style training of the predictor: generate -> train -> regenerate, ``rounds`` times.

Run folder layout::

    config.json            the resolved LoopConfig
    graphs/                captured graphs shared by every round
    round<r>/raw/          labelled episodes of round r (MCTS with round r-1's network;
                           round 0: uniform prior)
    round<r>/ckpt/         per-epoch checkpoints of round r (last.pt, best.pt)
    round<r>/predictor.pt  the network after round r
    predictor.pt           the latest network (with its plan head fitted on every round's pairs
                           after the last round: tag.training.plan_head)
    wandb/                 wandb run files (offline unless asked otherwise)
    log.jsonl              every logged record

Everything resumes (under either labelling backend, :mod:`tag.dispatch`): generation skips finished samples, training restarts after the last
finished epoch, finished rounds are skipped.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import torch

from ..data.generate import GenConfig, generate
from ..dispatch import Backend
from ..gnn.model import TagNet
from ..gnn.predictor import CheckpointError, load_net, save_checkpoint
from ..io import check_folder, load_tensors, write_atomic
from .config import ConfigError, LoopConfig
from .train import fit


class Logger:
    """wandb (offline by default, files inside the run folder) plus a local JSONL log."""

    def __init__(self, run_dir: Path, cfg: LoopConfig, name: str | None = None):
        self.path = run_dir / "log.jsonl"
        self.run = None
        if cfg.wandb != "disabled" and os.environ.get("WANDB_MODE") != "disabled":
            wdir = run_dir / "wandb"
            wdir.mkdir(parents=True, exist_ok=True)
            os.environ["WANDB_DIR"] = str(wdir)
            os.environ["WANDB_CACHE_DIR"] = str(wdir / "cache")
            os.environ["WANDB_CONFIG_DIR"] = str(wdir / "config")
            os.environ.setdefault("WANDB_SILENT", "true")
            if cfg.wandb == "offline":
                os.environ["WANDB_MODE"] = "offline"
            try:
                import wandb
                rid_file = run_dir / "wandb_id.txt"
                rid = rid_file.read_text().strip() if rid_file.exists() else uuid.uuid4().hex[:8]
                rid_file.write_text(rid)
                self.run = wandb.init(project=cfg.project, dir=str(wdir), config=cfg.to_dict(), id=rid,
                                      resume="allow", name=name or run_dir.name, mode=cfg.wandb)
            except Exception as e:  # noqa: BLE001 - logging must never stop training
                print(f"wandb disabled: {e}")
                self.run = None

    def __call__(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in rec.items() if isinstance(v, (int, float))})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def _datasets(run_dir: Path, rounds: int, target, coarse_above: int):
    from torch.utils.data import ConcatDataset

    from ..data.dataset import PlanDataset, split
    trains, vals = [], []
    for r in range(rounds):
        ds = PlanDataset(run_dir / f"round{r}", target=target, coarse_above=coarse_above)
        tr, va = split(ds, 0.1, seed=r)
        trains.append(tr)
        vals.append(va)
    return ConcatDataset(trains), ConcatDataset(vals)


def started_config(run_dir: str | os.PathLike) -> LoopConfig | None:
    """The config a run folder was started with (its ``config.json``; None: a new run folder), its
    ``run_dir`` the folder where it is now; :class:`ConfigError` (one line) when it is damaged."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return None
    try:
        started = LoopConfig.load(path)
    except ConfigError as e:
        raise ConfigError(f"{e}; the run folder's config is damaged: repair or remove it to resume, "
                          "or give another run folder") from None
    started.run_dir = str(run_dir)
    return started


def run_loop(cfg: LoopConfig, *, progress: bool = True, allow_changed: bool = False,
             backend: Backend | None = None) -> Path:
    """Run (or resume) the whole loop; returns the path of the final checkpoint. The pairs are
    labelled on ``backend`` (default: a local pool of ``cfg.gen.workers`` processes; the labels
    are the same on any), its progress records logged.

    A run folder is resumed under the config it was started with: a ``cfg`` that differs from it
    in what the run computes (:meth:`LoopConfig.changed_from`) is refused with a
    :class:`ConfigError` naming the fields, unless ``allow_changed``."""
    run_dir = Path(cfg.run_dir)
    check_folder(run_dir, ConfigError, "run_dir")
    started = started_config(run_dir)  # a run to resume: its config must be readable, not overwritten blind
    changed = [] if started is None or allow_changed else cfg.changed_from(started)
    if changed:
        shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ConfigError(f"{run_dir / 'config.json'}: the run was started with another config ({shown}{more}); "
                          "expected the same to resume it (tag train --run-dir alone resumes as started; "
                          "--allow-config-change continues under the new one, mixing rounds made under both)")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.json")
    log = Logger(run_dir, cfg)
    t_start = time.perf_counter()
    torch.set_num_threads(max(1, min(cfg.gen.workers, os.cpu_count() or 1)))
    final = run_dir / "predictor.pt"
    try:
        for r in range(cfg.rounds):
            rdir = run_dir / f"round{r}"
            done_flag = rdir / "predictor.pt"
            if done_flag.exists():
                continue
            gen = GenConfig(**{**cfg.gen.__dict__, "samples": cfg.samples(r), "seed": cfg.gen.seed + 1000 * r})
            prev = run_dir / f"round{r - 1}" / "predictor.pt" if r > 0 else None
            t0 = time.perf_counter()
            on = backend or Backend(workers=gen.workers)
            stats = generate(rdir, gen, str(prev) if prev is not None else None, progress=progress,
                             graphs=run_dir / "graphs", backend=on, log=lambda rec, r=r: log({"round": r, **rec}))
            log({"round": r, "stage": "generate", **stats, "gen_seconds": time.perf_counter() - t0,
                 "backend": on.describe()})
            train_set, val_set = _datasets(run_dir, r + 1, cfg.target, cfg.coarse_above)
            net = load_net(prev)[0] if prev is not None else TagNet(cfg.net)
            if prev is None:
                torch.manual_seed(cfg.train.seed)
                net = TagNet(cfg.net)
            t0 = time.perf_counter()
            res = fit(net, train_set, val_set, cfg.train, rdir / "ckpt", log=log, tag=f"round{r}")
            best = rdir / "ckpt" / "best.pt"
            if best.exists():
                net.load_state_dict(load_tensors(best, CheckpointError, "training checkpoint")["net"])
            meta = {"round": r, "train_decisions": len(train_set), "val": res["best"], "coarse_above": cfg.coarse_above,
                    "wall_seconds": time.perf_counter() - t_start}
            save_checkpoint(done_flag, net, meta)
            save_checkpoint(final, net, meta)
            log({"round": r, "stage": "train", "train_seconds": time.perf_counter() - t0, **res["best"]})
        if cfg.plan_head and not load_net(final)[1].get("plan_head"):
            from .plan_head import add_plan_head
            t0 = time.perf_counter()
            ph = add_plan_head(run_dir, final, list(range(cfg.rounds)), final, progress=progress,
                               backend=backend or Backend(workers=cfg.gen.workers), log=log)
            log({"stage": "plan head", "plan_head_seconds": time.perf_counter() - t0,
                 **({f"plan_head/{k}": v for k, v in ph["after"].items()} if ph is not None else
                    {"plan_head": "no pair with plan-level decisions: left to the search's fixed prior"})})
        if cfg.export and Path(cfg.export).resolve() != final.resolve():
            Path(cfg.export).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cfg.export, final.read_bytes())  # a killed copy never leaves half a file
    finally:
        log.close()
    return final
