"""Does a plan head fitted after round r change round r+1 of ``tag train``? (issue 28, 2026-11-27)

The idea: fit the plan head after every round (not only after the last) and let the next round's
labelling searches use it. This script measures the two places it could act, on a copy of the
recipe run ``runs/mix/pred`` (never written):

1. labels: round 1's first ``PAIRS`` pairs labelled (:func:`tag.data.generate.label_pair`, the
   run's GenConfig, seed 1000) with round 0's network as prior, once as shipped (no plan head)
   and once with a plan head fitted on round 0's pairs onto that network; the records are
   compared field by field (wall-clock fields aside) with each other and with the stored
   ``runs/mix/pred/round1/raw`` records;
2. training: round 1's training (:func:`tag.training.train.fit` on rounds 0-1, the run's
   TrainConfig cut to ``STEPS`` steps) from both networks; every parameter outside the plan head
   compared bit for bit.

    PYTHONPATH=. OMP_NUM_THREADS=1 python evaluation/results/planner-bench-planhead/loop_head_check.py \
        runs/mix/pred runs/loophead/check [PAIRS] [STEPS]
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

WALL = ("seconds", "label_seconds")


def main(src: str, dst: str, pairs: int = 16, steps: int = 30) -> int:
    from tag.data.generate import GenConfig, label_pair, sample_pair
    from tag.data.generate import _models as models
    from tag.gnn.predictor import Predictor, load_net
    from tag.training.config import LoopConfig
    from tag.training.loop import _datasets
    from tag.training.plan_head import add_plan_head
    from tag.training.train import fit
    torch.set_num_threads(1)
    src_p, run = Path(src), Path(dst)
    run.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "round0", "round1"):  # copies: the recipe run is only read
        if not (run / name).exists():
            (shutil.copytree if (src_p / name).is_dir() else shutil.copy)(src_p / name, run / name)
    if not (run / "graphs").exists():
        (run / "graphs").symlink_to((src_p / "graphs").resolve())
    cfg = LoopConfig.load(run / "config.json")
    base = run / "round0" / "predictor.pt"
    head = run / "round0" / "predictor-head.pt"
    t0 = time.perf_counter()
    if not head.exists():
        add_plan_head(run, base, [0], head, progress=False)
    print(f"plan head on round 0: {time.perf_counter() - t0:.0f} s; {load_net(head)[1]['plan_head']['after']}", flush=True)

    gen = GenConfig(**{**cfg.gen.__dict__, "samples": cfg.samples(1), "seed": cfg.gen.seed + 1000})
    pa, pb = Predictor.load(str(base)), Predictor.load(str(head))
    assert not pa.plan_head and pb.plan_head
    same_ab = same_stored = 0
    t_a = t_b = 0.0
    for i in range(pairs):
        spec = sample_pair(gen.seed, i, max_groups=gen.max_groups, models=models(gen),
                           large_fraction=gen.large_fraction, large_inputs=gen.large_inputs)
        ra = label_pair(run / "graphs", spec, gen, pa)
        rb = label_pair(run / "graphs", spec, gen, pb)
        t_a, t_b = t_a + ra["seconds"], t_b + rb["seconds"]
        strip = lambda r: json.dumps({k: v for k, v in r.items() if k not in WALL}, sort_keys=True)  # noqa: E731
        stored = json.loads((src_p / "round1" / "raw" / f"{i:05d}.json").read_text())
        same_ab += strip(ra) == strip(rb)
        same_stored += strip(json.loads(json.dumps(ra))) == strip(stored)
        print(f"pair {i}: {spec.model} {spec.groups} groups: with head == without: {strip(ra) == strip(rb)}, "
              f"== stored: {strip(json.loads(json.dumps(ra))) == strip(stored)} "
              f"({ra['seconds']:.1f} / {rb['seconds']:.1f} s)", flush=True)
    print(f"labels: {same_ab}/{pairs} identical with and without the head, {same_stored}/{pairs} identical "
          f"to the stored round-1 records ({t_a:.0f} s / {t_b:.0f} s labelling)", flush=True)

    train_set, val_set = _datasets(run, 2, cfg.target, cfg.coarse_above)
    tcfg = type(cfg.train)(**{**cfg.train.__dict__, "max_steps": steps})
    nets = []
    for tag, ck in (("a", base), ("b", head)):
        net = load_net(ck)[0]
        fit(net, train_set, val_set, tcfg, run / f"fit-{tag}", tag=f"check-{tag}")
        nets.append(net.state_dict())
    other = [k for k in nets[0] if not k.startswith("plan.")]
    diff = [k for k in other if not torch.equal(nets[0][k], nets[1][k])]
    head_kept = all(torch.equal(nets[1][k], load_net(head)[0].state_dict()[k]) for k in nets[1] if k.startswith("plan."))
    print(f"training ({steps} steps): {len(other) - len(diff)}/{len(other)} tensors outside the plan head "
          f"identical; the fitted head left as fitted: {head_kept}", flush=True)
    return 0 if same_ab == pairs and not diff else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2], *[int(a) for a in sys.argv[3:]]))
