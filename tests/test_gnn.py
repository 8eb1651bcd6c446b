"""Tests for tag.gnn: joint encoding, normalisation, layers, network heads, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tag.gnn import (
    JointContext,
    JointConv,
    JointNormalize,
    NetConfig,
    Predictor,
    TagNet,
    load_net,
    save_checkpoint,
)
from tag.gnn.features import REL, SCHEMA, dims
from tag.gnn.model import action_log_probs, reward_to_value, value_to_reward
from tag.gnn.predictor import CheckpointError
from tag.parallel import DataParallel
from tag.search import ActionSpace, Evaluator, SearchState
from tag.search.evaluate import Feedback
from tag.search.toy import ToySimulator
from tag.topology import load_topology


def _topo(bw="10 Gbit/s", scale=1.0):
    return load_topology({
        "name": "g",
        "machines": [{"name": "a", "gpu": "A100-40GB", "count": 2, "intra_bandwidth": f"{300 * scale} GB/s"},
                     {"name": "b", "gpu": "T4", "count": 2, "intra_bandwidth": f"{16 * scale} GB/s"}],
        "network": {"bandwidth": bw},
    })


@pytest.fixture(scope="module")
def setup(captured):
    graph = captured("gpt2", batch=16, groups=6).graph
    topo = _topo()
    space = ActionSpace(graph, topo)
    ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
    return graph, topo, space, ev, JointContext(space, ev.t_ref)


def _states(space, ev, n=3):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        assign = np.full(space.num_groups, -1)
        for g in space.order[:i]:
            assign[g] = int(rng.integers(space.num_actions))
        _, o = ev.evaluate_partial(assign)
        out.append(SearchState(assign, space.order[i], o.feedback))
    return out


def test_encoding_shapes_follow_the_schema(setup):
    graph, topo, space, ev, ctx = setup
    d = ctx.encode(_states(space, ev, 1))
    k, n, a = graph.num_groups, topo.num_devices, space.num_actions
    assert d["group"].x.shape == (k, len(SCHEMA["group"]))
    assert d["device"].x.shape == (n, len(SCHEMA["device"]))
    assert d["action"].x.shape == (a, len(SCHEMA["action"]))
    assert d[REL["on"]].edge_index.shape == (2, k * n)
    assert d[REL["link"]].edge_index.shape == (2, n * (n - 1))
    assert d[REL["uses"]].edge_attr.shape[1] == dims()["uses"]
    assert int(d["group"].current.sum()) == 1


def test_batched_encoding_equals_single_encodings(setup):
    _, _, space, ev, ctx = setup
    sts = _states(space, ev, 3)
    both = JointNormalize()(ctx.encode(sts))
    for i, st in enumerate(sts):
        one = JointNormalize()(ctx.encode([st]))
        for nt in ("group", "device", "action"):
            sel = both[nt].batch == i
            assert torch.allclose(both[nt].x[sel], one[nt].x, atol=1e-6)


def test_normalisation_is_finite_and_scale_free(setup, captured):
    graph, _, _, _, _ = setup
    feats = []
    for scale in (1.0, 10.0):
        topo = _topo(bw=f"{10 * scale} Gbit/s", scale=scale)
        sp = ActionSpace(graph, topo)
        ev = Evaluator(sp, ToySimulator(graph, topo, sp.costs))
        ctx = JointContext(sp, ev.t_ref)
        d = JointNormalize()(ctx.encode([SearchState(np.full(sp.num_groups, -1), sp.order[0],
                                                      Feedback.neutral(sp.num_devices, sp.num_groups))]))
        for store in d.node_stores + d.edge_stores:
            for key in ("x", "edge_attr"):
                if key in store:
                    assert torch.isfinite(store[key]).all()
        feats.append(d)
    # link features: bandwidth enters relative to the model's size and the reference time
    assert not torch.allclose(feats[0][REL["link"]].edge_attr, feats[1][REL["link"]].edge_attr)
    again = JointNormalize()(feats[0])  # idempotent
    assert torch.equal(again["group"].x, feats[0]["group"].x)


def test_layer_and_network_shapes(setup):
    _, _, space, ev, ctx = setup
    torch.manual_seed(0)
    net = TagNet(NetConfig(hidden=16, layers=2, heads=2)).eval()
    data = JointNormalize()(ctx.encode(_states(space, ev, 3)))
    logits, value = net(data)
    assert logits.shape == (3 * space.num_actions,) and value.shape == (3,)
    p = action_log_probs(logits, data["action"].batch).exp().view(3, -1)
    assert torch.allclose(p.sum(1), torch.ones(3), atol=1e-5)
    conv = net.convs[0]
    assert isinstance(conv, JointConv) and "JointConv" in repr(conv)
    conv.reset_parameters()


def test_value_transform_roundtrip():
    assert reward_to_value(-1.0) == pytest.approx(5.0)
    for r in (-0.5, 0.0, 1.0, 9.0):
        assert float(value_to_reward(torch.tensor(reward_to_value(r)))) == pytest.approx(r, rel=1e-5)


def test_net_config_validation():
    with pytest.raises(ValueError, match="heads"):
        NetConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="layers"):
        NetConfig(layers=0)


def test_checkpoint_roundtrip_and_errors(setup, tmp_path):
    _, _, space, ev, _ = setup
    torch.manual_seed(1)
    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    path = tmp_path / "p.pt"
    save_checkpoint(path, net, {"note": "test"})
    net2, meta = load_net(path)
    assert meta == {"note": "test"}
    pred = Predictor(net2)
    prior_fn = pred.bind(space, ev.t_ref)
    pri, val = prior_fn(space, _states(space, ev, 2))
    assert pri.shape == (2, space.num_actions) and np.allclose(pri.sum(1), 1) and np.isfinite(val).all()
    with pytest.raises(CheckpointError, match="not found"):
        load_net(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as e:
        load_net(bad)
    assert "\n" not in str(e.value)


def test_shipped_checkpoint_loads():
    from tag.gnn import DEFAULT_CHECKPOINT
    if not DEFAULT_CHECKPOINT.exists():
        pytest.skip("no shipped predictor in this checkout")
    assert DEFAULT_CHECKPOINT.stat().st_size < 5 * 2**20
    net, meta = load_net()
    assert isinstance(net, TagNet)


def test_an_older_checkpoint_loads_and_scores_tp_actions(setup, tmp_path):
    """A checkpoint trained before the tensor-parallel feature columns (ADDED_COLUMNS fewer input
    columns) loads with zero weights on them and computes what it did; the encoding marks the
    ``tp`` actions and the groups deployed by one."""
    from tag.gnn.features import ADDED_COLUMNS
    from tag.io import save_tensors
    _, _, space, ev, ctx = setup
    assert space.tp_degrees
    torch.manual_seed(2)
    net = TagNet(NetConfig(hidden=16, layers=1, heads=2))
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    for nt, extra in ADDED_COLUMNS.items():
        state[f"node_in.{nt}.weight"] = state[f"node_in.{nt}.weight"][:, :-extra]
        with torch.no_grad():
            net.node_in[nt].weight[:, -extra:] = 0.0
    path = tmp_path / "old.pt"
    save_tensors(path, {"format": "tag-predictor", "version": 1, "config": net.cfg.to_dict(), "state_dict": state,
                        "meta": {}})
    old, _ = load_net(path)
    states = _states(space, ev, 2)
    tp = [a for a, act in enumerate(space.actions) if act.sync == "tp"]
    assign = np.full(space.num_groups, -1)
    assign[space.order[0]] = tp[0]
    states.append(SearchState(assign, space.order[1], states[0].feedback))
    for x, y in zip(_logits_values(old, ctx, states), _logits_values(net, ctx, states)):
        assert torch.equal(x, y)
    d = ctx.encode(states[-1:])
    col = {n: i for i, (n, _) in enumerate(SCHEMA["action"])}
    ax = d["action"].x.numpy()
    assert set(np.flatnonzero(ax[:, col["sync_tp"]])) == set(tp) and (ax[tp, col["tp_frac"]] > 0).all()
    assert ax[tp][:, [col["sync_allreduce"], col["sync_ps"], col["sync_mp"]]].sum() == 0
    gcol = {n: i for i, (n, _) in enumerate(SCHEMA["group"])}
    assert d["group"].x[space.order[0], gcol["sync_tp"]] == 1.0


def _cluster(machines):
    """A topology of ``(gpu, count, intra GB/s)`` machines on 25 Gbit/s."""
    return load_topology({"name": "c", "network": {"bandwidth": "25 Gbit/s"}, "machines": [
        {"name": f"m{i}", "gpu": gpu, "count": n, **({"intra_bandwidth": f"{bw} GB/s"} if n > 1 else {})}
        for i, (gpu, n, bw) in enumerate(machines)]})


def _logits_values(net, ctx, states):
    with torch.no_grad():
        return net(JointNormalize()(ctx.encode(states)))


def test_exact_coarse_device_graph_gives_the_full_graphs_outputs(setup):
    """Three identical 4-GPU machines and two 2-GPU ones: devices no action tells apart share a
    node, and the network (weights of any value) sees the same thing as on the full graph."""
    from tag.gnn.features import device_classes
    graph = setup[0]
    topo = _cluster([("V100-SXM2-16GB", 4, 150)] * 3 + [("T4", 2, 10)] * 2)
    space = ActionSpace(graph, topo)
    ev = Evaluator(space, ToySimulator(graph, topo, space.costs))
    cls = device_classes(space, "exact")
    assert cls.max() + 1 < topo.num_devices  # something merged
    for x in range(topo.num_devices):  # a class never spans machines
        assert len({topo.machine_of(y) for y in np.nonzero(cls == cls[x])[0]}) == 1
    torch.manual_seed(0)
    net = TagNet(NetConfig(hidden=16, layers=2, heads=2)).eval()
    full, coarse = JointContext(space, ev.t_ref), JointContext(space, ev.t_ref, coarse="exact")
    assert coarse.d == cls.max() + 1 and full.d == topo.num_devices
    states = _states(space, ev, 4)
    states += [SearchState(s.assign, s.group, Feedback.neutral(space.num_devices, space.num_groups)) for s in states]
    (lf, vf), (lc, vc) = _logits_values(net, full, states), _logits_values(net, coarse, states)
    assert torch.allclose(lf, lc, atol=1e-5) and torch.allclose(vf, vc, atol=1e-5)
    assert lf.std() > 1e-3  # not a degenerate comparison


def test_machine_coarse_device_graph(setup):
    """One node per machine: identical to the full graph when every machine has one GPU; on
    multi-GPU machines as many device nodes as machines, and the predictor switches to it above
    its device limit."""
    graph = setup[0]
    torch.manual_seed(1)
    net = TagNet(NetConfig(hidden=16, layers=2, heads=2)).eval()
    single = _cluster([("A100-40GB", 1, 0), ("A100-40GB", 1, 0), ("T4", 1, 0)])
    space = ActionSpace(graph, single)
    ev = Evaluator(space, ToySimulator(graph, single, space.costs))
    states = _states(space, ev, 3)
    (lf, vf) = _logits_values(net, JointContext(space, ev.t_ref), states)
    (lm, vm) = _logits_values(net, JointContext(space, ev.t_ref, coarse="machine"), states)
    assert torch.allclose(lf, lm, atol=1e-5) and torch.allclose(vf, vm, atol=1e-5)
    multi = _cluster([("V100-SXM2-16GB", 4, 150)] * 2 + [("T4", 2, 10)])
    space = ActionSpace(graph, multi)
    ev = Evaluator(space, ToySimulator(graph, multi, space.costs))
    pred = Predictor(net, coarse_above=multi.num_devices - 1)
    ctx = pred.context(space, ev.t_ref)
    assert ctx.coarse == "machine" and ctx.d == multi.num_machines
    data = ctx.encode(_states(space, ev, 2))
    assert data["device"].x.shape[0] == 2 * multi.num_machines
    assert float(data["device"].mult.sum()) == 2 * multi.num_devices
    pri, val = pred.predict(ctx, _states(space, ev, 2))
    assert pri.shape == (2, space.num_actions) and np.allclose(pri.sum(1), 1) and np.isfinite(val).all()
    assert Predictor(net).context(space, ev.t_ref).coarse is None  # 10 devices: one node each
    with pytest.raises(ValueError, match="coarse"):
        JointContext(space, ev.t_ref, coarse="rack")


def test_unit_multiplicities_collate_with_coarse_states_and_change_nothing(setup, tmp_path):
    """A per-device state given explicit multiplicities of one (as the training data holds it,
    to collate with machine-graph states) gives the network's outputs without them, and batches
    with a coarse state; a checkpoint's ``meta["coarse_above"]`` is the encoding its predictor uses."""
    from torch_geometric.data import Batch

    from tag.gnn.features import with_unit_mult
    graph, _, space, ev, ctx = setup
    torch.manual_seed(2)
    net = TagNet(NetConfig(hidden=16, layers=2, heads=2)).eval()
    states = _states(space, ev, 3)
    plain = ctx.encode(states)
    unit = with_unit_mult(ctx.encode(states))
    assert "mult" in unit["device"] and "mult" not in plain["device"]
    (lp, vp), (lu, vu) = _logits_values(net, ctx, states), net(JointNormalize()(unit))
    assert torch.allclose(lp, lu, atol=1e-6) and torch.allclose(vp, vu, atol=1e-6) and lp.std() > 1e-3
    multi = _cluster([("V100-SXM2-16GB", 4, 150), ("T4", 2, 10)])
    mspace = ActionSpace(graph, multi)
    mev = Evaluator(mspace, ToySimulator(graph, multi, mspace.costs))
    coarse = JointContext(mspace, mev.t_ref, coarse="machine").encode(_states(mspace, mev, 1))
    for d in (coarse, unit):
        for nt in ("group", "device", "action"):
            del d[nt].batch
    both = Batch.from_data_list([unit, coarse])
    assert both["device"].mult.numel() == unit["device"].num_nodes + multi.num_machines
    save_checkpoint(tmp_path / "c.pt", net, {"coarse_above": 4})
    assert Predictor.load(tmp_path / "c.pt").coarse_above == 4
    save_checkpoint(tmp_path / "old.pt", net, {})
    from tag.gnn.features import COARSE_ABOVE
    assert Predictor.load(tmp_path / "old.pt").coarse_above == COARSE_ABOVE
    save_checkpoint(tmp_path / "bad.pt", net, {"coarse_above": 0})
    with pytest.raises(CheckpointError, match="coarse_above"):
        Predictor.load(tmp_path / "bad.pt")


def test_sync_flags_follow_each_strategys_declaration(setup):
    """The sync one-hot comes from the registry (``Strategy.feature_sync``): the built-in
    strategies keep their columns; a strategy registered later sets none unless its class names
    one (never, as before 2026-11-27, the ``tp`` column by default)."""
    from tag.gnn.features import ACTION_SYNC_COLUMNS, GROUP_SYNC_COLUMNS, SYNC_FLAGS, sync_flags
    from tag.parallel import DataParallel, register, unregister

    graph, topo, space, ev, _ = setup
    col = {n: i for i, (n, _) in enumerate(SCHEMA["action"])}
    gcol = {n: i for i, (n, _) in enumerate(SCHEMA["group"])}
    assert [col[f"sync_{f}"] for f in SYNC_FLAGS] == ACTION_SYNC_COLUMNS.tolist()
    assert [gcol[f"sync_{f}"] - gcol["decided"] for f in SYNC_FLAGS] == GROUP_SYNC_COLUMNS.tolist()
    assert {space.actions[a].sync: SYNC_FLAGS[f] for a, f in enumerate(sync_flags(space))} == \
        {**{s: s for s in SYNC_FLAGS}, "zero3": "allreduce"}  # (ZeRO-3 is read as data parallel)

    class Replicas(DataParallel):
        name = "replicas"

    register(Replicas())
    try:
        for flag in (None, "allreduce"):
            Replicas.feature_sync = flag
            sp = ActionSpace(graph, topo)
            mine = [a for a, act in enumerate(sp.actions) if act.sync == "replicas"]
            assert mine and mine[0] >= space.num_actions  # after every built-in action
            assign = np.full(sp.num_groups, -1)
            assign[sp.order[0]] = mine[0]
            st = SearchState(assign, sp.order[1], Feedback.neutral(sp.num_devices, sp.num_groups))
            d = JointContext(sp, ev.t_ref).encode([st])
            flags = [f"sync_{f}" for f in SYNC_FLAGS]
            ax = d["action"].x.numpy()[mine][:, [col[f] for f in flags]]
            gx = d["group"].x.numpy()[sp.order[0], [gcol[f] for f in flags]]
            want = np.array([float(f == flag) for f in SYNC_FLAGS])
            assert (ax == want).all() and (gx == want).all()
        Replicas.feature_sync = "pp"
        with pytest.raises(ValueError, match="strategy 'replicas': feature_sync: expected one of"):
            JointContext(ActionSpace(graph, topo), ev.t_ref)
    finally:
        unregister("replicas")


def _reference_tables(space, cls):
    """``(place, server, action_feats)`` of :class:`JointContext` as written before 2026-11-27: every
    group's plan built (``ActionSpace.group_plan``), its shares added with ``np.add.at`` and its
    ``search_estimate`` asked, one (group, action) at a time."""
    import math

    from tag.parallel import get_strategy
    k, a, d = space.num_groups, space.num_actions, int(cls.max()) + 1
    bw, lat = space.comm.bandwidth, space.comm.latency
    cap = np.array([dv.gpu.memory_bytes for dv in space.topology.devices], dtype=np.float64)
    place, server, feats = np.zeros((k, a, d)), np.full((k, a), -1, np.int64), np.zeros((k, a, 3))
    for ai, act in enumerate(space.actions):
        devs, s = list(act.devices), get_strategy(act.sync)
        if len(devs) > 1:
            bmin = float(bw[np.ix_(devs, devs)][~np.eye(len(devs), dtype=bool)].min())
            lmax = float(lat[np.ix_(devs, devs)].max())
        else:
            bmin, lmax = math.inf, 0.0
        for g in range(k):
            gp = space.group_plan(g, ai)
            shares = np.full(len(gp.devices), 1.0 / len(gp.devices)) if s.chunked else gp.shares
            np.add.at(place[g, ai], cls[gp.devices], shares)
            if gp.server is not None:
                server[g, ai] = cls[gp.server]
            comp, sync, need = s.search_estimate(space, g, act.devices, act.tp, gp, bmin, lmax)
            feats[g, ai] = (comp, sync, need / float(cap[devs].min()))
    return place, server, feats


class _EvenShares(DataParallel):
    """Data parallel with even shares, written as a user would: its own ``search_plan``, so its
    actions' tables come from :meth:`tag.parallel.Strategy.search_table`'s loop over its plans."""

    name = "even-test"

    def search_plan(self, space, g, devices, option):
        from tag.plan import GroupPlan
        return GroupPlan(list(devices), [1.0 / len(devices)] * len(devices), self.name)


@pytest.mark.parametrize("coarse", [None, "exact", "machine"])
@pytest.mark.parametrize("executable", [False, True])
def test_context_tables_equal_the_per_group_plans_bit_for_bit(setup, coarse, executable):
    """The placement, server and action-estimate tables, computed one action at a time for every
    group (:meth:`tag.parallel.Strategy.search_table`), are the per-(group, action) plans' numbers
    exactly: on mixed GPUs (speed-proportional shares of 2-8 devices, parameter servers, mp chunks
    on each group's fastest devices, tp at degrees 2 and 4), and for a registered strategy that
    builds its own plans."""
    from tag.gnn.features import device_classes
    from tag.parallel import register, unregister
    graph = setup[0]
    topo = _cluster([("V100-SXM2-16GB", 4, 150), ("A100-40GB", 4, 300), ("T4", 2, 10), ("T4", 2, 10)])
    register(_EvenShares())
    try:
        space = ActionSpace(graph, topo, executable=executable)
        assert {"allreduce", "ps", "mp", "tp", "even-test"} <= {act.sync for act in space.actions}
        ctx = JointContext(space, 1.0, coarse=coarse)
        place, server, feats = _reference_tables(space, device_classes(space, coarse) if coarse
                                                 else np.arange(topo.num_devices))
    finally:
        unregister(_EvenShares.name)
    assert np.array_equal(ctx.place, place) and np.array_equal(ctx.server, server)
    assert np.array_equal(ctx.action_feats, feats)
    assert (server >= 0).any() and len(np.unique(place)) > 10  # parameter servers, uneven shares
