"""optuna search over the network's hyperparameters on an existing labelled dataset.

Trials live in an SQLite study (``<study_dir>/optuna.db``) so an interrupted ``tag tune`` resumes:
finished trials are kept and the study continues up to the requested total. Each trial has a run
folder (``<study_dir>/trial_<n>``) with its resolved config and checkpoints; a trial a killed run
left running is asked again first with its parameters and resumes its folder's last finished epoch.
Trials are asked ``parallel`` at a time and trained in this process, a local process pool or as
Ray tasks (:mod:`tag.dispatch`; a trial's worker writes its folder at the study folder's path, so
on several machines a shared folder lets a retried trial resume, else it starts again).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..dispatch import Backend, progress_log, run_tasks
from ..gnn.model import NetConfig, TagNet
from ..io import output_dir, write_json
from .config import ConfigError, TrainConfig


@dataclass
class TuneConfig:
    """A hyperparameter study."""

    data: list[str]
    """Dataset folders (each with ``raw/``) to train and validate on."""
    study_dir: str = field(default_factory=lambda: str(output_dir("runs/tune")))
    """Folder of the SQLite study and the trials' run folders."""
    trials: int = 20
    """Total trials the study should reach (finished ones count)."""
    epochs: int = 6
    """Training epochs per trial."""
    timeout: float | None = None
    """Stop starting new trials after this many seconds."""
    seed: int = 0
    """Sampler and training seed."""
    study_name: str = "tag-predictor"
    """Name of the study inside the database."""
    wandb: str = "offline"
    """``offline`` / ``online`` / ``disabled`` logging of every trial."""
    parallel: int = 1
    """Trials asked of the sampler at once and trained side by side (1: one after the other, each
    asked knowing every earlier result). The study depends on it, not on where trials run."""

    def __post_init__(self):
        if not self.data:
            raise ConfigError("data: expected at least one dataset folder")
        for d in self.data:
            if not (Path(d) / "raw").is_dir():
                raise ConfigError(f"data: {d}: no raw/ folder of labelled episodes (generate one with tag train)")
        if self.trials < 1:
            raise ConfigError(f"trials: expected >= 1, got {self.trials}")
        if self.epochs < 1:
            raise ConfigError(f"epochs: expected >= 1, got {self.epochs}")
        if self.timeout is not None and not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ConfigError(f"timeout: expected a positive, finite number of seconds or None, got {self.timeout}")
        if self.seed < 0:
            raise ConfigError(f"seed: expected >= 0, got {self.seed}")
        if not 1 <= self.parallel <= 256:
            raise ConfigError(f"parallel: expected 1..256 trials at once, got {self.parallel}")
        if self.wandb not in ("offline", "online", "disabled"):
            raise ConfigError(f"wandb: expected offline, online or disabled, got {self.wandb!r}")


def suggest(trial) -> tuple[NetConfig, dict]:
    """The search space: network shape and optimiser settings."""
    heads = trial.suggest_categorical("heads", [2, 4])
    hidden = trial.suggest_categorical("hidden", [32, 64, 96, 128])
    net = NetConfig(hidden=hidden, layers=trial.suggest_int("layers", 2, 4), heads=heads,
                    dropout=trial.suggest_float("dropout", 0.0, 0.2))
    train = {"lr": trial.suggest_float("lr", 3e-4, 1e-2, log=True),
             "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
             "value_weight": trial.suggest_float("value_weight", 0.1, 1.0)}
    return net, train


def tune(cfg: TuneConfig, backend: Backend | None = None, log: Callable[[dict], None] | None = None) -> dict:
    """Run (or continue) the study to ``cfg.trials`` trials; the best trial. Trials are asked of
    the sampler ``cfg.parallel`` at a time and trained on ``backend`` (default: a local pool of
    ``cfg.parallel`` processes); the study is the same on any backend."""
    import optuna

    from ..data.dataset import PlanDataset, split
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    root = Path(cfg.study_dir)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "tune_config.json", asdict(cfg))
    storage = optuna.storages.RDBStorage(f"sqlite:///{(root / 'optuna.db').resolve()}")
    study = optuna.create_study(study_name=cfg.study_name, storage=storage, direction="minimize",
                                load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    _rerun_interrupted(study)
    trs, vas = [], []
    for i, d in enumerate(cfg.data):
        tr, va = split(PlanDataset(d), 0.15, seed=i)
        trs.append(tr)
        vas.append(va)
    from torch.utils.data import ConcatDataset
    shared = {"cfg": cfg, "train": ConcatDataset(trs), "val": ConcatDataset(vas)}
    backend = backend or Backend(workers=cfg.parallel)
    log = log or progress_log(root / "log.jsonl")
    t0 = time.perf_counter()
    while True:
        done = len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE])
        left = cfg.trials - done
        if left <= 0 or (cfg.timeout is not None and time.perf_counter() - t0 > cfg.timeout):
            break
        asked = [study.ask() for _ in range(min(cfg.parallel, left))]
        specs = [_trial_spec(study, t, root) for t in asked]
        values: dict[int, float | None] = {}
        for out in run_tasks(trial_task, specs, setup=_tune_setup, shared=shared, backend=backend,
                             desc="tune", progress=False, log=log, done_before=done, total=cfg.trials):
            values[out.item["number"]] = out.result
            if out.error is not None:
                print(f"trial {out.item['number']}: {out.error}")
        for t in asked:  # in the order asked: the sampler sees the same history on any backend
            v = values.get(t.number)
            study.tell(t, v, state=None if v is not None else optuna.trial.TrialState.FAIL)
    best = study.best_trial
    out = {"best_value": best.value, "best_params": best.params, "best_trial": best.number,
           "trials": len(study.trials)}
    write_json(root / "best.json", out)
    return out


def _rerun_interrupted(study) -> None:
    """Trials left running by a killed ``tag tune``: failed, and their parameters asked again
    first, the new trial resuming the old one's folder (its last finished epoch)."""
    import optuna
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"folder": _folder(t)})


def _folder(trial) -> int:
    """The trial folder's number: the trial's own, or that of the trial it runs again."""
    if "folder" in trial.user_attrs:
        return int(trial.user_attrs["folder"])
    retried = trial.system_attrs.get("failed_trial")  # a trial optuna's heartbeat callback retried
    return trial.number if retried is None else int(retried)


def _trial_spec(study, trial, root: Path) -> dict:
    net_cfg, tr = suggest(trial)
    frozen = study.get_trials(deepcopy=False)[trial.number]
    number = _folder(frozen)
    return {"number": trial.number, "dir": str(root / f"trial_{number}"), "tag": f"trial{number}",
            "net": net_cfg.to_dict(), "train": tr}


def _tune_setup(shared: dict) -> dict:
    torch.set_num_threads(1)
    return shared


def trial_task(ctx: dict, spec: dict) -> float:
    """Train one trial in its folder (resuming its last finished epoch); its validation policy loss."""
    from .config import LoopConfig
    from .loop import Logger
    from .train import fit
    cfg: TuneConfig = ctx["cfg"]
    tdir = Path(spec["dir"])
    net_cfg = NetConfig(**spec["net"])
    tcfg = TrainConfig(epochs=cfg.epochs, seed=cfg.seed, **spec["train"])
    write_json(tdir / "config.json", {"net": net_cfg.to_dict(), "train": asdict(tcfg), "data": cfg.data})
    log = Logger(tdir, LoopConfig(run_dir=str(tdir), net=net_cfg, train=tcfg, wandb=cfg.wandb,
                                  project="tag-tune"), name=tdir.name)
    try:
        torch.manual_seed(cfg.seed)
        res = fit(TagNet(net_cfg), ctx["train"], ctx["val"], tcfg, tdir / "ckpt", log=log, tag=spec["tag"])
    finally:
        log.close()
    return min(h.get("val/policy", h["val_loss"]) for h in res["history"])
