"""Tests for data generation, the PyG dataset, fitting, the AlphaZero loop, tuning and `tag train`."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tag.data.dataset import PlanDataset, split
from tag.data.generate import GenConfig, generate, pending
from tag.data.pairs import HELD_OUT_MODELS, LARGE_MODELS, TRAIN_MODELS, random_topology, sample_pair
from tag.gnn import NetConfig, TagNet, load_net
from tag.topology import load_topology
from tag.training.config import ConfigError, LoopConfig, TrainConfig
from tag.training.train import fit

TINY = ["mlp:layers=2,hidden=64@16"]


def _gen_cfg(**kw):
    base = {"samples": 3, "workers": 1, "simulator": "toy", "playouts_per_step": 4, "max_steps": 3,
            "max_groups": 8, "models": TINY}
    return GenConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    generate(root, _gen_cfg(), progress=False)
    return root


def test_pairs_are_deterministic_and_in_range():
    import numpy as np
    a, b = sample_pair(5, 17), sample_pair(5, 17)
    assert a == b and a != sample_pair(5, 18)
    train_specs = {m for m, _ in TRAIN_MODELS}
    assert not train_specs & set(HELD_OUT_MODELS)
    rng = np.random.default_rng(0)
    for i in range(40):
        topo = load_topology(random_topology(rng, f"r{i}"))
        assert 2 <= topo.num_devices <= 32 and 1 <= topo.num_machines <= 8
        bw = topo.network_bandwidth * 8 / 1e9
        assert 1.0 - 1e-6 <= bw <= 100.0 + 1e-6


def test_pairs_at_scale_leave_the_other_pairs_unmoved():
    """``large_fraction``: that share of the stream is drawn at scale (48-256 GPUs over 4-32
    machines, models of LARGE_MODELS); every other pair is the one of the small-only stream."""
    small = [sample_pair(0, i, max_groups=32) for i in range(60)]
    mixed = [sample_pair(0, i, max_groups=32, large_fraction=0.3) for i in range(60)]
    large = [m for s, m in zip(small, mixed) if m != s]
    assert 8 <= len(large) <= 30  # ~18 expected
    assert {m.model for m in large} <= {m for m, _ in LARGE_MODELS}
    assert not {m for m, _ in LARGE_MODELS} & set(HELD_OUT_MODELS)
    for p in large:
        topo = load_topology(p.topology)
        assert 48 <= topo.num_devices <= 256 and 4 <= topo.num_machines <= 32 and p.groups <= 32
    assert sample_pair(0, 3, large_fraction=0.3) == sample_pair(0, 3, large_fraction=0.3)


def test_full_inputs_change_only_the_models_at_scale():
    """``large_inputs="full"``: the pairs at scale are the same draws (topology, batch, groups) with
    their model's inputs at LARGE_INPUTS (the zoo accepts every such spec); every other pair, and
    the default stream, are unmoved."""
    from tag.data.pairs import LARGE_INPUTS, full_inputs
    from tag.workloads.zoo import zoo_entries
    zoo = [sample_pair(0, i, max_groups=32, large_fraction=0.3) for i in range(60)]
    full = [sample_pair(0, i, max_groups=32, large_fraction=0.3, large_inputs="full") for i in range(60)]
    assert zoo == [sample_pair(0, i, max_groups=32, large_fraction=0.3, large_inputs="zoo") for i in range(60)]
    small = [sample_pair(0, i, max_groups=32) for i in range(60)]
    moved = 0
    for s, z, f in zip(small, zoo, full):
        if z == s:  # a small pair: untouched by the option
            assert f == s
            continue
        assert (f.topology, f.batch, f.groups) == (z.topology, z.batch, z.groups)
        assert f.model == full_inputs(z.model)
        family = z.model.partition(":")[0]
        moved += f.model != z.model
        assert (f.model != z.model) == (family in LARGE_INPUTS)
    assert moved >= 5
    entries = zoo_entries()
    for spec, _ in LARGE_MODELS:  # every overridden spec names keys its family has
        family, _, opts = full_inputs(spec).partition(":")
        assert {kv.split("=")[0] for kv in opts.split(",")} <= set(entries[family].defaults)
    assert full_inputs("vgg:depth=11,width=32") == "vgg:depth=11,width=32,image=224"
    with pytest.raises(ValueError, match="large_inputs: expected one of zoo, full, got 'big'"):
        sample_pair(0, 0, large_inputs="big")
    with pytest.raises(ConfigError, match="large_inputs: expected one of zoo, full, got 'big'"):
        LoopConfig.from_dict({"gen": {"large_inputs": "big"}})


def test_generation_writes_records_and_resumes(dataset_dir):
    raw = sorted((dataset_dir / "raw").glob("*.json"))
    assert len(raw) == 3
    rec = json.loads(raw[0].read_text())
    assert rec["decisions"] and {"assign", "group", "visits", "value", "feedback"} <= set(rec["decisions"][0])
    assert abs(sum(rec["decisions"][0]["visits"]) - 1) < 1e-4
    assert rec["best_time_s"] <= min(rec["dp_even_s"], rec["dp_prop_s"])
    # resume: a finished sample is never redone
    stamp = {p.name: p.stat().st_mtime_ns for p in raw}
    os.remove(raw[1])
    assert pending(dataset_dir, _gen_cfg()) == [int(raw[1].stem)]
    generate(dataset_dir, _gen_cfg(), progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in (dataset_dir / "raw").glob("*.json")}
    assert after[raw[0].name] == stamp[raw[0].name] and after[raw[2].name] == stamp[raw[2].name]
    assert json.loads(raw[1].read_text())["pair"] == rec["pair"] or raw[1].exists()


def test_policy_target_sharpens_visits_towards_the_best_child(dataset_dir):
    import numpy as np

    from tag.data.dataset import PolicyTarget
    d = {"visits": [0.5, 0.25, 0.25, 0.0], "child_reward": [0.10, 0.20, 0.20 * 0.99 - 0.01, None]}
    assert PolicyTarget(mix=0)(d) == d["visits"]
    pi = np.array(PolicyTarget(mix=0.5, tau=0.01)(d))
    assert pi.sum() == pytest.approx(1.0) and pi[3] == 0.0
    # child 1's own plan is the fastest: it gains; child 2 is 1% slower (log1p: -0.01): 1/e of it
    assert pi[1] > 0.25 and pi[0] < 0.5
    w = np.exp((np.log1p([0.10, 0.20, 0.20 * 0.99 - 0.01]) - np.log1p(0.20)) / 0.01)
    assert pi[:3] == pytest.approx(0.5 * np.array(d["visits"][:3]) + 0.5 * w / w.sum())
    assert PolicyTarget()({"visits": [1.0, 0.0]}) == [1.0, 0.0]  # records from before child_reward
    with pytest.raises(ValueError, match="target.tau"):
        PolicyTarget(tau=0)
    rec = json.loads(sorted((dataset_dir / "raw").glob("*.json"))[0].read_text())["decisions"][0]
    assert len(rec["child_reward"]) == len(rec["visits"])
    assert all(r is not None for r, v in zip(rec["child_reward"], rec["visits"]) if v > 0)


def _label(tmp_path, i: int, **kw):
    """Label pair ``i`` of the toy stream; returns (record, its space)."""
    from tag.data.generate import label_pair, load_graph
    from tag.search.space import ActionSpace
    cfg = _gen_cfg(**kw)
    spec = sample_pair(cfg.seed, i, max_groups=cfg.max_groups, models=(("mlp:layers=2,hidden=64", (16,)),))
    rec = label_pair(tmp_path, spec, cfg)
    graph = load_graph(tmp_path, spec.model, spec.batch, spec.groups)
    return rec, ActionSpace(graph, load_topology(spec.topology))


def test_label_children_gives_every_action_its_own_simulated_reward(tmp_path):
    """``label_children``: at the first N labelled decisions every action the search tells apart
    has a reward, the one its child's completed plan gets when simulated directly; the search
    itself (visits, decided groups, feedback) is the unlabelled one."""
    import numpy as np

    from tag.search.evaluate import Evaluator
    from tag.search.mcts import search_actions
    from tag.search.toy import ToySimulator
    rec0, _ = _label(tmp_path, 2)
    rec, space = _label(tmp_path, 2, label_children=2)
    ev = Evaluator(space, ToySimulator(space.graph, space.topology, space.costs))
    missing = 0
    for k, (d, d0) in enumerate(zip(rec["decisions"], rec0["decisions"])):
        assert (d["visits"], d["assign"], d["group"], d["feedback"]) == (d0["visits"], d0["assign"], d0["group"],
                                                                         d0["feedback"])
        assign = np.asarray(d["assign"])
        acts = np.flatnonzero(search_actions(space, assign))
        missing += sum(d0["child_reward"][a] is None for a in acts)
        if k >= 2:  # past the first two: the search's own children only
            assert d["child_reward"] == d0["child_reward"]
            continue
        for a in acts:
            child = assign.copy()
            child[d["group"]] = a
            assert d["child_reward"][a] == ev.evaluate(space.resolve(child)).reward
    assert missing > 0  # the search alone left actions without a reward (the test tests something)
    assert rec["label_sim_calls"] > 0 and rec["sim_calls"] == rec0["sim_calls"] + rec["label_sim_calls"]
    assert rec["best_reward"] >= rec0["best_reward"]


def test_label_children_off_leaves_the_records_as_they_were(tmp_path):
    """``label_children = 0`` (default) writes the records a run without the option writes, byte
    for byte but the wall seconds: sha256 of the sorted JSON of pairs 0-2 of this toy stream. The
    records hold simulated times, so a change to the cost model or the simulator changes these
    hashes: recompute them (the commit message says which change moved them)."""
    import hashlib
    golden = ["0ab160e48a049f0b", "fbc1096ef6c636df", "239b716a944d672a"]
    for i, want in enumerate(golden):
        rec, _ = _label(tmp_path, i)
        rec.pop("seconds")
        assert "label_sim_calls" not in rec
        assert hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:16] == want


def test_dataset_and_fit_resume(dataset_dir, tmp_path):
    ds = PlanDataset(dataset_dir)
    assert len(ds) >= 3 and ds[0].normalised
    tr, va = split(ds, 0.3, seed=0)
    assert len(tr) + len(va) == len(ds)
    cfg = TrainConfig(epochs=1, batch_size=4, seed=0)
    torch.manual_seed(0)
    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    r1 = fit(net, tr, va, cfg, tmp_path / "ck", tag="t")
    assert len(r1["history"]) == 1 and (tmp_path / "ck" / "last.pt").exists()
    # a longer run in the same folder continues after the finished epoch
    cfg2 = TrainConfig(epochs=2, batch_size=4, seed=0)
    r2 = fit(net, tr, va, cfg2, tmp_path / "ck", tag="t")
    assert [h["epoch"] for h in r2["history"]] == [0, 1]
    assert r2["history"][0] == r1["history"][0]
    for k in ("train/policy", "val/policy", "val/value", "val/top1"):
        assert k in r2["history"][-1]


def test_config_validation_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="train.lr"):
        TrainConfig(lr=0)
    with pytest.raises(ConfigError, match="wandb"):
        LoopConfig(wandb="sometimes")
    with pytest.raises(ConfigError, match="bogus"):
        LoopConfig.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match=r"gen\.nope"):
        LoopConfig.from_dict({"gen": {"nope": 1}})
    with pytest.raises(ConfigError, match="playouts_per_step"):
        LoopConfig.from_dict({"gen": {"playouts_per_step": 0}})
    with pytest.raises(ConfigError, match=r"large_fraction: expected in \[0, 1\], got 1.5"):
        LoopConfig.from_dict({"gen": {"large_fraction": 1.5}})
    with pytest.raises(ConfigError, match="label_children: expected >= 0, got -1"):
        LoopConfig.from_dict({"gen": {"label_children": -1}})
    with pytest.raises(ConfigError, match="coarse_above: expected a positive integer, got 0"):
        LoopConfig(coarse_above=0)
    with pytest.raises(ConfigError, match=r"target\.mix: expected in \[0, 1\], got 2"):
        LoopConfig.from_dict({"target": {"mix": 2}})
    cfg = LoopConfig.from_dict({"target": {"mix": 0.0, "tau": 0.02}})
    assert LoopConfig.from_dict(cfg.to_dict()).target == cfg.target  # round-trips via config.json
    bad = tmp_path / "c.json"
    bad.write_text("{ nope")
    with pytest.raises(ConfigError) as e:
        LoopConfig.load(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    cfg = LoopConfig()
    assert LoopConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_tag_train_tiny_end_to_end(tmp_path, capsys):
    """`tag train` with a tiny config: two rounds (uniform bootstrap, then the network's prior)."""
    from tag.cli import main
    run = tmp_path / "run"
    cfg = {"run_dir": str(run), "rounds": 2, "samples_per_round": [2, 1], "wandb": "disabled", "coarse_above": 3,
           "net": {"hidden": 16, "layers": 1, "heads": 2},
           "gen": _gen_cfg(samples=1).__dict__, "train": {"epochs": 1, "batch_size": 4, "max_steps": 3}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    export = tmp_path / "exported.pt"
    rc = main(["train", "--config", str(path), "--no-progress", "--export", str(export), "--label-children", "1"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint"].endswith("predictor.pt") and export.exists()
    saved = json.loads((run / "config.json").read_text())
    assert saved["net"]["hidden"] == 16 and saved["export"] == str(export)
    assert saved["coarse_above"] == 3 and saved["gen"]["label_children"] == 1
    assert json.loads(next((run / "round0" / "raw").glob("*.json")).read_text())["label_sim_calls"] >= 0
    assert (run / "round1" / "gen_config.json").exists()
    assert json.loads((run / "round1" / "gen_config.json").read_text())["net"].endswith("round0/predictor.pt")
    net, meta = load_net(export)
    assert meta["round"] == 1 and meta["coarse_above"] == 3  # what the predictor encodes by
    assert meta["plan_head"]["rounds"] == [0, 1] and meta["plan_head"]["pairs"] >= 1  # fitted after the rounds
    assert not load_net(run / "round1" / "predictor.pt")[1].get("plan_head")
    assert sorted(p.name for p in (run / "round0" / "plan").glob("*.npz")) == ["00000.npz", "00001.npz"]
    # rerun: everything is finished, nothing is redone
    mtime = export.stat().st_mtime_ns
    assert main(["train", "--config", str(path), "--no-progress", "--label-children", "1"]) == 0
    assert (run / "round1" / "predictor.pt").exists() and export.stat().st_mtime_ns == mtime
    assert main(["train", "--run-dir", str(run), "--no-progress"]) == 0  # resumed under its own config
    # exporting onto the run's own final checkpoint leaves it as it is
    final = run / "predictor.pt"
    before = final.read_bytes()
    assert main(["train", "--run-dir", str(run), "--no-progress", "--export", str(final)]) == 0
    assert final.read_bytes() == before


def test_tune_resumes_its_study(dataset_dir, tmp_path, monkeypatch):
    from tag.training import tune as tune_mod
    monkeypatch.setattr(tune_mod, "suggest", lambda trial: (
        NetConfig(hidden=8, layers=1, heads=2), {"lr": trial.suggest_float("lr", 1e-3, 1e-2, log=True)}))
    cfg = tune_mod.TuneConfig(data=[str(dataset_dir)], study_dir=str(tmp_path / "study"), trials=1, epochs=1,
                              wandb="disabled")
    r1 = tune_mod.tune(cfg)
    assert r1["trials"] == 1 and (tmp_path / "study" / "optuna.db").exists()
    cfg.trials = 2
    r2 = tune_mod.tune(cfg)
    assert r2["trials"] == 2
    with pytest.raises(ConfigError, match="raw"):
        tune_mod.TuneConfig(data=[str(tmp_path)])


def test_tune_runs_a_trial_left_running_again_in_its_folder(dataset_dir, tmp_path, monkeypatch):
    """A trial a killed ``tag tune`` left running is failed and its parameters asked again first;
    the new trial trains in the old one's folder."""
    import optuna

    from tag.training import tune as tune_mod
    monkeypatch.setattr(tune_mod, "suggest", lambda trial: (
        NetConfig(hidden=8, layers=1, heads=2), {"lr": trial.suggest_float("lr", 1e-3, 1e-2, log=True)}))
    cfg = tune_mod.TuneConfig(data=[str(dataset_dir)], study_dir=str(tmp_path / "study"), trials=1, epochs=1,
                              wandb="disabled")
    (tmp_path / "study").mkdir()
    study = optuna.create_study(study_name=cfg.study_name, storage=f"sqlite:///{tmp_path / 'study' / 'optuna.db'}")
    killed = study.ask()
    lr = killed.suggest_float("lr", 1e-3, 1e-2, log=True)  # then the run was killed: the trial stays RUNNING
    out = tune_mod.tune(cfg, log=lambda rec: None)
    trials = optuna.load_study(study_name=cfg.study_name, storage=f"sqlite:///{tmp_path / 'study' / 'optuna.db'}").trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"] and out["best_trial"] == 1
    assert trials[1].params == {"lr": lr} and trials[1].user_attrs["folder"] == 0
    assert (tmp_path / "study" / "trial_0" / "ckpt" / "last.pt").exists() and not (tmp_path / "study" / "trial_1").exists()
