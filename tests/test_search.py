"""Tests for tag.search: action space, evaluator, MCTS mechanics, searchers, find_plan() and `tag plan`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tag.errors import TagError
from tag.parallel import validate_group, validate_plan
from tag.planner import PlannerConfig, find_plan
from tag.search import ActionSpace, Evaluator, MCTSConfig, mcts_search, uniform_prior
from tag.search.mcts import (
    Tree,
    add_virtual_loss,
    backup,
    new_tree,
    puct_scores,
    run_episode,
    run_playouts,
    visit_distribution,
)
from tag.search.searchers import random_search, simulated_annealing, tpe_search
from tag.search.space import CUT_TIE, device_subsets
from tag.search.toy import ToySimulator
from tag.topology import load_topology


def _topo(machines, bw="10 Gbit/s", name="t"):
    return load_topology({
        "name": name,
        "machines": [{"name": f"m{i}", "gpu": gpu, "count": c, **({"intra_bandwidth": "100 GB/s"} if c > 1 else {})}
                     for i, (gpu, c) in enumerate(machines)],
        "network": {"bandwidth": bw},
    })


@pytest.fixture(scope="module")
def graph(captured):
    return captured("gpt2", batch=16, groups=8).graph


@pytest.fixture(scope="module")
def topo():
    return _topo([("A100-40GB", 2), ("V100-SXM2-16GB", 2), ("T4", 4)])


@pytest.fixture
def space(graph, topo):
    return ActionSpace(graph, topo)


def test_action_space_is_tractable_on_large_clusters(graph):
    big = _topo([("A100-40GB", 4), ("V100-SXM2-16GB", 4), ("T4", 4), ("RTX-3090", 4)] * 2)
    assert big.num_devices == 32 and big.num_machines == 8
    sp = ActionSpace(graph, big)
    assert 8 < sp.num_actions <= 120  # TAG: 3 * (2^8 - 1) = 765
    assert sp.actions[0].devices == tuple(range(32)) and sp.actions[0].sync == "allreduce"
    subsets = [d for d, _ in device_subsets(big, sp.costs.device_speed)]
    assert len(subsets) == len(set(subsets))


def test_small_clusters_enumerate_every_machine_subset(space, topo):
    machine_sets = {frozenset(topo.machine_of(d) for d in a.devices) for a in space.actions
                    if len(a.devices) > 1 or topo.machines[topo.machine_of(a.devices[0])].count == 1}
    assert len(machine_sets) == 2 ** topo.num_machines - 1


def test_every_action_materialises_a_valid_group_plan(space, graph, topo):
    for g in range(graph.num_groups):
        for a in range(space.num_actions):
            gp = space.group_plan(g, a)
            validate_group(gp, graph, g, topo.num_devices, f"groups[{g}]")
            if gp.sync != "mp" and len(gp.devices) > 1:
                t = space.costs.group_time_full[g, gp.devices]
                # shares proportional to the group's speed: share * time is constant
                assert np.allclose(np.array(gp.shares) * t, gp.shares[0] * t[0], rtol=1e-6)


def test_decision_order_and_defaults(space):
    k = space.num_groups
    t = space.costs.group_time_full[:, int(np.argmax(space.costs.device_speed))]
    stake = space.stake_s
    assert all(stake[a] >= stake[b] for a, b in zip(space.order, space.order[1:]))
    # the stake is the compute plus the all-reduce of the group's gradients over every device
    sync = stake - t
    weights = space.costs.param_bytes > 0
    assert np.all(sync[~weights] == 0) and np.all(sync[weights] > 0)
    devices = list(range(space.num_devices))
    g = int(np.argmax(space.costs.param_bytes))
    assert sync[g] == pytest.approx(space.cost_model.comm.allreduce_time(devices, space.costs.param_bytes[g]))
    # without a cost model the topology's datasheet links price the same all-reduce
    from tag.cost.comm import CommModel
    from tag.search.space import decision_stake
    rough = decision_stake(space.costs, CommModel.nominal(space.topology)) - t
    assert np.all(rough[~weights] == 0) and np.all(rough[weights] > 0)
    assert space.resolve(np.full(k, -1)) == (space.default_action,) * k
    assign = np.full(k, -1)
    assign[1], assign[k - 1] = 3, 5
    res = space.resolve(assign)
    assert res[0] == 3 and res[1] == 3 and res[k - 1] == 5
    # the undecided run 2..k-2 is cut once, where the fewest bytes cross
    cut = [b for b in range(1, k - 1) if res[b] == 3 and res[b + 1] == 5]
    assert len(cut) == 1 and sorted(set(res)) == [3, 5]
    crossing = [sum(nb for (g1, g2), nb in space.costs.flow.items() if min(g1, g2) <= b < max(g1, g2))
                for b in range(1, k - 1)]
    assert crossing[cut[0] - 1] <= min(crossing) * (1 + CUT_TIE)
    # equal neighbours fill the run between them
    assign[k - 1] = 3
    assert space.resolve(assign) == (3,) * k


def test_evaluator_scores_baselines_first_and_caches(space, graph, topo):
    sim = ToySimulator(graph, topo, space.costs)
    ev = Evaluator(space, sim)
    assert sim.calls == 2 and ev.best_source in ("dp-even", "dp-prop")
    assert ev.t_ref == min(ev.dp_even_out.time_s, ev.dp_prop_out.time_s)
    acts = (1,) * space.num_groups
    o1 = ev.evaluate(acts)
    o2 = ev.evaluate(acts)
    assert o1 is o2 and sim.calls == 3
    assert o1.reward == pytest.approx(ev.t_ref / o1.time_s - 1)


def test_tree_functions():
    t = Tree(num_actions=3, capacity=2)
    root = t.add(-1, -1)
    t.prior[root] = [0.1, 0.8, 0.1]
    t.expanded[root] = True
    s = puct_scores(t, root, 1.0, 0.0, 1.0)
    assert int(np.argmax(s)) == 1
    c = t.add(root, 1)
    c2 = t.add(c, 0)  # grows past capacity
    assert t.capacity >= 3 and t.depth[c2] == 2
    add_virtual_loss(t, c2, root)
    assert t.visits[root] == 1 and t.value_sum[root] == -1
    backup(t, c2, 0.5, root, sim_reward=0.5, virtual=1.0)
    assert t.visits[root] == 1 and t.value_sum[root] == pytest.approx(0.5) and t.best[root] == 0.5
    assert visit_distribution(t, root)[1] == 1.0


def test_mcts_visits_and_determinism(space, graph, topo):
    def run(seed):
        ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
        r = mcts_search(space, ev, uniform_prior, np.random.default_rng(seed), playouts=40,
                        cfg=MCTSConfig(batch=4))
        return r, ev

    r1, ev1 = run(0)
    r2, _ = run(0)
    assert r1.stats.playouts == 40
    # every playout proposed a plan not simulated before (the root's own plan is the first);
    # a playout that completed to an already simulated plan was walked but not counted
    assert ev1.sim_calls - 2 == 40  # minus the two data-parallel baselines
    assert r1.tree.visits[0] == 40 + r1.stats.repeats
    assert r1.actions == r2.actions and r1.time_s == r2.time_s
    assert r1.time_s <= min(ev1.dp_even_out.time_s, ev1.dp_prop_out.time_s)


def test_proposed_plans_are_simulated_after_the_tree_out_of_the_budget(space, graph, topo):
    k = space.num_groups
    mp_all = space.action_index(range(space.num_devices), "mp")  # a plan no default completes to
    proposal = space.canonical([mp_all] * k)
    root_plan = space.resolve(np.full(k, -1))  # the root's own plan, simulated by the tree
    seen = []

    def propose_fn(sp, root):
        seen.append(root)
        return [root_plan, proposal, proposal]

    ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
    r = mcts_search(space, ev, uniform_prior, np.random.default_rng(0), playouts=12,
                    cfg=MCTSConfig(batch=4), propose_fn=propose_fn, reserve=2)
    assert len(seen) == 1 and (seen[0].assign < 0).all()
    assert seen[0].feedback is r.tree.feedback[0]  # the root plan's simulator feedback
    assert r.proposals == [root_plan, proposal]  # at most `reserve` of them
    assert proposal in ev.cache and r.stats.playouts == 12 and ev.sim_calls - 2 == 12
    assert r.stats.repeats >= 1  # the root's plan, proposed again: its playout went back to the tree
    assert r.time_s <= ev.cache[proposal].time_s
    tree_only = mcts_search(space, Evaluator(space, ToySimulator(graph, topo, space.costs)), uniform_prior,
                            np.random.default_rng(0), playouts=10, cfg=MCTSConfig(batch=4))
    assert r.stats.improvements[:len(tree_only.stats.improvements)] == tree_only.stats.improvements


def test_prior_steers_the_search(space, graph, topo):
    target = space.num_actions - 1

    def peaked(sp, states):
        p = np.full((len(states), sp.num_actions), 1e-3)
        p[:, target] = 1.0
        return p / p.sum(1, keepdims=True), np.full(len(states), np.nan)

    ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
    tree = new_tree(space)
    run_playouts(tree, 0, space, ev, peaked, np.random.default_rng(0), playouts=8, cfg=MCTSConfig(batch=1))
    assert tree.children[0, target] >= 0
    assert visit_distribution(tree, 0)[target] >= 0.5


def _value_model(space, graph, topo, error):
    """A uniform prior with a value head that predicts the true reward off by ``error(i)`` in
    log-time (``i``: the prediction's number)."""
    oracle = Evaluator(space, ToySimulator(graph, topo, space.costs))
    count = [0]

    def fn(sp, states):
        vals = []
        for s in states:
            r = oracle.evaluate_partial(s.assign)[1].reward
            vals.append(np.expm1(np.log1p(r) + error(count[0])) if r > -1 else -1.0)
            count[0] += 1
        return np.full((len(states), sp.num_actions), 1.0 / sp.num_actions), np.array(vals)
    return fn


def test_value_cut_saves_simulator_calls(space, graph, topo):
    ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
    accurate = _value_model(space, graph, topo, lambda i: 0.0)
    r = mcts_search(space, ev, accurate, np.random.default_rng(0), playouts=60, cfg=MCTSConfig(min_sims=4))
    assert r.stats.value_cuts > 0 and ev.sim_calls < 60
    assert r.stats.value_error() == pytest.approx((0.0, 0.0), abs=1e-9)


def test_value_cut_is_calibrated_on_the_search(space, graph, topo):
    def run(error):
        ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
        r = mcts_search(space, ev, _value_model(space, graph, topo, error), np.random.default_rng(0), playouts=60,
                        cfg=MCTSConfig(min_sims=4))
        return r.stats
    exact = run(lambda i: 0.0)
    # a constant bias is measured and corrected: the same leaves are cut
    biased = run(lambda i: -2.0)
    assert biased.value_cuts == exact.value_cuts and biased.value_error()[0] == pytest.approx(-2.0)
    # a value head whose error is large on this pair cuts less
    noise = np.random.default_rng(1).normal(0.0, 1.0, 10_000)
    noisy = run(lambda i: noise[i])
    assert noisy.value_error()[1] > 0.5 and noisy.value_cuts < exact.value_cuts


def test_episode_records_one_decision_per_group(space, graph, topo):
    ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
    dec, tree, stats = run_episode(space, ev, uniform_prior, np.random.default_rng(1), playouts_per_step=6,
                                   max_steps=4)
    assert [d.group for d in dec] == space.order[:4]
    for i, d in enumerate(dec):
        assert (d.assign >= 0).sum() == i and d.visits.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("fn", [random_search, simulated_annealing, tpe_search])
def test_baseline_searchers(fn, space, graph, topo):
    ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
    best0 = ev.best_time
    st = fn(space, ev, np.random.default_rng(0), playouts=15)
    assert st.playouts == 15 and ev.best_time <= best0
    assert ev.sim_calls - 2 == 15  # a playout is a plan not simulated before, as in MCTS


@pytest.mark.parametrize("fn", [random_search, simulated_annealing, tpe_search, mcts_search])
def test_searchers_without_a_playout_limit_stop_at_the_deadline(fn, space, graph, topo):
    """``playouts=None`` (a time limit alone, :attr:`PlannerConfig.playouts`): the search runs past
    any small budget until its deadline, and ends there."""
    import time

    ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
    rng, t0 = np.random.default_rng(0), time.perf_counter()
    if fn is mcts_search:
        stats = mcts_search(space, ev, uniform_prior, rng, playouts=None, time_limit=0.3).stats
    else:
        stats = fn(space, ev, rng, playouts=None, deadline=t0 + 0.3)
    assert stats.playouts >= 1 and stats.playouts == ev.sim_calls - 2
    assert time.perf_counter() - t0 < 10.0  # ended at the deadline (plus one wave or proposal)


class _DPWins:
    """Every plan but all-device data parallel is ten times slower."""

    def __init__(self, n):
        self.n = n

    def run(self, groups):
        from tag.search.toy import ToyResult
        dp = all(len(g.devices) == self.n and g.sync == "allreduce" for g in groups)
        z = [0.0] * self.n
        return ToyResult(1.0 if dp else 10.0, False, z, [1e12] * self.n, z, z, [0.0] * len(groups))


@pytest.mark.parametrize("searcher", ["mcts", "sa", "random"])
def test_falls_back_to_the_best_baseline(graph, topo, searcher):
    p = find_plan(graph, topo, PlannerConfig(searcher=searcher, prior="uniform", budget=20), simulator=_DPWins(topo.num_devices))
    assert p.meta["source"] in ("dp-even", "dp-prop") and p.predicted_iteration_time_s == 1.0
    validate_plan(p, graph, topo)


def test_plan_with_the_real_simulator(graph, topo):
    p1 = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=30, seed=3))
    p2 = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=30, seed=3))
    validate_plan(p1, graph, topo)
    assert p1.to_dict()["groups"] == p2.to_dict()["groups"]
    m = p1.meta
    best_dp = min(m["dp_even_time_s"], m["dp_prop_time_s"])
    assert p1.predicted_iteration_time_s <= best_dp
    assert m["lower_bound_s"] <= p1.predicted_iteration_time_s
    assert m["playouts"] == 30


def test_plan_time_limit(graph, topo):
    p = find_plan(graph, topo, PlannerConfig(prior="uniform", time_limit=0.5))
    assert p.meta["search_time_s"] < 5 and p.meta["playouts"] >= 1


def test_plan_rejects_bad_arguments(graph, topo):
    with pytest.raises(TagError, match="searcher"):
        find_plan(graph, topo, PlannerConfig(searcher="bogus"))
    with pytest.raises(TagError, match="budget"):
        find_plan(graph, topo, PlannerConfig(budget=0))
    with pytest.raises(TagError, match="prior"):
        find_plan(graph, topo, PlannerConfig(prior="magic"))
    with pytest.raises(TagError, match="^config: expected a PlannerConfig, got dict$"):
        find_plan(graph, topo, {"budget": 3})


@pytest.mark.parametrize("field,value,expected", [
    ("budget", 2.5, "budget: expected a positive number of playouts or None, got 2.5"),
    ("budget", True, "budget: expected a positive number of playouts or None, got True"),
    ("time_limit", 0, "time_limit: expected a positive number of seconds or None, got 0"),
    ("seed", -1, "seed: expected an integer >= 0, got -1"),
    ("pipelines", "on", "pipelines: expected one of auto, grid, off, got 'on'"),
    ("compression", "sfb", "compression: expected 'auto' or 'off', got 'sfb'"),
    ("one_shot", 1, "one_shot: expected True or False, got 1"),
    ("mcts", {}, "mcts: expected an MCTSConfig or None, got {}"),
])
def test_planner_config_names_the_field(field, value, expected):
    from tag.planner import PlannerConfigError
    with pytest.raises(PlannerConfigError) as e:
        PlannerConfig(**{field: value})
    assert str(e.value) == expected


def test_planner_config_playouts():
    """None is no limit: a time limit alone bounds the search; neither gives the default budget."""
    from tag.planner import DEFAULT_PLAYOUTS
    assert PlannerConfig().playouts == DEFAULT_PLAYOUTS
    assert PlannerConfig(time_limit=2.0).playouts is None
    assert PlannerConfig(budget=7, time_limit=2.0).playouts == 7


def test_planner_result_reads_the_meta(graph, topo, tmp_path):
    """PlannerResult.of gives find_plan's meta typed, from the plan and from its file; a plan file
    without the planner's keys (written by hand, by layout_plan) reads as None."""
    from tag.plan import Plan
    from tag.planner import PlannerResult, layout_plan
    p = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=4, seed=1, compression="off"))
    r = PlannerResult.of(p)
    assert (r.searcher, r.seed, r.playouts, r.compression) == ("mcts", 1, 4, "off")
    assert r.source == p.meta["source"] and r.dp_even_time_s == p.meta["dp_even_time_s"]
    p.save(tmp_path / "p.json")
    assert PlannerResult.of(Plan.load(tmp_path / "p.json")) == r
    bare = PlannerResult.of(layout_plan(graph, topo, "dp=8"))
    assert bare.source is None and bare.playouts is None


def test_runs_pipelines_is_the_simulator_capability(graph, topo):
    """Pipelines are searched where the simulator says it runs them (Simulator.runs_pipelines),
    not where its run method happens to take a ``pipeline`` keyword."""
    from tag.planner import runs_pipelines
    from tag.sim import Simulator
    assert runs_pipelines(None) and runs_pipelines(Simulator(graph, topo))
    assert not runs_pipelines(_DPWins(topo.num_devices)) and not runs_pipelines(ToySimulator(graph, topo))
    p = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=3), simulator=_DPWins(topo.num_devices))
    assert p.pipeline is None and p.meta["space"]["stages"] is None


def test_cli_plan_json(tmp_path, capsys):
    from tag.cli import main
    out = tmp_path / "plan.json"
    trace = tmp_path / "trace.json"
    rc = main(["plan", "--model", "mlp", "--topology", "topologies/tag-testbed.yaml", "--prior", "uniform",
               "--budget", "12", "--groups", "4", "--out", str(out), "--trace", str(trace), "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    for k in ("predicted_iteration_time_s", "dp_even_time_s", "dp_prop_time_s", "lower_bound_s", "playouts",
              "search_time_s"):
        assert k in s
    assert s["predicted_iteration_time_s"] <= min(s["dp_even_time_s"], s["dp_prop_time_s"])
    assert s["one_shot_time_s"] is None  # no network, no one-shot plan
    assert json.loads(out.read_text())["groups"] and trace.exists()
    # the search's progress: each improvement beats the one before
    imp = s["improvements"]
    assert all(a[0] < b[0] <= s["playouts"] and a[1] > b[1] for a, b in zip(imp, imp[1:]))
    if imp:
        assert imp[0][0] == s["first_beat_dp_playout"]
        assert imp[-1][1] >= s["predicted_iteration_time_s"] * (1 - 1e-9)  # compression may lower it


def test_cli_plan_table_and_errors(capsys):
    from tag.cli import main
    rc = main(["plan", "--model", "mlp", "--topology", "topologies/tag-testbed.yaml", "--searcher", "sa",
               "--budget", "8", "--groups", "4", "--compression", "off"])
    out = capsys.readouterr().out
    assert rc == 0 and "predicted iteration time" in out and "speedup" in out and "op-groups" in out
    assert "progress: " in out
    rc = main(["plan", "--model", "mlp", "--topology", "topologies/tag-testbed.yaml", "--budget", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--budget" in err and len(err.strip().splitlines()) == 1


def test_cli_plan_one_shot_flag(capsys):
    from tag.cli import main
    from tag.gnn import DEFAULT_CHECKPOINT
    if not DEFAULT_CHECKPOINT.exists():
        pytest.skip("no shipped predictor in this checkout")
    args = ["plan", "--model", "mlp", "--topology", "topologies/tag-testbed.yaml", "--budget", "8", "--groups", "4",
            "--compression", "off", "--json"]
    runs = []
    for extra in ([], ["--no-one-shot"]):
        assert main(args + extra) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["one_shot_time_s"] is not None and runs[1]["one_shot_time_s"] is None
    assert runs[0]["playouts"] == runs[1]["playouts"] == 8


def test_gnn_prior_with_the_shipped_predictor_is_deterministic(graph, topo):
    from tag.gnn import DEFAULT_CHECKPOINT
    if not DEFAULT_CHECKPOINT.exists():
        pytest.skip("no shipped predictor in this checkout")
    p1 = find_plan(graph, topo, PlannerConfig(prior="gnn", budget=16, seed=1))
    p2 = find_plan(graph, topo, PlannerConfig(prior="gnn", budget=16, seed=1))
    assert p1.to_dict()["groups"] == p2.to_dict()["groups"]
    assert p1.meta["prior"] == "gnn" and p1.meta["playouts"] == 16
    assert p1.predicted_iteration_time_s <= min(p1.meta["dp_even_time_s"], p1.meta["dp_prop_time_s"])


def test_gnn_prior_beyond_its_device_limit_searches_uniformly_and_says_so(graph, topo, monkeypatch):
    """Past GNN_MAX_DEVICES the predictor is not run (its device graph is complete: quadratic in
    the devices); the plan is the uniform prior's, and its meta says why."""
    import tag.planner as planner
    monkeypatch.setattr(planner, "GNN_MAX_DEVICES", topo.num_devices - 1)
    monkeypatch.setattr(planner, "_predictor", lambda checkpoint: pytest.fail("the predictor was loaded"))
    p = find_plan(graph, topo, PlannerConfig(prior="gnn", budget=6, seed=3, compression="off"))
    u = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=6, seed=3, compression="off"))
    assert p.meta["prior"] == "uniform" and str(topo.num_devices) in p.meta["prior_note"]
    assert p.to_dict()["groups"] == u.to_dict()["groups"] and u.meta["prior_note"] is None


def test_the_networks_one_shot_plan(graph, topo):
    from tag.gnn import DEFAULT_CHECKPOINT, Predictor
    from tag.search.evaluate import Feedback
    from tag.search.mcts import SearchState
    if not DEFAULT_CHECKPOINT.exists():
        pytest.skip("no shipped predictor in this checkout")
    pred = Predictor.load()
    sp = ActionSpace(graph, topo)
    ev = Evaluator(sp, None)
    none = np.full(sp.num_groups, -1)
    fb = ev.evaluate(sp.resolve(none)).feedback  # the root's own plan
    acts = pred.one_shot(sp, ev.t_ref, fb)
    # each group alone, as the decision at the root: the same most likely deployment
    ctx = pred.context(sp, ev.t_ref)
    for g in range(sp.num_groups):
        pri, _ = pred.predict(ctx, [SearchState(none, g, fb)])
        assert acts[g] == sp.group_canonical[g, int(np.argmax(sp.canonical_prior(g, pri[0])))]
    neutral = pred.one_shot(sp, ev.t_ref)
    assert neutral == pred.one_shot(sp, ev.t_ref, Feedback.neutral(sp.num_devices, sp.num_groups))
    # asked for the two largest stakes only: the rest follows the search's completion rule
    part = none.copy()
    part[sp.order[:2]] = [acts[g] for g in sp.order[:2]]
    assert pred.one_shot(sp, ev.t_ref, fb, max_groups=2) == sp.resolve(part)
    with_, without = (find_plan(graph, topo, PlannerConfig(prior="gnn", budget=8, seed=0, compression="off", one_shot=o))
                      for o in (True, False))
    assert with_.meta["playouts"] == without.meta["playouts"] == 8
    assert without.meta["one_shot_time_s"] is None
    one = ev.evaluate(acts)  # what find_plan() proposed after its tree
    assert with_.meta["one_shot_time_s"] == (None if one.oom else pytest.approx(one.time_s))
    if not one.oom:
        assert with_.predicted_iteration_time_s <= one.time_s


def test_symmetric_first_decisions_are_merged(graph):
    sym = _topo([("T4", 2)] * 4)
    sp = ActionSpace(graph, sym)
    assert sp.machine_classes == [0, 0, 0, 0]
    canon = set(sp.root_canonical.tolist())
    assert len(canon) < sp.num_actions
    p = sp.canonical_root_prior(np.full(sp.num_actions, 1.0 / sp.num_actions))
    assert p.sum() == pytest.approx(1.0) and set(np.nonzero(p)[0].tolist()) == canon
    ev = Evaluator(sp, ToySimulator(graph, sym, sp.costs))
    r = mcts_search(sp, ev, uniform_prior, np.random.default_rng(0), playouts=30)
    kids = set(np.nonzero(r.tree.children[0] >= 0)[0].tolist())
    assert kids <= canon
    # asymmetric clusters keep every action
    asym = ActionSpace(graph, _topo([("T4", 2), ("A100-40GB", 2)]))
    assert len(set(asym.root_canonical.tolist())) == asym.num_actions


def test_repeated_plans_are_walked_but_an_exhausted_space_ends(graph):
    one = _topo([("T4", 1)])  # a single device: every playout completes to the same plan
    sp = ActionSpace(graph, one)
    ev = Evaluator(sp, ToySimulator(graph, one, sp.costs))
    cfg = MCTSConfig(batch=4, repeat_limit=2.0)
    r = mcts_search(sp, ev, uniform_prior, np.random.default_rng(0), playouts=10, cfg=cfg)
    assert r.stats.playouts == 1 and ev.sim_calls - 2 == 1
    assert 2.0 * 10 < r.stats.repeats <= 2.0 * 10 + 10 + cfg.batch  # then repeats counted too
    with pytest.raises(ValueError, match="repeat_limit"):
        MCTSConfig(repeat_limit=-1)


@pytest.mark.parametrize("machines", [
    [("A100-40GB", 2), ("V100-SXM2-16GB", 2), ("T4", 4)],
    [("T4", 1), ("T4", 2), ("A100-40GB", 4), ("V100-SXM2-16GB", 2), ("T4", 2), ("A100-40GB", 1)],
])
def test_equivalence_classes_match_the_normalised_plans(graph, machines):
    """:attr:`ActionSpace.group_canonical` (keyed without materialising plans) has the classes of
    the strategy-normalised group plans as the simulator's caches key them."""
    sp = ActionSpace(graph, _topo(machines))
    ref = np.empty((sp.num_groups, sp.num_actions), dtype=np.int64)
    for g in range(sp.num_groups):
        first: dict = {}
        for a in range(sp.num_actions):
            ref[g, a] = first.setdefault(sp._deployment_key(g, a), a)
    assert np.array_equal(sp.group_canonical, ref)
    assert (sp.group_canonical != np.arange(sp.num_actions)).any()  # some actions merge


def test_equivalent_actions_are_one_action(graph, topo):
    """Actions that deploy a group identically (ps vs all-reduce without parameters, one-chunk
    model parallelism, ...) share a representative, simulate identically and are searched once."""
    from tag.sim import Simulator
    sp = ActionSpace(graph, topo)
    canon = sp.group_canonical
    free = np.flatnonzero(sp.costs.param_bytes == 0)
    assert len(free) > 0 and np.all(canon[np.arange(sp.num_groups)[:, None], canon] == canon)  # idempotent
    for g in free:  # no gradients: a parameter server is an all-reduce
        for a, act in enumerate(sp.actions):
            if act.sync == "ps":
                assert sp.actions[canon[g, a]].devices == act.devices and sp.actions[canon[g, a]].sync == "allreduce"
    weighted = int(np.argmax(sp.costs.param_bytes))
    assert {sp.actions[a].sync for a in set(canon[weighted].tolist())} == {"allreduce", "ps", "mp", "zero3"} | (
        {"tp"} if sp.tp_degrees else set())
    sim = Simulator(graph, topo, sp.cost_model)
    base = [sp.default_action] * sp.num_groups
    respelt = 0
    for g in range(sp.num_groups):
        for a in np.flatnonzero(canon[g] != np.arange(sp.num_actions)):
            x, y = list(base), list(base)
            x[g], y[g] = int(a), int(canon[g, a])
            rx, ry = sim.run(sp.group_plans(x)), sim.run(sp.group_plans(y))
            assert rx.iteration_time_s == ry.iteration_time_s and rx.peak_memory_bytes == ry.peak_memory_bytes
            # the plan find_plan writes: canonical spelling, same simulation
            px = sp.group_plans(x)
            nx = sp.normalised(px)
            respelt += [p.sync for p in px] != [p.sync for p in nx]
            assert not any(p.sync == "mp" and len(p.devices) == 1 for p in nx)
            assert not any(p.sync == "ps" and (len(p.devices) == 1 or sp.costs.param_bytes[i] == 0)
                           for i, p in enumerate(nx))
            rn = sim.run(nx)
            assert rn.iteration_time_s == rx.iteration_time_s and rn.peak_memory_bytes == rx.peak_memory_bytes
    assert respelt > 0  # some one-chunk mp or needless ps plans were respelt
    # plans are keyed by representatives: searchers see an equivalent plan as a repeat
    x = list(base)
    g = int(free[0])
    x[g] = next(a for a, act in enumerate(sp.actions) if act.sync == "ps")
    assert sp.resolve(np.array(x)) == sp.canonical(x) != tuple(x)
    # MCTS gives no prior to a non-representative action
    ev = Evaluator(sp, ToySimulator(graph, topo, sp.costs))
    r = mcts_search(sp, ev, uniform_prior, np.random.default_rng(0), playouts=30)
    tree = r.tree
    for n in range(1, tree.size):
        if tree.expanded[n] and tree.depth[n] < sp.num_groups:
            gd = sp.order[tree.depth[n]]
            assert np.all(tree.prior[n][canon[gd] != np.arange(sp.num_actions)] == 0)


# ---- tensor-parallel actions and plan-level (pipeline) decisions -------------------------------

@pytest.fixture(scope="module")
def pipe_space(graph, topo):
    return ActionSpace(graph, topo, pipelines=True)


def _plan_of_key(sp, key):
    from tag.plan import new_plan
    groups, pipe = sp.plan_of(key)
    p = new_plan(sp.graph, sp.topology, groups)
    p.pipeline = pipe
    return p


def _random_plans(sp, n: int, seed: int = 0):
    """(key, plan) of ``n`` random paths through ``sp`` (those naming a plan)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        key = sp.resolve_path(sp.random_path(rng, sp.max_depth))
        if sp.plan_of(key) is not None:
            yield key, _plan_of_key(sp, key)


def test_new_actions_leave_tags_actions_and_defaults_as_they_were(graph, topo, pipe_space):
    """``tp`` actions are appended after TAG's; the empty plan, "no pipeline" and every path of
    TAG's actions below it resolve as in TAG's space."""
    old = ActionSpace(graph, topo, tensor_parallel=False)
    sp = pipe_space
    base = old.num_base_actions  # (old's later actions: ZeRO-3's, pass 2, after sp's tp)
    assert sp.actions[:base] == old.actions[:base] and sp.num_base_actions == base
    assert sp.actions[-(old.num_actions - base):] == old.actions[base:]
    extra = [a for a in sp.actions[base:] if a.sync == "tp"]
    assert extra and {a.sync for a in sp.actions[base:]} == {"tp", "zero3"} and {a.tp for a in extra} <= set(sp.tp_degrees)
    assert old.plan_options == {} and sp.options("stages", 1)[0] == 1
    k = graph.num_groups
    assert sp.resolve_path([]) == sp.resolve_path([0]) == old.resolve_path([]) == (sp.default_action,) * k
    rng = np.random.default_rng(3)
    for _ in range(20):
        path = [int(a) for a in rng.integers(0, base, size=int(rng.integers(1, k + 1)))]
        assert sp.resolve_path([0] + path) == old.resolve_path(path)
        assert sp.decode([0] + path)[1] is None


def test_every_reachable_plan_is_valid(graph, topo, pipe_space):
    """Random paths through the whole space (plan-level decisions, then op-groups' actions
    including ``tp`` on parts of Megatron blocks) give plans ``validate_plan`` accepts, and reach
    pipelines, tensor-parallel stages, every schedule and both cuts."""
    sp = pipe_space
    seen = set()
    for key, plan in _random_plans(sp, 80):
        validate_plan(plan, graph, topo, pipelines=True, tensor_parallel=True)
        if plan.pipeline is None:
            seen.add("tp" if any(g.sync == "tp" for g in plan.groups) else "flat")
        else:
            seen |= {f"pp{len(plan.pipeline.stages)}", plan.pipeline.schedule, key.cut}
            seen |= {"pp-tp"} if plan.groups[0].sync == "tp" else set()
    assert {"flat", "tp", "pp-tp", "1f1b", "gpipe", "kfkb", "time", "memory"} <= seen
    assert {f"pp{p}" for p in sp.options("stages", 1)[1:]} <= seen


def test_a_tp_decision_carries_its_megatron_block(graph, topo, pipe_space):
    """A ``tp`` action on one op-group of a block split over several groups puts the whole
    block's groups on it; the plan stays valid."""
    sp = pipe_space
    comps = [c for c in sp._components]
    tp = next(a for a, act in enumerate(sp.actions) if act.sync == "tp")
    g = comps[0][1] if comps else 0
    acts = [sp.default_action] * graph.num_groups
    acts[g] = tp
    key = sp.canonical(acts)
    for comp in comps:
        if g in comp:
            assert all(sp.actions[key[x]].sync == "tp" for x in comp)
    validate_plan(_plan_of_key(sp, key), graph, topo, pipelines=True, tensor_parallel=True)


def test_searchers_reach_pipelines_and_tp_deterministically(graph, topo):
    """MCTS (uniform prior), random search, simulated annealing and TPE all propose pipelines and
    tensor-parallel plans on the real simulator, and the same seed gives the same search."""
    from tag.search.space import is_pipeline_key

    def run(search, seed, **kw):
        sp = ActionSpace(graph, topo, pipelines=True)
        ev = Evaluator(sp)
        search(sp, ev, np.random.default_rng(seed), playouts=24, **kw)
        return sp, ev

    for search, kw in ((mcts_search, {"prior_fn": uniform_prior}), (random_search, {}),
                       (simulated_annealing, {"plan_prob": 0.5}), (tpe_search, {})):
        if search is mcts_search:
            def search(sp, ev, rng, playouts, prior_fn):  # noqa: F811 (positional order of mcts_search)
                return mcts_search(sp, ev, prior_fn, rng, playouts=playouts)
        sp, ev = run(search, 0, **kw)
        keys = list(ev.cache)
        assert any(is_pipeline_key(k) for k in keys), search.__name__
        assert any(not is_pipeline_key(k) and any(sp.actions[a].sync == "tp" for a in k) for k in keys), \
            search.__name__
        sp2, ev2 = run(search, 0, **kw)
        assert list(ev2.cache) == keys and ev2.best_actions == ev.best_actions
        if ev.best_actions is not None:
            plan = _plan_of_key(sp, ev.best_actions)
            validate_plan(plan, graph, topo, pipelines=True, tensor_parallel=True)


def _deep_bytes(obj, seen: set) -> int:
    """``sys.getsizeof`` of ``obj`` and of everything it holds (numpy arrays: their buffers), each
    object once (``seen``)."""
    import sys

    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    n = sys.getsizeof(obj)
    if isinstance(obj, np.ndarray):
        return n if obj.base is None else n + _deep_bytes(obj.base, seen)
    if isinstance(obj, dict):
        return n + sum(_deep_bytes(k, seen) + _deep_bytes(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return n + sum(_deep_bytes(x, seen) for x in obj)
    if hasattr(obj, "__dict__"):
        n += _deep_bytes(vars(obj), seen)
    for name in getattr(type(obj), "__slots__", ()):
        n += _deep_bytes(getattr(obj, name, None), seen)
    return n


def test_simulator_cache_byte_limit_changes_no_result(graph, topo):
    """A simulator whose caches may hold a fifth of what a random search derives empties them
    several times and scores every plan exactly as one that never does (times, feedback arrays,
    bounds); its accounted bytes before each plan stay within the limit plus what one plan
    derives, and the accounting is within a factor 1.6 of the caches' measured bytes."""
    from tag.sim import Simulator
    from tag.sim.bounds import plan_bound

    def search(sim):
        sp = ActionSpace(graph, topo, pipelines=True)
        ev = Evaluator(sp, sim)
        held = []  # accounted bytes after each plan the search simulated
        ev.on_simulate = lambda e: held.append(sim.cached_bytes)
        random_search(sp, ev, np.random.default_rng(5), playouts=40)
        return sp, ev, held

    def measured(sim) -> int:
        seen = {id(sim.static), id(sim.tables)}
        return sum(_deep_bytes(getattr(sim, name), seen) for name in (
            "_layouts", "_caches", "_groups", "_pieces", "_templates", "_pairs", "_messages", "_buckets", "_kind_ids",
            "_kinds", "_sync_jobs"))

    big = Simulator(graph, topo)
    sp, ev_big, held_big = search(big)
    assert big.cache_clears == 0 and held_big == sorted(held_big) and big.cached_bytes > 0
    assert measured(big) / 1.6 < big.cached_bytes < measured(big) * 1.6, (big.cached_bytes, measured(big))

    limit = big.cached_bytes // 5
    small = Simulator(graph, topo, cache_bytes=limit)
    _, ev_small, held_small = search(small)
    assert small.cache_clears >= 3
    assert list(ev_small.cache) == list(ev_big.cache)
    for key, a in ev_big.cache.items():
        b = ev_small.cache[key]
        assert (a.time_s, a.oom, a.reward, a.groups) == (b.time_s, b.oom, b.reward, b.groups)
        for name in ("device_util", "device_mem", "device_comm", "group_finish"):
            assert getattr(a.feedback, name).tobytes() == getattr(b.feedback, name).tobytes()
    # what one plan derives at most: the most a fresh simulator holds after it (plus the
    # recomputation variants its evaluation simulated)
    one = 0
    for key in ev_big.cache:
        plan = sp.plan_of(key)
        if plan is not None:
            fresh = Simulator(graph, topo)
            fresh.run(plan[0], pipeline=plan[1])
            one = max(one, fresh.cached_bytes)
    assert ev_big.sim_calls - 2 == len(held_big)  # no recomputation ran: one simulation per plan
    assert max(held_small) <= limit + one and measured(small) < 1.6 * (limit + one)
    # the bounds (their own cache) and the run after them, once the caches were emptied again
    keys = [k for k in list(ev_big.cache)[:8] if sp.plan_of(k) is not None]
    for key in keys:
        groups, pipe = sp.plan_of(key)
        assert plan_bound(small, groups, pipe) == plan_bound(big, groups, pipe)
        assert small.run(groups, pipeline=pipe).iteration_time_s == big.run(groups, pipeline=pipe).iteration_time_s


def test_simulator_cache_bytes_is_validated(graph, topo):
    from tag.sim import Simulator
    from tag.sim.engine import CACHE_BYTES

    assert Simulator(graph, topo).cache_bytes == CACHE_BYTES
    for bad in (0, -5, 1.5, "1GB", True):
        with pytest.raises(ValueError, match=r"cache_bytes: expected a positive whole number of bytes, got"):
            Simulator(graph, topo, cache_bytes=bad)


def test_find_plan_reports_the_space_and_off_keeps_tags(graph, topo):
    off = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=6, pipelines="off", compression="off"))
    auto = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=6, compression="off"))
    assert off.meta["space"]["tp_actions"] == 0 and off.meta["space"]["stages"] is None
    assert auto.meta["space"]["tp_actions"] > 0 and auto.meta["space"]["stages"][0] == 1
    for p in (off, auto):
        validate_plan(p, graph, topo, pipelines=True, tensor_parallel=True)


# ---- the executable constraint (find_plan(executable=True), tag plan's default) ----------------

@pytest.fixture(scope="module")
def exec_space(graph, topo):
    return ActionSpace(graph, topo, pipelines=True, executable=True)


def test_executable_space_masks_what_the_executor_refuses(graph, topo, pipe_space, exec_space):
    """A ``tp`` first decision ends the path as the whole plan's one deployment; after any other
    first decision ``tp`` is masked; a pipeline's stages are data or tensor parallel; a tuple mixing
    ``tp`` with other actions is mapped onto an executable plan; on mixed GPUs every group of a
    whole-plan ``tp`` deployment gets the same shares (per group they differ: refused)."""
    from tag.parallel import execution_refusal
    from tag.search.space import is_pipeline_key

    sp, free = exec_space, pipe_space
    tp = next(a for a, act in enumerate(sp.actions) if act.sync == "tp" and act.devices == tuple(range(8)))
    dp = sp.default_action
    assert free.decision_at([0, tp]) == ("group", sp.order[1]) and sp.decision_at([0, tp]) is None
    assert sp.decision_at([0, dp]) == ("group", sp.order[1])
    assert sp.group_mask(np.full(sp.num_groups, -1)) is None
    decided = np.full(sp.num_groups, -1)
    decided[sp.order[0]] = dp
    mask = sp.group_mask(decided)
    assert not mask[tp] and mask[:sp.num_base_actions].all() and free.group_mask(decided) is None
    # tp stages at one degree run (each stage's tensor-parallel groups, device i sending to device i)
    assert max(free.options("stage_sync", 2)) > 1 and sp.options("stage_sync", 2) == free.options("stage_sync", 2)
    # the whole-plan tp deployment over all 8 devices (A100, V100 and T4 machines)
    whole = sp.resolve_path([0, tp])
    assert set(whole) == {tp} and execution_refusal(_plan_of_key(sp, whole)) is None
    assert execution_refusal(_plan_of_key(free, free.resolve_path([0, tp]))).startswith("groups[1].shares")
    # mixes: the first group in decision order decides
    mixed = [dp] * sp.num_groups
    mixed[sp.order[1]] = tp
    assert sp.canonical(mixed) == sp.canonical([dp] * sp.num_groups)  # tp over all -> allreduce over all
    mixed[sp.order[0]] = tp
    assert sp.canonical(mixed) == whole
    # every path's plan: accepted by the executor's predicate (and valid)
    kinds = set()
    for key, plan in _random_plans(sp, 60):
        validate_plan(plan, graph, topo, pipelines=True)  # the executor's check
        kinds.add("pp" if is_pipeline_key(key) else "tp" if plan.groups[0].sync == "tp" else "flat")
    assert kinds == {"pp", "tp", "flat"}
    # MCTS: no prior on tp below a first op-group decision, none on tp stages
    tree = mcts_search(sp, Evaluator(sp), uniform_prior, np.random.default_rng(1), playouts=30).tree
    below = [n for n in range(tree.size) if tree.expanded[n] and tree.depth[n] >= 2 and sp.stages_of(tree.path(n)) == 1]
    assert below and all(tree.prior[n][sp.is_tp].sum() == 0 for n in below)
    assert not any(sp.is_tp[tree.path(n)[1]] for n in below)


def test_executable_searches_propose_only_plans_the_executor_runs(graph, topo):
    """Every searcher on an executable space simulates only plans the executor runs, still
    reaching whole-plan tensor parallelism and pipelines; the evaluator scores a refused plan as
    not fitting without simulating it (the predicate has the last word)."""
    from tag.parallel import execution_refusal
    from tag.search.evaluate import OOM_REWARD
    from tag.search.space import is_pipeline_key

    def mcts(sp, ev, rng, playouts):
        return mcts_search(sp, ev, uniform_prior, rng, playouts=playouts)

    for search in (mcts, random_search, simulated_annealing, tpe_search):
        sp = ActionSpace(graph, topo, pipelines=True, executable=True)
        ev = Evaluator(sp)
        search(sp, ev, np.random.default_rng(0), playouts=24)
        plans = [(k, sp.plan_of(k)) for k in ev.cache]
        plans = [(k, _plan_of_key(sp, k)) for k, p in plans if p is not None]
        assert all(execution_refusal(p) is None for _, p in plans), search.__name__
        assert any(is_pipeline_key(k) for k, _ in plans), search.__name__
        assert any(p.groups[0].sync == "tp" for _, p in plans), search.__name__
    tp = next(a for a, act in enumerate(sp.actions) if act.sync == "tp")
    mixed = [sp.default_action] * sp.num_groups
    mixed[sp.order[1]] = tp  # not canonical: what no searcher proposes
    calls = ev.sim_calls
    assert execution_refusal(_plan_of_key(sp, tuple(mixed))) is not None
    assert ev.evaluate(tuple(mixed)).reward == OOM_REWARD and ev.sim_calls == calls


def test_find_plan_executable_by_default(graph, topo):
    p = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=6, compression="off"))
    assert p.meta["executable"] is True
    validate_plan(p, graph, topo, pipelines=True)  # what tag execute checks
    q = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=6, compression="off", executable=False))
    assert q.meta["executable"] is False
    # TAG's own actions all run: over them the constraint changes nothing, draws included
    for searcher in ("mcts", "random", "sa"):
        a, b = (find_plan(graph, topo, PlannerConfig(searcher=searcher, prior="uniform", budget=12, seed=2, compression="off", pipelines="off", executable=e)) for e in (True, False))
        assert [g.key() for g in a.groups] == [g.key() for g in b.groups] and a.meta["improvements"] == \
            b.meta["improvements"], searcher
