"""The plan head: features of plan-level options, its targets, its fit, checkpoints and the search."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tag.gnn import NetConfig, TagNet
from tag.gnn.plan_head import PLAN_FEATURES, plan_option_features, simulator_bound
from tag.gnn.predictor import Predictor, load_net, save_checkpoint
from tag.search.evaluate import Evaluator
from tag.search.mcts import PLAN_PRIOR_FLOOR, mcts_search, plan_prior, uniform_prior
from tag.search.space import PLAN_DECISIONS, ActionSpace, PipelineChoice
from tag.sim import lower_bound
from tag.training.plan_head import PlanHeadConfig, decision_targets, fit_plan_head, pipeline_keys, plan_loss


@pytest.fixture(scope="module")
def pipe_space(captured, topo4):
    """A 4-device space with pipelines and every pipeline's simulated reward."""
    graph = captured("gpt2:n_layer=2,n_embd=64", 16, groups=8).graph
    space = ActionSpace(graph, topo4, tensor_parallel=True, pipelines=True)
    ev = Evaluator(space, None)
    rewards = {}
    for key in pipeline_keys(space):
        o = ev.evaluate(key)
        rewards[key] = ev.reward(o.time_s, o.oom)
    return space, ev, rewards


def _walk(space, nodes, pick):
    """Follow ``pick(target)`` from the stage count down; returns the choices made."""
    by = {(d, tuple(sorted(c.items()))): pi for d, c, pi, _ in nodes}
    chosen = {}
    for d, name in enumerate(PLAN_DECISIONS):
        pi = by.get((d, tuple(sorted(chosen.items()))))
        if pi is None:
            break
        chosen[name] = space.options(name, chosen.get("stages", 1))[pick(pi)]
        if chosen.get("stages", 1) == 1:
            break
    return chosen


def test_targets_lead_to_the_best_plan(pipe_space):
    space, _, rewards = pipe_space
    assert len(rewards) >= 6 and len(set(rewards.values())) > 1
    best_key = max(rewards, key=rewards.get)
    # no pipeline worse than every pipeline: the targets' argmax path is the best pipeline
    nodes = decision_targets(space, rewards, no_pipeline=-1.0)
    got = _walk(space, nodes, lambda pi: int(np.argmax(pi)))
    p, m, t, s, k, cut = best_key
    assert got == {"stages": p, "cut": cut, "stage_sync": t, "micro": m, "schedule": (s, k)}
    for d in range(len(PLAN_DECISIONS)):  # every depth weighs as much as the root
        w = [wt for dd, _, _, wt in nodes if dd == d]
        assert not w or math.isclose(sum(w), 1.0)
    for _, _, pi, _ in nodes:
        assert math.isclose(pi.sum(), 1.0) and (pi >= 0).all()
    # no pipeline better than every pipeline: the stage count's target is "no pipeline"
    high = max(rewards.values()) + 1.0
    root = [pi for d, _, pi, _ in decision_targets(space, rewards, no_pipeline=high) if d == 0][0]
    assert int(np.argmax(root)) == 0 and root[0] > 0.99


def test_option_features_describe_the_completed_pipelines(pipe_space):
    space, ev, rewards = pipe_space
    bound = simulator_bound(space, ev.simulator)
    lb = float(lower_bound(space.graph, space.topology, space.cost_model))
    root = plan_option_features(space, None, 0, bound, ev.t_ref, lb)
    stages = space.options("stages", 1)
    assert root.shape == (len(stages), PLAN_FEATURES)
    assert root[0, 0] == 1.0 and (root[1:, 0] == 0).all()  # no pipeline, then pipelines
    assert (root[:, 10] == 1).all() and (root[:, 11:15] == 0).all()
    p = stages[1]
    sched = plan_option_features(space, {"stages": p, "cut": "time", "stage_sync": 1, "micro": 2 * p}, 4, bound,
                                 ev.t_ref, lb)
    assert (sched[:, 14] == 1).all() and sched.shape[0] == len(space.options("schedule", p))
    # the bound column is a lower bound of each completed pipeline's simulated time
    checked = 0
    for (s, k), row in zip(space.options("schedule", p), sched):
        key = PipelineChoice(p, 2 * p, 1, s, k, "time")
        if key in rewards and rewards[key] > -1 and abs(row[8]) < 1:
            t_sim = ev.t_ref / (1 + rewards[key])
            assert ev.t_ref * math.exp(-5 * row[8]) <= t_sim * (1 + 1e-9)
            checked += 1
    assert checked >= 2


def _examples(space, ev, rewards, net, seeds):
    """Examples of :func:`tag.training.plan_head.pair_examples`'s form for one space, with the
    no-pipeline reward varied (the same pair seen with TAG's search doing better or worse)."""
    bound = simulator_bound(space, ev.simulator)
    lb = float(lower_bound(space.graph, space.topology, space.cost_model))
    pred = Predictor(net)
    root = ev.evaluate(space.resolve_path([]))
    z = pred.plan_z(pred.context(space, ev.t_ref), root.feedback)[0].numpy()
    out = []
    for no_pipe in seeds:
        nodes = decision_targets(space, rewards, no_pipe)
        width = max(len(pi) for _, _, pi, _ in nodes)
        opts, mask, tgt = np.zeros((len(nodes), width, PLAN_FEATURES)), np.zeros((len(nodes), width), bool), \
            np.zeros((len(nodes), width))
        for i, (d, c, pi, _) in enumerate(nodes):
            f = plan_option_features(space, c, d, bound, ev.t_ref, lb)
            opts[i, :len(f)], mask[i, :len(f)], tgt[i, :len(pi)] = f, True, pi
        out.append({"z": z, "options": opts, "mask": mask, "target": tgt,
                    "weight": np.array([w for *_, w in nodes])})
    return out


def test_fit_learns_the_targets_and_is_deterministic(pipe_space):
    space, ev, rewards = pipe_space
    torch.manual_seed(0)
    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    ex = _examples(space, ev, rewards, net, [-1.0, max(rewards.values()) + 1.0, max(rewards.values()) - 0.01])
    res = fit_plan_head(net, ex, PlanHeadConfig(epochs=150, val_fraction=0.0))
    assert res["after"]["train_ce"] < 0.8 * res["before"]["train_ce"]
    again = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    again.load_state_dict({k: v for k, v in net.state_dict().items()})
    res2 = fit_plan_head(again, ex, PlanHeadConfig(epochs=150, val_fraction=0.0))
    assert res2["after"] == res["after"]
    from tag.training.plan_head import _stack
    with torch.no_grad():
        ce, _ = plan_loss(net, _stack(ex))
    assert math.isclose(float(ce), res["after"]["train_ce"], rel_tol=1e-6)
    with pytest.raises(ValueError, match="epochs"):
        PlanHeadConfig(epochs=0)


def test_checkpoints_without_a_plan_head_keep_the_fixed_prior(tmp_path, pipe_space):
    space, ev, _ = pipe_space
    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    old = tmp_path / "old.pt"  # a checkpoint from before the plan head: no plan.* weights, no meta
    save_checkpoint(old, net, {})
    import tag.io
    ck = tag.io.load_tensors(old, RuntimeError, "x")
    ck["state_dict"] = {k: v for k, v in ck["state_dict"].items() if not k.startswith("plan.")}
    tag.io.save_tensors(old, ck)
    loaded, meta = load_net(old)
    assert "plan_head" not in meta
    assert Predictor.load(old).bind_plan(space, ev.t_ref, ev.simulator) is None
    new = tmp_path / "new.pt"
    save_checkpoint(new, net, {"plan_head": {"pairs": 1}})
    fn = Predictor.load(new).bind_plan(space, ev.t_ref, ev.simulator)
    assert fn is not None


def test_search_takes_the_learned_prior_at_plan_decisions(pipe_space):
    space, ev, _ = pipe_space
    n = len(space.options("stages", 1))

    def plan_fn(sp, st):  # all mass on the last option of every plan-level decision
        opts = sp.options(PLAN_DECISIONS[st.plan_decision], (st.pipeline or {}).get("stages", 1))
        out = np.zeros(sp.num_actions)
        out[len(opts) - 1] = 1.0
        return out
    fresh = Evaluator(space, None)
    res = mcts_search(space, fresh, uniform_prior, np.random.default_rng(0), playouts=12, plan_fn=plan_fn)
    from tag.search.mcts import SearchState
    fixed = plan_prior(space, SearchState(np.full(space.num_groups, -1), -1, None, plan_decision=0))
    want = PLAN_PRIOR_FLOOR * fixed / fixed.sum()
    want[n - 1] += 1 - PLAN_PRIOR_FLOOR
    assert np.allclose(res.tree.prior[0], want, atol=1e-6)
    base = mcts_search(space, Evaluator(space, None), uniform_prior, np.random.default_rng(0), playouts=12)
    assert np.allclose(base.tree.prior[0], fixed / fixed.sum(), atol=1e-6)


def test_plan_head_command_refuses_to_overwrite_its_input(tmp_path):
    from tag.training.plan_head import main
    ck = tmp_path / "in.pt"
    save_checkpoint(ck, TagNet(NetConfig(hidden=16, layers=1, heads=2)), {})
    with pytest.raises(SystemExit, match="--out .*: expected a path other than --checkpoint"):
        main(["--run-dir", str(tmp_path), "--checkpoint", str(ck), "--rounds", "0", "--out", str(ck)])
    with pytest.raises(SystemExit, match="--rounds x: expected comma-separated round numbers"):
        main(["--run-dir", str(tmp_path), "--checkpoint", str(ck), "--rounds", "x", "--out", str(tmp_path / "o.pt")])
    before = ck.read_bytes()
    with pytest.raises(SystemExit, match="round0/raw not found"):
        main(["--run-dir", str(tmp_path), "--checkpoint", str(ck), "--rounds", "0", "--out", str(tmp_path / "o.pt")])
    (tmp_path / "round0" / "raw").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no labelled pair has plan-level decisions; nothing written"):
        main(["--run-dir", str(tmp_path), "--checkpoint", str(ck), "--rounds", "0", "--out", str(tmp_path / "o.pt")])
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(SystemExit, match=f"^{bad}: .*predictor checkpoint"):
        main(["--run-dir", str(tmp_path), "--checkpoint", str(bad), "--rounds", "0", "--out", str(tmp_path / "o.pt")])
    assert ck.read_bytes() == before and not (tmp_path / "o.pt").exists()


def test_open_pipeline_choices_follow_the_completion(tmp_path, pipe_space):
    """A path that stops at the stage count is completed as ``pipeline_completion`` says (the
    plan head's choices in the search), not by the fixed defaults."""
    space, ev, _ = pipe_space
    p = space.options("stages", 1)[1]
    j = 1  # action index of that stage count
    micro = space.options("micro", p)
    default = space.resolve_path([j])
    assert default.micro == micro[space.default_option("micro", p)]  # (fixed default: 2 x stages where it fits)
    last = space.options("schedule", p)[-1]
    space.pipeline_completion = lambda c: {"cut": "memory", "stage_sync": 1, "micro": micro[0], "schedule": last, **c}
    try:
        assert space.resolve_path([j]) == PipelineChoice(p, micro[0], 1, last[0], last[1], "memory")
    finally:
        space.pipeline_completion = None
    assert space.resolve_path([j]) == default
    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    ck = tmp_path / "head.pt"
    save_checkpoint(ck, net, {"plan_head": {"pairs": 1}})
    fn = Predictor.load(ck).bind_plan(space, ev.t_ref, ev.simulator)
    got = fn.complete({"stages": p})
    assert set(got) == set(PLAN_DECISIONS) and got["stages"] == p
    assert all(got[n] in space.options_at(n, got) for n in PLAN_DECISIONS[1:])
    assert fn.complete({"stages": p}) == got
    assert fn.complete({"stages": p, "micro": micro[-1]})["micro"] == micro[-1]  # made choices are kept


def test_find_plan_says_who_chose_the_pipeline_decisions(captured, topo4, tmp_path):
    from tag.planner import PlannerConfig, find_plan
    graph = captured("gpt2:n_layer=2,n_embd=64", 16, groups=8).graph
    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    with_head, without = tmp_path / "with.pt", tmp_path / "without.pt"
    save_checkpoint(with_head, net, {"plan_head": {"pairs": 1}})
    save_checkpoint(without, net, {})
    kw = dict(budget=6, compression="off", layout_grid=False)
    assert find_plan(graph, topo4, PlannerConfig(checkpoint=with_head, **kw)).meta["plan_prior"] == "network"
    assert find_plan(graph, topo4, PlannerConfig(checkpoint=without, **kw)).meta["plan_prior"] == "fixed"
    assert find_plan(graph, topo4, PlannerConfig(prior="uniform", **kw)).meta["plan_prior"] == "fixed"
    assert find_plan(graph, topo4, PlannerConfig(pipelines="off", **kw)).meta["plan_prior"] is None


def test_plan_labels_are_cached_and_a_killed_fit_resumes(tmp_path, pipe_space, topo4, monkeypatch):
    """``cached_labels`` writes each pair's labels once (atomically) and reads them back without
    pickle; a missing file (a fit killed before it) is the only one computed again."""
    import tag.training.plan_head as ph
    space, ev, _ = pipe_space
    graph = space.graph
    calls = []
    real = ph.pair_labels
    monkeypatch.setattr(ph, "pair_labels", lambda rec, sp: calls.append(rec["pair"]["index"]) or real(rec, sp))
    fresh = ActionSpace(graph, topo4, tensor_parallel=True, pipelines=True)
    rec = {"pair": {"index": 3}, "best_oom": False, "best_time_s": ev.t_ref}
    path = tmp_path / "plan" / "00003.npz"
    a = ph.cached_labels(rec, fresh, path)
    b = ph.cached_labels(rec, fresh, path)
    assert calls == [3] and path.exists() and not list(path.parent.glob("*.tmp*"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    path.unlink()
    ph.cached_labels(rec, fresh, path)
    assert calls == [3, 3]


def test_a_plan_head_changes_no_label_of_tag_train(tmp_path):
    """``tag train`` labels op-group decisions in a space without plan-level decisions
    (:func:`tag.data.generate.label_pair`; ``run_episode`` refuses a space with them), so a plan
    head changes none of its labels, although the same pair searched with pipelines gives the head
    decisions to act on: fitting the head after every round, not only after the last, cannot change
    the next round's targets (``evaluation/results/planner-bench-planhead/README.md at 6262d00``, 2026-11-27)."""
    import json

    from tag.data.generate import GenConfig, label_pair, load_graph
    from tag.data.pairs import sample_pair
    from tag.topology import load_topology
    model = ("mlp:layers=2,hidden=64", (16,))
    cfg = GenConfig(samples=1, workers=1, playouts_per_step=4, max_steps=2, max_groups=8, models=["mlp:layers=2,hidden=64@16"])
    spec = sample_pair(cfg.seed, 0, max_groups=8, models=(model,))
    torch.manual_seed(0)
    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    strip = lambda r: json.dumps({k: v for k, v in r.items() if k not in ("seconds", "label_seconds")})  # noqa: E731
    without = label_pair(tmp_path, spec, cfg, Predictor(net))
    with_head = label_pair(tmp_path, spec, cfg, Predictor(net, plan_head=True))
    assert strip(with_head) == strip(without)
    space = ActionSpace(load_graph(tmp_path, spec.model, spec.batch, spec.groups), load_topology(spec.topology),
                        pipelines=True)
    ev = Evaluator(space, None)
    assert space.plan_options and Predictor(net, plan_head=True).bind_plan(space, ev.t_ref, ev.simulator) is not None


def _small_gpus(memory_bytes: float, n: int = 4):
    from tag.topology import load_topology
    gpu = {"name": "small", "tflops": 10, "memory": f"{int(memory_bytes)} B", "memory_bandwidth": "500 GB/s"}
    return load_topology({"name": "small", "machines": [{"name": "m0", "gpu": gpu, "count": n,
                                                          "intra_bandwidth": "100 GB/s"}]})


def test_completion_skips_options_the_bound_puts_out_of_memory(captured):
    """The head's most likely option is taken unless the simulator's static bound puts its pipeline
    out of memory: on devices that hold a 2-stage pipeline's 1F1B activations but not GPipe's,
    a head that prefers GPipe completes with a schedule that fits (the network stands in here by
    fixed scores: the completion rule is under test)."""
    from tag.gnn.predictor import PlanHeadPrior
    from tag.sim import Simulator

    graph = captured("gpt2:n_layer=2,n_embd=64", 16, groups=8).graph

    def peak(topo, key):
        sp = ActionSpace(graph, topo, pipelines=True)
        groups, pipe = sp.pipeline_plan(key)
        return max(Simulator(graph, topo, sp.cost_model).run(groups, pipeline=pipe).peak_memory_bytes)

    big = _small_gpus(1e12)
    key = PipelineChoice(2, 8, 1, "1f1b", 1, "time")
    gpipe = key._replace(schedule="gpipe")
    low, high = peak(big, key), peak(big, gpipe)
    assert high > 1.2 * low  # GPipe keeps all 8 micro-batches' activations alive, 1F1B at most 2
    topo = _small_gpus((low + high) / 2)
    space = ActionSpace(graph, topo, pipelines=True)
    ev = Evaluator(space, None)
    cap = topo.devices[0].gpu.memory_bytes
    assert peak(topo, key) <= cap < peak(topo, gpipe)  # (as built; the search would recompute to fit)

    class PrefersGPipe(PlanHeadPrior):
        def scores(self, sp, chosen, decision, feedback):
            opts = sp.options_at(PLAN_DECISIONS[decision], chosen)
            return np.array([2.0 if o == ("gpipe", 1) else 1.0 for o in opts]) / len(opts)

    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    head = PrefersGPipe(Predictor(net), space, ev.t_ref, ev.simulator)
    chosen = {"stages": 2, "cut": "time", "stage_sync": 1, "micro": 8}
    assert head.complete(chosen)["schedule"] != ("gpipe", 1)
    assert peak(topo, space.default_pipeline_key(head.complete(chosen))) <= cap
    roomy = ActionSpace(graph, big, pipelines=True)  # where GPipe fits, the head's choice stands
    ev_big = Evaluator(roomy, None)
    assert PrefersGPipe(Predictor(net), roomy, ev_big.t_ref, ev_big.simulator).complete(chosen)["schedule"] == ("gpipe", 1)


def test_micro_batch_options_count_a_tensor_parallel_replica_once(pipe_space):
    """A tensor-parallel stage's replica is ``tp`` devices sharing its samples, so more micro-batches
    fit the batch than with data-parallel stages (as in the layout grid); a path that picks one
    decodes to a plan the layouts build."""
    space, ev, _ = pipe_space
    p = 2
    t = max(space.options("stage_sync", p))
    assert t > 1
    dp_micro, tp_micro = space.options("micro", p), space.options("micro", p, t)
    w = space.num_devices // p
    assert max(dp_micro) * w <= space.graph.batch_size < 2 * max(dp_micro) * w
    assert tp_micro[: len(dp_micro)] == dp_micro and max(tp_micro) * (w // t) <= space.graph.batch_size
    assert len(tp_micro) > len(dp_micro)
    path = [space.options("stages", 1).index(p), 0, space.options("stage_sync", p).index(t), len(tp_micro) - 1, 0]
    key = space.resolve_path(path)
    assert (key.stages, key.micro, key.tp) == (p, max(tp_micro), t) and space.plan_of(key) is not None
    assert space.options_at("micro", space.decode(path)[1]) == tp_micro
