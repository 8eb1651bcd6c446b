"""The one communication model (:mod:`tag.cost.comm`): every formula against a hand computation,
and every reader (simulator, SFB selection, GNN features, search heuristics) on its numbers."""

from __future__ import annotations

import numpy as np
import pytest

from tag.cost.comm import (
    CommModel,
    CommProfile,
    LinkFit,
    ring_allgather_time,
    ring_allreduce_time,
    ring_reducescatter_time,
    uniform_ps_time,
)
from tag.cost.model import CostModel, device_type
from tag.topology import load_topology

S = 8e6  # bytes
GB = 1e9


@pytest.fixture(scope="module")
def mixed():
    """Machine a: 3 devices (20 GB/s, 2 us); machine b: 2 devices (50 GB/s, 1 us); machine c: 1
    device; network 1 GB/s, 30 us; the a-c link 0.5 GB/s, 40 us."""
    return load_topology({
        "name": "mixed3",
        "machines": [{"name": "a", "gpu": "V100-SXM2-16GB", "count": 3, "intra_bandwidth": "20 GB/s",
                      "intra_latency": "2 us"},
                     {"name": "b", "gpu": "V100-SXM2-16GB", "count": 2, "intra_bandwidth": "50 GB/s",
                      "intra_latency": "1 us"},
                     {"name": "c", "gpu": "A100-40GB", "count": 1}],
        "network": {"bandwidth": "1 GB/s", "latency": "30 us",
                    "links": [{"between": ["a", "c"], "bandwidth": "0.5 GB/s", "latency": "40 us"}]},
    })


def test_p2p_and_allreduce_by_hand(mixed):
    cm = CommModel.nominal(mixed)
    assert cm is CommModel.nominal(mixed)  # one shared model per topology
    assert cm.p2p_time(0, 3, S) == pytest.approx(30e-6 + S / GB, rel=1e-15)
    assert cm.p2p_time(1, 1, S) == 0.0
    # one machine: ring over its 3 devices
    ring_a = 2 * 2 / 3 * S / (20 * GB) + 2 * 2 * 2e-6
    assert cm.allreduce_time([2, 0, 1], S) == pytest.approx(ring_a, rel=1e-15)
    for alg in ("flat", "hierarchical", "best"):
        assert cm.allreduce_time([0, 1, 2], S, alg) == pytest.approx(ring_a, rel=1e-15)
    assert cm.allreduce_time([0], S) == 0.0 and cm.allreduce_time([0, 1], 0.0) == 0.0
    # machines a (3 devices) + b (2): reduce-scatter / all-gather inside, ring of 2 across
    devs = [0, 1, 2, 3, 4]
    intra = max(2 / 3 * S / (20 * GB) + 2 * 2e-6, 1 / 2 * S / (50 * GB) + 1e-6)
    hier = 2 * intra + 2 * 1 / 2 * S / GB + 2 * 1 * 30e-6
    flat = 2 * 4 / 5 * S / GB + 2 * 4 * 30e-6  # ring 0-1-2-3-4-0, the slowest hop the network
    assert cm.allreduce_time(devs, S) == pytest.approx(hier, rel=1e-15)
    assert cm.allreduce_time(devs, S, "flat") == pytest.approx(flat, rel=1e-15)
    assert cm.allreduce_time(devs, S, "best") == pytest.approx(min(flat, hier), rel=1e-15)
    # a + c: the slow a-c link carries the cross-machine ring
    hier_ac = 2 * (2 / 3 * S / (20 * GB) + 2 * 2e-6) + 2 * 1 / 2 * S / (0.5 * GB) + 2 * 40e-6
    assert cm.allreduce_time([0, 1, 2, 5], S) == pytest.approx(hier_ac, rel=1e-15)
    with pytest.raises(ValueError, match="algorithm"):
        cm.allreduce_time(devs, S, "tree")


def test_reduce_broadcast_ps_by_hand(mixed):
    cm = CommModel.nominal(mixed)
    devs, server = [0, 1, 3], 1  # workers 0 (same machine) and 3 (across the network)
    one_way = 30e-6 + S / (20 * GB) + S / GB  # largest latency + the flows in turn
    assert cm.reduce_time(devs, server, S) == pytest.approx(one_way, rel=1e-15)
    assert cm.broadcast_time(devs, server, S) == pytest.approx(one_way, rel=1e-15)
    assert cm.ps_time(devs, server, S) == pytest.approx(2 * one_way, rel=1e-15)
    assert cm.ps_time([1], 1, S) == 0.0 and cm.ps_time(devs, server, 0.0) == 0.0
    # on equal links: the uniform form; the ring all-reduce likewise
    assert cm.ps_time([0, 1, 2], 2, S) == pytest.approx(uniform_ps_time(2, S, 20 * GB, 2e-6), rel=1e-15)
    assert uniform_ps_time(2, S, 20 * GB, 2e-6) == pytest.approx(2 * (2e-6 + 2 * S / (20 * GB)), rel=1e-15)
    assert cm.allreduce_time([3, 4], S) == pytest.approx(ring_allreduce_time(2, S, 50 * GB, 1e-6), rel=1e-15)


def test_allgather_by_hand(mixed):
    cm = CommModel.nominal(mixed)
    chunks, devs = [1e6, 2e6, 3e6, 4e6], [0, 1, 3, 4]  # a: 0, 1; b: 3, 4
    total = sum(chunks)
    # flat ring 0-1-3-4-0: the link into a device carries every chunk but its own
    flat = max((total - 2e6) / (20 * GB), (total - 3e6) / GB, (total - 4e6) / (50 * GB), (total - 1e6) / GB) \
        + 3 * 30e-6
    # hierarchical: machines a (3 MB) and b (7 MB) exchange over the network, then inside each
    inter = max((total - 7e6) / GB, (total - 3e6) / GB) + 30e-6
    intra = max(max((total - 2e6) / (20 * GB), (total - 1e6) / (20 * GB)) + 2e-6,
                max((total - 4e6) / (50 * GB), (total - 3e6) / (50 * GB)) + 1e-6)
    assert cm.allgather_time(chunks, devs, "flat") == pytest.approx(flat, rel=1e-15)
    assert cm.allgather_time(chunks, devs, "hierarchical") == pytest.approx(inter + intra, rel=1e-15)
    assert cm.allgather_time(chunks, devs) == pytest.approx(min(flat, inter + intra), rel=1e-15)
    assert cm.allgather_time([5.0], [2]) == 0.0


def _loop_allgathers(cm, chunks, devices) -> tuple[float, float]:
    """(flat, hierarchical) all-gather by the module docstring's formulas, walked link by link."""
    bw, lat, mo = cm.bandwidth, cm.latency, cm.machine_of
    own, ring = dict(zip(devices, chunks)), sorted(devices)
    total = float(sum(chunks))
    links = list(zip(ring, ring[1:] + ring[:1]))
    flat = max((total - own[b]) / bw[a, b] for a, b in links) + (len(ring) - 1) * max(lat[a, b] for a, b in links)
    per: dict[int, list[int]] = {}
    for d in ring:
        per.setdefault(mo[d], []).append(d)
    ms = sorted(per)
    if len(ms) < 2:
        return flat, flat
    mchunk = {m: sum(own[d] for d in per[m]) for m in ms}
    mlinks = list(zip(ms, ms[1:] + ms[:1]))
    inter = max((total - mchunk[b]) / bw[per[a][0], per[b][0]] for a, b in mlinks) \
        + (len(ms) - 1) * max(lat[per[a][0], per[b][0]] for a, b in mlinks)
    intra = 0.0
    for ds in per.values():
        if len(ds) > 1:
            r = list(zip(ds, ds[1:] + ds[:1]))
            intra = max(intra, max((total - own[b]) / bw[a, b] for a, b in r) + (len(ds) - 1) * max(lat[a, b] for a, b in r))
    return flat, inter + intra


def test_allgather_equals_the_link_by_link_formulas_on_a_large_cluster():
    """The vectorised all-gathers (link arrays cached per device set) give the link-by-link
    formulas' seconds exactly, on random replica sets of the 64-GPU, 10-machine topology."""
    cm = CommModel.nominal(load_topology("hetero-64gpu"))
    rng = np.random.default_rng(0)
    for _ in range(40):
        devs = [int(d) for d in rng.permutation(64)[:int(rng.integers(2, 65))]]
        chunks = [float(x) for x in rng.integers(1, 10**7, size=len(devs))]
        flat, hier = _loop_allgathers(cm, chunks, devs)
        for _ in range(2):  # the second time from the cache
            assert cm.allgather_time(chunks, devs, "flat") == flat
            assert cm.allgather_time(chunks, devs, "hierarchical") == hier


def test_machine_links(mixed):
    cm = CommModel.nominal(mixed)
    assert cm.machine_bandwidth(0, 2) == 0.5 * GB and cm.machine_latency(2, 0) == 40e-6
    assert cm.machine_bandwidth(1, 1) == 50 * GB and cm.machine_latency(0, 0) == 2e-6
    assert cm.machine_bandwidth(2, 2) == mixed.machine_bandwidth(2, 2)  # one device: the topology's


def _cpu_fitted(tmp_path, machines=1, count=3):
    topo = load_topology({"name": f"cpu{machines}x{count}",
                          "machines": [{"name": f"m{k}", "gpu": "cpu", "count": count, "intra_bandwidth": "5 GB/s"}
                                       for k in range(machines)],
                          "network": {"bandwidth": "1 GB/s", "latency": "50 us"}})
    fits = {"p2p": LinkFit(1e-4, 1e9), "all_reduce": LinkFit(3e-4, 5e8), "all_gather": LinkFit(2e-4, 4e8),
            "reduce": LinkFit(4e-4, 8e8), "broadcast": LinkFit(2e-4, 2e9), "ps": LinkFit(9e-4, 4e8)}
    CommProfile(device_type(topo, 0), "gloo", 2, fits).save(tmp_path)
    return topo, fits


def test_measured_fits_by_hand(tmp_path):
    topo, f = _cpu_fitted(tmp_path, machines=2)
    cm = CommModel.for_topology(topo, tmp_path)
    assert cm.p2p_time(0, 1, S) == pytest.approx(1e-4 + S / 1e9, rel=1e-15)  # fitted link
    assert cm.p2p_time(0, 3, S) == pytest.approx(50e-6 + S / 1e9, rel=1e-15)  # the network
    assert cm.machine_bandwidth(0, 0) == 1e9 and cm.machine_latency(1, 1) == 1e-4
    assert cm.allreduce_time([0, 1, 2], S) == pytest.approx(2 * 2 / 3 * S / 5e8 + 2 * 3e-4, rel=1e-15)
    assert cm.allgather_time([1e6, 2e6, 3e6], [0, 1, 2]) == pytest.approx(5e6 / 4e8 + 2 * 2e-4, rel=1e-15)
    assert cm.reduce_time([0, 1, 2], 0, S) == pytest.approx(4e-4 + 2 * S / 8e8, rel=1e-15)
    assert cm.broadcast_time([0, 1, 2], 0, S) == pytest.approx(2e-4 + 2 * S / 2e9, rel=1e-15)
    assert cm.ps_time([0, 1, 2], 0, S) == pytest.approx(9e-4 + 2 * S / 4e8, rel=1e-15)
    # across machines the fits do not apply: the links (fitted inside each machine)
    intra = 2 / 3 * S / 1e9 + 2 * 1e-4
    want = 2 * intra + 2 * 1 / 2 * S / 1e9 + 2 * 50e-6
    assert cm.allreduce_time(range(6), S) == pytest.approx(want, rel=1e-15)
    assert cm.ps_time([0, 3], 0, S) == pytest.approx(2 * (50e-6 + S / 1e9), rel=1e-15)
    # what the cost model holds
    from tests.test_sim_tools import chain_graph

    held = CostModel.for_topology(chain_graph(2), topo, tmp_path).comm
    assert np.array_equal(held.bandwidth, cm.bandwidth) and held.ps_fit == f["ps"]



def test_ring_key_decides_the_flat_allreduce(mixed, tmp_path):
    """Device sets with equal ``ring_key`` take equal flat all-reduce (tensor-parallel) seconds,
    bit for bit, on measured fits and on plain links; the key tells apart what changes them."""
    import itertools

    fitted = CommModel.for_topology(_cpu_fitted(tmp_path, machines=2)[0], tmp_path)
    for cm in (CommModel.nominal(mixed), fitted):
        n = cm.topology.num_devices
        sets = [list(c) for k in (1, 2, 3) for c in itertools.combinations(range(n), k)]
        by_key: dict = {}
        for devs in sets:
            got = [cm.tensor_parallel_time(devs, [b]) for b in (0.0, 1.0, S, 3.7e9)]
            assert by_key.setdefault(cm.ring_key(devs), got) == got
            assert cm.ring_key(devs[::-1]) == cm.ring_key(devs)  # a set: its order does not matter
        assert len(by_key) > 3  # one machine's rings, the network's, the slow a-c link's
    assert fitted.ring_key([0, 1]) == (2, "fit") and fitted.ring_key([0, 3]) != (2, "fit")


# ------------------------------------------------------------------------ the readers agree
@pytest.fixture
def fitted_setup(tmp_path, monkeypatch, captured):
    """An MLP on 2 CPU machines x 3 devices with measured fits, found through the default profile
    directory (as the planner finds them)."""
    topo, _ = _cpu_fitted(tmp_path, machines=2)
    monkeypatch.setenv("TAG_PROFILE_DIR", str(tmp_path))
    graph = captured("mlp:hidden=256,layers=3,in_dim=64,classes=10", batch=12, groups=4).graph
    return graph, topo, CostModel.for_topology(graph, topo)


def test_sfb_selection_prices_what_the_simulator_charges(fitted_setup):
    from tag.compress import plan_sfb
    from tag.parallel import sfb_syncs
    from tag.plan import GroupPlan, new_plan
    from tag.sim import Simulator

    graph, topo, cm = fitted_setup
    comm = cm.comm
    assert not np.array_equal(comm.bandwidth, topo.bandwidth_matrix)  # the fits matter here
    sim = Simulator(graph, topo, cm)
    for devs, sync, server in (([0, 1, 2], "allreduce", None), ([0, 1, 3, 4], "allreduce", None),
                               ([0, 1, 2], "ps", 1), ([0, 4], "ps", 0)):
        n = len(devs)
        plan = new_plan(graph, topo, [GroupPlan(devs, [1 / n] * n, sync, server) for _ in range(graph.num_groups)])
        sels = plan_sfb(graph, topo, plan, syncs=sfb_syncs())
        assert sels
        for s in sels:
            for d in s.decisions:
                want = comm.ps_time(devs, server, d.candidate.grad_bytes) if sync == "ps" else \
                    comm.allreduce_time(devs, d.candidate.grad_bytes)
                assert d.sync_s == want
            gp = plan.groups[s.group]
            gp.sfb = [d.candidate.op_name for d in s.decisions]
            sfb = sim.group_data(s.group, gp).sfb  # the simulator's all-gathers of those factors
            lb = list(s.local_batches)
            assert list(sfb.gather_times) == [comm.allgather_time([b * f.bytes_per_sample for b in lb], devs)
                                              for f in _factors(s)]
        gd = sim.group_data(0, plan.groups[0])
        assert gd.sync_time == (comm.ps_time(devs, server, gd.sync_bytes) if sync == "ps"
                                else comm.allreduce_time(devs, gd.sync_bytes))


def _factors(sel):
    seen = {}
    for d in sel.decisions:
        for f in d.candidate.factors:
            seen.setdefault(f.tensor, f)
    return list(seen.values())


def test_search_and_gnn_features_read_the_cost_models_links(fitted_setup):
    from tag.gnn.features import JointContext
    from tag.parallel.sharded import Sharded
    from tag.search.space import ActionSpace

    graph, topo, cm = fitted_setup
    space = ActionSpace(graph, topo, cost_model=cm)
    assert space.comm is cm.comm  # the search heuristics' model is the simulator's
    devices = list(range(topo.num_devices))
    g = int(np.argmax(space.costs.param_bytes))
    fastest = int(np.argmax(space.costs.device_speed))
    assert space.stake_s[g] - space.costs.group_time_full[g, fastest] == \
        pytest.approx(cm.comm.allreduce_time(devices, float(space.costs.param_bytes[g])), rel=1e-12)
    ctx = JointContext(space, 1.0)
    bw, lat = cm.comm.bandwidth, cm.comm.latency
    assert np.array_equal(ctx.link_attr[:, 0], bw[ctx.link_src, ctx.link_dst])
    assert np.array_equal(ctx.link_attr[:, 1], lat[ctx.link_src, ctx.link_dst])
    assert np.all(ctx.device_static[:, 4] == 1e9)  # intra-machine: the measured p2p fit, not 5 GB/s
    # action sync features: slowest-link bounds on the same links
    for a, act in enumerate(space.actions):
        devs = list(act.devices)
        if len(devs) < 2 or act.sync == "mp":
            continue
        sub = ~np.eye(len(devs), dtype=bool)
        bmin, lmax = bw[np.ix_(devs, devs)][sub].min(), lat[np.ix_(devs, devs)].max()
        p = space.costs.param_bytes[g]
        if act.sync == "zero3":  # a reduce-scatter, and an all-gather (of the gathered dtype's
            # bytes) before forward and backward; offloaded, the host step on top
            shard, offload = Sharded.search_option_parts(act.tp)
            s = shard or len(devs)
            want = ring_reducescatter_time(len(devs), p, bmin, lmax) + \
                2 * ring_allgather_time(s, space.costs.gather_bytes[g], bmin, lmax)
            if offload:
                want += Sharded.host_step_estimate(space, tuple(devs), p, space.costs.opt_bytes[g], s)
        else:
            want = ring_allreduce_time(len(devs), p, bmin, lmax) if act.sync == "allreduce" else \
                uniform_ps_time(len(devs), p, bmin, lmax)
        assert ctx.action_feats[g, a, 1] == want
    # without a cost model: the topology's nominal links
    bare = ActionSpace(graph, topo, costs=space.costs)
    assert bare.comm is CommModel.nominal(topo)
    assert np.array_equal(bare.comm.bandwidth, topo.bandwidth_matrix)


def test_search_roofline_fallback_is_the_cost_models_roofline(captured, mixed):
    from tag.search.costs import GroupCosts

    graph = captured("mlp:hidden=256,layers=3,in_dim=64,classes=10", batch=12, groups=4).graph
    rough = GroupCosts.compute(graph, mixed)  # no cost model: the roofline table
    cm = CostModel.roofline_only(graph, mixed)
    for d in range(mixed.num_devices):
        want = cm.table(d)[:, :, graph.batch_size].sum(axis=1)
        assert rough.group_time_full[:, d] == pytest.approx(want, rel=1e-12)
