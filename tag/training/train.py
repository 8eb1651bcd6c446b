"""Fit :class:`tag.gnn.TagNet` to MCTS labels: policy cross-entropy + value regression.

Checkpoints after every epoch (``<ckpt_dir>/last.pt``: network, optimiser, epoch, step, RNG
states, history); :func:`fit` called again with the same folder resumes after the last finished
epoch, so a killed run loses at most the epoch in progress.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter

from ..gnn.model import TagNet, action_log_probs
from ..gnn.predictor import CheckpointError, one_thread
from ..io import load_tensors, save_tensors
from .config import TrainConfig


def losses(net: TagNet, batch) -> dict[str, torch.Tensor]:
    """Per-batch policy cross-entropy, value MSE and policy top-1 agreement."""
    logits, value = net(batch)
    ab = batch["action"].batch
    n = int(batch.t_ref.numel())
    logp = action_log_probs(logits, ab)
    pi = batch["action"].pi
    ce = scatter(-(pi * logp), ab, 0, dim_size=n, reduce="sum")
    ent = scatter(-(pi * torch.log(pi.clamp_min(1e-12))), ab, 0, dim_size=n, reduce="sum")
    vloss = torch.nn.functional.mse_loss(value, batch.value)
    pred_best = scatter(logits, ab, 0, dim_size=n, reduce="max")
    tgt_best = scatter(pi, ab, 0, dim_size=n, reduce="max")
    hit_pred = (logits >= pred_best[ab]) & (pi >= tgt_best[ab])
    top1 = scatter(hit_pred.float(), ab, 0, dim_size=n, reduce="max")
    return {"policy": ce.mean(), "kl": (ce - ent).mean(), "value": vloss, "top1": top1.mean()}


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state()[1].astype(np.int64).tolist(),
            "python": random.getstate()[1]}


@torch.no_grad()
def evaluate(net: TagNet, loader) -> dict[str, float]:
    net.eval()
    tot: dict[str, float] = {}
    count = 0
    for batch in loader:
        n = int(batch.t_ref.numel())
        for k, v in losses(net, batch).items():
            tot[k] = tot.get(k, 0.0) + float(v) * n
        count += n
    return {k: v / max(count, 1) for k, v in tot.items()}


def fit(net: TagNet, train_set, val_set, cfg: TrainConfig, ckpt_dir: str | Path, *,
        log: Callable[[dict], None] | None = None, tag: str = "") -> dict:
    """Train ``net`` in place; resumable from ``ckpt_dir/last.pt`` (matching ``tag``).

    Runs on one CPU thread: with two, the split of work between threads (and so the order of
    float sums) followed the load of the machine, and two fits of the same data in one process
    differed from the 7th digit of the first epoch's loss whenever another process was busy, so
    ``tag train`` was not reproducible. The price, two one-epoch fits on 1,200 decisions on this
    2-core VM: 12.1 s on one thread against 10.3 s on two when idle (17.2 s against 23.2 s with
    the other core busy)."""
    with one_thread():
        return _fit(net, train_set, val_set, cfg, ckpt_dir, log=log, tag=tag)


def _fit(net: TagNet, train_set, val_set, cfg: TrainConfig, ckpt_dir: str | Path, *,
         log: Callable[[dict], None] | None, tag: str) -> dict:
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    last = ckpt_dir / "last.pt"
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs, eta_min=cfg.lr * 0.05)
    start, step, history = 0, 0, []
    best = {"val_loss": math.inf}
    if last.exists():
        ck = load_tensors(last, CheckpointError, "training checkpoint")
        if ck.get("tag") == tag:
            net.load_state_dict(ck["net"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            start, step, history = ck["epoch"] + 1, ck["step"], list(ck["history"])
            best = dict(ck["best"])
            torch.set_rng_state(ck["rng"]["torch"])
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + start)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, generator=gen)
    vloader = DataLoader(val_set, batch_size=256) if val_set is not None and len(val_set) else None
    for epoch in range(start, cfg.epochs):
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
        net.train()
        agg: dict[str, float] = {}
        nb = 0
        for batch in loader:
            out = losses(net, batch)
            loss = out["policy"] + cfg.value_weight * out["value"]
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            nb += 1
            for k, v in out.items():
                agg[k] = agg.get(k, 0.0) + float(v.detach())
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
        sched.step()
        rec = {"epoch": epoch, "step": step, "lr": opt.param_groups[0]["lr"]}
        rec.update({f"train/{k}": v / max(nb, 1) for k, v in agg.items()})
        if vloader is not None:
            ev = evaluate(net, vloader)
            rec.update({f"val/{k}": v for k, v in ev.items()})
            rec["val_loss"] = ev["policy"] + cfg.value_weight * ev["value"]
        else:
            rec["val_loss"] = rec.get("train/policy", 0.0) + cfg.value_weight * rec.get("train/value", 0.0)
        history.append(rec)
        if rec["val_loss"] < best["val_loss"]:
            best = {"val_loss": rec["val_loss"], "epoch": epoch}
            save_tensors(ckpt_dir / "best.pt", {"net": net.state_dict(), "epoch": epoch, "tag": tag})
        save_tensors(last, {"net": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "step": step, "history": history, "best": best, "tag": tag,
                     "rng": _rng_state()})
        if log is not None:
            log({**rec, "round_tag": tag})
    return {"history": history, "best": best, "steps": step}
