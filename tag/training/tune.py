"""optuna search over the network's hyperparameters on an existing labelled dataset.

Trials live in an SQLite study (``<study_dir>/optuna.db``) so an interrupted ``tag tune`` resumes:
finished trials are kept and the study continues up to the requested total. Each trial has a run
folder (``<study_dir>/trial_<n>``) with its resolved config and checkpoints; a trial interrupted
mid-training (killed: its heartbeat goes stale) is re-run by optuna and resumes from its last
epoch (``RetryHeartbeatStaleTrialCallback``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

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


def tune(cfg: TuneConfig) -> dict:
    import optuna
    from torch.utils.data import ConcatDataset

    from ..data.dataset import PlanDataset, split
    from .loop import Logger
    from .train import fit
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    root = Path(cfg.study_dir)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "tune_config.json", asdict(cfg))
    storage = optuna.storages.RDBStorage(
        f"sqlite:///{(root / 'optuna.db').resolve()}", heartbeat_interval=30, grace_period=120,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2))
    study = optuna.create_study(study_name=cfg.study_name, storage=storage, direction="minimize",
                                load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    trs, vas = [], []
    for i, d in enumerate(cfg.data):
        tr, va = split(PlanDataset(d), 0.15, seed=i)
        trs.append(tr)
        vas.append(va)
    train_set, val_set = ConcatDataset(trs), ConcatDataset(vas)

    def objective(trial) -> float:
        net_cfg, tr = suggest(trial)
        frozen = study.get_trials(deepcopy=False)[trial.number]
        retried = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
        number = trial.number if retried is None else retried  # a retried trial resumes its folder
        tdir = root / f"trial_{number}"
        tcfg = TrainConfig(epochs=cfg.epochs, seed=cfg.seed, **tr)
        write_json(tdir / "config.json", {"net": net_cfg.to_dict(), "train": asdict(tcfg), "data": cfg.data})
        from .config import LoopConfig
        log = Logger(tdir, LoopConfig(run_dir=str(tdir), net=net_cfg, train=tcfg, wandb=cfg.wandb,
                                      project="tag-tune"), name=f"trial_{number}")
        try:
            torch.manual_seed(cfg.seed)
            res = fit(TagNet(net_cfg), train_set, val_set, tcfg, tdir / "ckpt", log=log, tag=f"trial{number}")
        finally:
            log.close()
        hist = res["history"]
        return min(h.get("val/policy", h["val_loss"]) for h in hist)

    done = len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE])
    left = max(0, cfg.trials - done)
    if left:
        study.optimize(objective, n_trials=left, timeout=cfg.timeout)
    best = study.best_trial
    out = {"best_value": best.value, "best_params": best.params, "best_trial": best.number,
           "trials": len(study.trials)}
    write_json(root / "best.json", out)
    return out
