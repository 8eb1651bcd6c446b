"""Joint encoding of (op graph, topology, partial plan, simulator feedback) as a ``HeteroData``.

Node types:

* ``group``  - op-groups (``K``);
* ``device`` - devices (``D``);
* ``action`` - the candidate actions of the op-group decided next (``A``); they take no part in
  message passing, the policy head scores them from the device and group embeddings.

Edge types (``edge_attr`` columns listed in :data:`SCHEMA`):

* ``(group, feeds, group)`` / ``(group, fed_by, group)`` - data flow, bytes crossing per iteration;
* ``(device, link, device)`` - every ordered pair: bandwidth, latency, same machine;
* ``(group, on, device)`` / ``(device, hosts, group)`` - complete bipartite cross edges: the
  group's estimated time on the device and the current decision (placement bit, batch share,
  parameter server);
* ``(action, uses, device)`` - the devices of each candidate action with their batch share.

Features are **raw physical quantities** (seconds, bytes, bytes/s, FLOP/s) tagged with a *kind*
in :data:`SCHEMA`; :class:`tag.gnn.transforms.JointNormalize` maps them to scale-free values
(times relative to the better data-parallel iteration time, bytes as time on a typical link, ...)
so that one network serves models and clusters of very different scale. Static columns come from
the graph, the cost tables and the GPU catalog; dynamic ones from the partial plan and from the
simulator's feedback on it (per-device utilisation and peak-memory ratio, per-group finish time).

**Coarse device graphs** (``JointContext(..., coarse="exact" | "machine")``; the predictor uses
``machine`` above :data:`COARSE_ABOVE` devices). One node stands for a class of ``m`` devices and
carries their mean features (placement share, server flag, simulator feedback); ``m`` weights
the attention over incoming messages (``log m`` added to the logits: what ``m`` identical
neighbours contribute to a softmax), the policy head's means and share-weighted sums and the
pooled embedding; a class's link to itself stands for the ``m - 1`` links among its devices.

* ``exact``: devices that no table of the action space tells apart (:func:`device_classes`:
  same machine, same membership in every action's subset, same model-parallel chunks and
  parameter-server roles, same per-group times) are interchangeable in every state, and the
  network's outputs equal the full graph's up to float rounding and the simulator's feedback
  (which differs inside a class only by integer batch rounding). It saves little on 8-GPU
  machines: a machine's first device (parameter server, single-device actions) and its first
  ``MP_MAX_DEVICES`` (model-parallel chunks) stay apart, 320 nodes for 512 H100s.
* ``machine``: one node per machine (a machine has one GPU kind). Exact for actions that take
  whole machines; a model-parallel chunk, a parameter server or a single-device action on part
  of a machine is spread over its node as a mean share. ``D (D - 1)`` link edges become
  ``M^2`` and ``K D`` placement edges ``K M``: 64 nodes for 512 H100s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch_geometric.data import HeteroData

from ..parallel import get_strategy
from ..search.space import ActionSpace

# (column name, kind). Kinds: time [s], bytes [B], bw [B/s], lat [s], mem [B], flops [FLOP/s],
# membw [B/s], ratio [1], flag [0/1].
SCHEMA: dict[str, list[tuple[str, str]]] = {
    "group": [
        ("t_fast_b1", "time"), ("t_fast_b2", "time"), ("t_fast_b4", "time"), ("t_fast_b8", "time"),
        ("t_slow_b1", "time"), ("param_bytes", "bytes"), ("opt_bytes", "bytes"), ("act_bytes", "bytes"),
        ("param_frac", "ratio"), ("position", "ratio"), ("rank", "ratio"),
        ("decided", "flag"), ("current", "flag"), ("sync_allreduce", "flag"), ("sync_ps", "flag"),
        ("sync_mp", "flag"), ("ndev_frac", "ratio"), ("finish", "ratio"), ("is_default", "flag"),
        ("sync_tp", "flag"), ("tp_frac", "ratio"),
    ],
    "device": [
        ("flops_rel", "ratio"), ("flops", "flops"), ("memory", "mem"), ("mem_bw", "membw"),
        ("intra_bw", "bw"), ("machine_frac", "ratio"), ("speed_rel", "ratio"),
        ("util", "ratio"), ("mem_ratio", "ratio"), ("comm_ratio", "ratio"), ("load_frac", "ratio"),
        ("in_current", "flag"), ("current_share", "ratio"),
    ],
    "action": [
        ("ndev_frac", "ratio"), ("sync_allreduce", "flag"), ("sync_ps", "flag"), ("sync_mp", "flag"),
        ("compute", "time"), ("sync_time", "time"), ("mem_need", "ratio"), ("is_resolved", "flag"),
        ("is_prev", "flag"), ("machines_frac", "ratio"), ("sync_tp", "flag"), ("tp_frac", "ratio"),
    ],
    "feeds": [("bytes", "bytes"), ("same_devices", "flag")],
    "link": [("bandwidth", "bw"), ("latency", "lat"), ("same_machine", "flag")],
    "on": [("t_full", "time"), ("t_share", "time"), ("placed", "flag"), ("share", "ratio"), ("server", "flag")],
    "uses": [("share", "ratio")],
}
NODE_TYPES = ("group", "device", "action")
SYNC_FLAGS = ("allreduce", "ps", "mp", "tp")
"""The sync one-hot's flags (columns ``sync_<flag>`` of the group and action features in
:data:`SCHEMA`). An action or a decided group sets the flag its strategy names
(:attr:`tag.parallel.Strategy.feature_sync`; each built-in strategy its own), or none (a strategy
registered later that names none: all four 0)."""


def _flag_columns(node: str, first: str) -> np.ndarray:
    """[len(SYNC_FLAGS)] column of each sync flag among ``node``'s columns from ``first`` on (the
    dynamic ones the encoder fills)."""
    names = [name for name, _ in SCHEMA[node]]
    return np.array([names.index(f"sync_{f}") - names.index(first) for f in SYNC_FLAGS], dtype=np.int64)


GROUP_SYNC_COLUMNS = _flag_columns("group", "decided")
"""Columns of the sync flags among the group features' dynamic ones (``gdyn``)."""
ACTION_SYNC_COLUMNS = _flag_columns("action", "ndev_frac")
"""Columns of the sync flags among the action features."""


def sync_flags(space: ActionSpace) -> np.ndarray:
    """[A] index in :data:`SYNC_FLAGS` of the flag each action of ``space`` sets, -1 for none
    (its strategy's :attr:`~tag.parallel.Strategy.feature_sync`, from the registry)."""
    flag = {}
    for name in dict.fromkeys(a.sync for a in space.actions):
        f = get_strategy(name).feature_sync
        if f is not None and f not in SYNC_FLAGS:
            raise ValueError(f"strategy {name!r}: feature_sync: expected one of {list(SYNC_FLAGS)} or None, got {f!r}")
        flag[name] = -1 if f is None else SYNC_FLAGS.index(f)
    return np.array([flag[a.sync] for a in space.actions], dtype=np.int64)
ADDED_COLUMNS = {"group": 2, "action": 2}
"""Columns appended to a node type's features after the shipped predictor of 27fed77 was trained
(tensor-parallel actions): :func:`tag.gnn.predictor.load_net` reads an older checkpoint by giving
them zero input weights, so it scores a ``tp`` action by its other columns until retrained."""
REL = {
    "feeds": ("group", "feeds", "group"),
    "fed_by": ("group", "fed_by", "group"),
    "link": ("device", "link", "device"),
    "on": ("group", "on", "device"),
    "hosts": ("device", "hosts", "group"),
    "uses": ("action", "uses", "device"),
}
EDGE_SCHEMA = {"feeds": "feeds", "fed_by": "feeds", "link": "link", "on": "on", "hosts": "on", "uses": "uses"}
MESSAGE_RELATIONS = ("feeds", "fed_by", "link", "on", "hosts")
COARSE_ABOVE = 128
"""The predictor encodes clusters of more devices than this with the coarse device graph (see the
module docstring); up to it, one node per device. A checkpoint that records its own threshold
(``meta["coarse_above"]``, written by :mod:`tag.training.loop`) is encoded as it was trained;
this default is for checkpoints that do not (27fed77's, trained on at most 32 GPUs)."""


def coarse_level(num_devices: int, coarse_above: int) -> str | None:
    """The encoding of a cluster of ``num_devices``: ``"machine"`` above ``coarse_above``, else
    one node per device (None). Training data and the predictor both ask here."""
    return "machine" if num_devices > coarse_above else None


COARSE_LEVELS = ("exact", "machine")


def device_classes(space: ActionSpace, level: str = "exact") -> np.ndarray:
    """[D] class of each device (0..C-1, by first device). ``exact``: two devices share a class
    when no table of ``space`` tells them apart, i.e. they are on the same machine, in the same
    actions' subsets, chosen for the same model-parallel chunks, parameter server of the same
    actions, and have the same time for every group; every state's placement, shares and server
    flags are then identical over a class. ``machine``: one class per machine (see the module
    docstring)."""
    topo, d = space.topology, space.num_devices
    if level == "machine":
        return np.array([topo.machine_of(x) for x in range(d)], dtype=np.int64)
    if level != "exact":
        raise ValueError(f"coarse: expected one of {COARSE_LEVELS}, got {level!r}")
    mp_roles: list[list[tuple[int, int]]] = [[] for _ in range(d)]
    server_of: list[list[int]] = [[] for _ in range(d)]
    for a, act in enumerate(space.actions):
        if get_strategy(act.sync).chunked and len(act.devices) > 1:  # the chunks' devices per group
            for g in range(space.num_groups):
                for x in space._mp_devices(g, act):
                    mp_roles[x].append((g, a))
        elif len(act.devices) > 1:  # the parameter server of the action's plans, if any
            srv = get_strategy(act.sync).search_server(space, act.devices, act.tp)
            if srv is not None:
                server_of[srv].append(a)
    member = np.ascontiguousarray(space.membership.T)  # [D, A]
    times = np.ascontiguousarray(space.costs.group_time_full.T)  # [D, K] seconds
    keys: dict[tuple, int] = {}
    out = np.empty(d, dtype=np.int64)
    for x in range(d):
        key = (topo.machine_of(x), member[x].tobytes(), tuple(mp_roles[x]), tuple(server_of[x]), times[x].tobytes())
        out[x] = keys.setdefault(key, len(keys))
    return out


def with_unit_mult(data: HeteroData) -> HeteroData:
    """``data`` (a state encoded with one node per device) with the coarse graph's multiplicities
    made explicit (one device per node and edge), so that it collates with coarse states in one
    training batch; :class:`tag.gnn.TagNet` computes the same on it up to float rounding."""
    if "mult" not in data["device"]:
        data["device"].mult = torch.ones(data["device"].num_nodes)
        for r in ("link", "hosts"):
            data[REL[r]].log_mult = torch.zeros(data[REL[r]].edge_index.size(1))
        data[REL["uses"]].mult = torch.ones(data[REL["uses"]].edge_index.size(1))
    return data


def dims() -> dict[str, int]:
    """Feature widths per node type and per relation."""
    out = {nt: len(SCHEMA[nt]) for nt in NODE_TYPES}
    out.update({r: len(SCHEMA[EDGE_SCHEMA[r]]) for r in REL})
    return out


class JointContext:
    """Static part of the encoding of one (graph, topology); builds states' ``HeteroData`` fast.

    Args:
        space: the action space (it holds the graph, the topology and the cost tables).
        t_ref: reference iteration time (s), the better data-parallel baseline's.
        coarse: ``None`` one node per device; ``exact`` or ``machine``: one per class of devices
            (:func:`device_classes`; see the module docstring).
    """

    def __init__(self, space: ActionSpace, t_ref: float, coarse: str | None = None):
        self.space = space
        self.t_ref = float(t_ref)
        self.coarse = coarse
        topo, c = space.topology, space.costs
        k, d, a = space.num_groups, space.num_devices, space.num_actions
        self.k, self.a = k, a
        self.cls = device_classes(space, coarse) if coarse else np.arange(d)
        """[D] device node of each device."""
        self.d = d = int(self.cls.max()) + 1 if d else 0
        """Device nodes per state (``D``, or the classes when coarse)."""
        self.mult = np.bincount(self.cls, minlength=d).astype(np.float64)
        """[d] devices per device node."""
        self.reps = np.unique(self.cls, return_index=True)[1]
        """[d] first device of each node."""
        reps, cls, mult = self.reps, self.cls, self.mult
        gt = c.group_time  # [K, D, 4]
        fast = int(np.argmax(c.device_speed))
        slow = int(np.argmin(c.device_speed))
        total_p = float(c.param_bytes.sum()) or 1.0
        self.total_param_bytes = total_p
        comm = space.comm  # links: measured fits where profiled (tag.cost.comm)
        bw = comm.bandwidth
        nd = space.num_devices
        off = bw[~np.eye(nd, dtype=bool)] if nd > 1 else np.array([])  # full [D, D]: the same reference coarse or not
        finite = off[np.isfinite(off)]
        self.bw_ref = float(np.median(finite)) if finite.size else 100e9
        # ---- group static
        gs = np.zeros((k, 11))
        gs[:, 0:4] = gt[:, fast, :]
        gs[:, 4] = gt[:, slow, 0]
        gs[:, 5] = c.param_bytes
        gs[:, 6] = c.opt_bytes
        gs[:, 7] = c.act_bytes
        gs[:, 8] = c.param_bytes / total_p
        gs[:, 9] = np.arange(k) / max(k - 1, 1)
        gs[:, 10] = space.rank / max(k - 1, 1)
        self.group_static = gs
        # ---- device static (per device [D, 7], then one row per node)
        flops = np.array([dv.gpu.fp32_flops for dv in topo.devices])
        ds = np.zeros((nd, 7))
        ds[:, 0] = flops / flops.max()
        ds[:, 1] = flops
        ds[:, 2] = [dv.gpu.memory_bytes for dv in topo.devices]
        ds[:, 3] = [dv.gpu.memory_bandwidth for dv in topo.devices]
        intra = [comm.machine_bandwidth(m, m) for m in (topo.machine_of(dv.index) for dv in topo.devices)]
        ds[:, 4] = [b if math.isfinite(b) else 1e12 for b in intra]  # no intra link given: 1 TB/s
        ds[:, 5] = [topo.machines[topo.machine_of(i)].count / nd for i in range(nd)]
        ds[:, 6] = c.device_speed / c.device_speed.max()
        self.device_static = ds[reps]
        self.mem_cap = ds[:, 2]  # [D] bytes, per device (the actions' memory need)
        # ---- edges
        flow = sorted(c.flow.items())
        self.flow_src = np.array([f[0][0] for f in flow], dtype=np.int64)
        self.flow_dst = np.array([f[0][1] for f in flow], dtype=np.int64)
        self.flow_bytes = np.array([f[1] for f in flow], dtype=np.float64)
        # links: node j -> node i stands for the links from the m_j devices of j to one device of i
        # (j == i: the m_i - 1 others of its own class); src_dev/dst_dev one such device pair
        src, dst = np.nonzero(np.ones((d, d), dtype=bool))
        n_links = np.where(src == dst, mult[dst] - 1, mult[src])
        keep = n_links > 0
        src, dst, n_links = src[keep], dst[keep], n_links[keep]
        second = np.array([np.nonzero(cls == i)[0][min(1, int(mult[i]) - 1)] for i in range(d)], dtype=np.int64)
        src_dev, dst_dev = reps[src], np.where(src == dst, second[dst], reps[dst])
        self.link_src, self.link_dst = src.astype(np.int64), dst.astype(np.int64)
        self.link_log_mult = np.log(n_links)
        mo = np.array([topo.machine_of(i) for i in range(nd)])
        lat = comm.latency
        self.link_attr = np.stack([bw[src_dev, dst_dev], lat[src_dev, dst_dev],
                                   (mo[src_dev] == mo[dst_dev]).astype(float)], 1) \
            if len(src) else np.zeros((0, 3))
        gg, dd = np.meshgrid(np.arange(k), np.arange(d), indexing="ij")
        self.on_src, self.on_dst = gg.reshape(-1), dd.reshape(-1)
        self.on_tfull = gt[:, reps, 0].reshape(-1)
        # ---- per (group, action) tables, one action at a time for every group (no GroupPlan built:
        # each strategy's Strategy.search_table, the numbers of its search_plan / search_estimate)
        self.place = np.zeros((k, a, d))  # summed batch share of each node's devices (mp: 1/n each)
        self.server = np.full((k, a), -1, np.int64)  # node of the parameter server
        self.action_feats = np.zeros((k, a, 3))
        """[K, A, 3]: compute, sync time and memory need of every action for every group (see
        :meth:`_action_table`)."""
        for ai, act in enumerate(space.actions):
            tab = self._action_table(ai, act)
            w = tab.shares
            if get_strategy(act.sync).chunked:  # a chunk's node holds 1/n of the group, n its chunks
                w = np.where(tab.devices >= 0, 1.0 / (tab.devices >= 0).sum(axis=1, keepdims=True), 0.0)
            _add_in_order(self.place[:, ai], cls, tab.devices, w)
            has = tab.server >= 0
            self.server[has, ai] = cls[tab.server[has]]
        self.sync_flag = sync_flags(space)
        """[A] index in :data:`SYNC_FLAGS` of each action's sync flag, -1: none."""
        self.action_flagged = np.flatnonzero(self.sync_flag >= 0)
        self.ndev = space.membership.sum(axis=1)
        size = [get_strategy(act.sync).search_group_size(act.tp) for act in space.actions]
        self.tp_frac = np.array([m / len(act.devices) if m else 0.0 for m, act in zip(size, space.actions)])
        """[A] devices of one tensor-parallel group over the action's devices (0: not ``tp``)."""
        self.machines_frac = np.array([len({topo.machine_of(x) for x in act.devices}) / topo.num_machines
                                       for act in space.actions])
        members = np.zeros((a, d))  # [A, d] devices of each node in each action's subset
        np.add.at(members.T, cls, space.membership.T)
        self.uses_src, self.uses_dst = np.nonzero(members)
        self.uses_mult = members[self.uses_src, self.uses_dst]

    def _per_node(self, x) -> np.ndarray:
        """[D] per-device values -> [d] their mean over each node's devices."""
        x = np.asarray(x, dtype=np.float64)
        return x if self.coarse is None else np.bincount(self.cls, weights=x, minlength=self.d) / self.mult

    def _action_table(self, ai: int, act):
        """The :class:`tag.parallel.SearchTable` of action ``act`` for every group, its estimates
        (compute s, sync s, memory need over the subset's smallest device memory) written into
        :attr:`action_feats`.

        Each strategy's :meth:`~tag.parallel.Strategy.search_estimate`: slowest-link bounds
        (:mod:`tag.cost.comm`), the subset's smallest bandwidth and largest latency over all its
        pairs priced by the ring all-reduce, the parameter server (counting all ``n`` replicas as
        workers), two latency-free transfers of the activations per model-parallel chunk, ...:
        what the shipped predictor was trained on."""
        sp = self.space
        devs = list(act.devices)
        n = len(devs)
        if n > 1:
            sub = np.array(sp.comm.bandwidth[np.ix_(devs, devs)])
            np.fill_diagonal(sub, np.inf)  # every pair but a device with itself
            bmin = float(sub.min())
            lmax = float(sp.comm.latency[np.ix_(devs, devs)].max())
        else:
            bmin, lmax = math.inf, 0.0
        tab = get_strategy(act.sync).search_table(sp, act.devices, act.tp, bmin, lmax)
        self.action_feats[:, ai, :2] = tab.estimate[:, :2]
        self.action_feats[:, ai, 2] = tab.estimate[:, 2] / float(self.mem_cap[devs].min())
        return tab

    # ------------------------------------------------------------------ states
    def encode(self, states: Sequence, targets: Sequence | None = None) -> HeteroData:
        """Disjoint union of the encodings of ``states`` (``SearchState``-like: ``assign``,
        ``group``, ``feedback``) as one ``HeteroData`` with ``batch`` vectors per node type.

        ``targets``: optional per-state ``(visits [A], value)`` stored as ``action.pi`` and
        ``value`` (training data)."""
        sp = self.space
        k, d, a = self.k, self.d, self.a
        nd = sp.num_devices  # devices (d: device nodes)
        n = len(states)
        gx, dx, ax, on_attr, feeds_attr, uses_attr = [], [], [], [], [], []
        for st in states:
            assign = np.asarray(st.assign)
            res = np.asarray(st.resolved if getattr(st, "resolved", None) is not None else sp.resolve(assign))
            cur = int(st.group)
            fb = st.feedback
            decided = (assign >= 0).astype(float)
            flag = self.sync_flag[res]
            flagged = np.flatnonzero(flag >= 0)
            gdyn = np.zeros((k, 10))
            gdyn[:, 0] = decided
            if cur >= 0:
                gdyn[cur, 1] = 1.0
            gdyn[flagged, GROUP_SYNC_COLUMNS[flag[flagged]]] = 1.0
            gdyn[:, 5] = self.ndev[res] / nd
            gdyn[:, 6] = np.clip(fb.group_finish, 0, 10)
            gdyn[:, 7] = (res == sp.default_action).astype(float)
            gdyn[:, 9] = self.tp_frac[res]
            gx.append(np.concatenate([self.group_static, gdyn], 1))
            place = self.place[np.arange(k), res] / self.mult  # [K, d] mean share of a node's devices
            ddyn = np.zeros((d, 6))
            ddyn[:, 0] = np.clip(self._per_node(fb.device_util), 0, 10)
            ddyn[:, 1] = np.clip(self._per_node(fb.device_mem), 0, 10)
            ddyn[:, 2] = np.clip(self._per_node(fb.device_comm), 0, 10)
            ddyn[:, 3] = (place > 0).sum(0) / k
            if cur >= 0:
                ddyn[:, 4] = place[cur] > 0
                ddyn[:, 5] = place[cur]
            dx.append(np.concatenate([self.device_static, ddyn], 1))
            srv = np.zeros((k, d))
            sv = self.server[np.arange(k), res]
            has = sv >= 0
            srv[np.arange(k)[has], sv[has]] = 1.0 / self.mult[sv[has]]  # a node's share of servers
            share = place.reshape(-1)
            t_share = self.on_tfull * np.where(share > 0, 0.1 + 0.9 * share, 0.0)
            on_attr.append(np.stack([self.on_tfull, t_share, (share > 0).astype(float), share,
                                     srv.reshape(-1)], 1))
            feeds_attr.append(np.stack([self.flow_bytes, np.array(
                [float(res[s] == res[t]) for s, t in zip(self.flow_src, self.flow_dst)])], 1)
                if len(self.flow_src) else np.zeros((0, 2)))
            # actions of the current group
            afe = np.zeros((a, 12))
            afe[:, 0] = self.ndev / nd
            afe[self.action_flagged, ACTION_SYNC_COLUMNS[self.sync_flag[self.action_flagged]]] = 1.0
            afe[:, 11] = self.tp_frac
            gi = cur if cur >= 0 else 0
            afe[:, 4:7] = self.action_feats[gi]
            if cur >= 0:
                afe[res[cur], 7] = 1.0
                prev = _previous_decided(assign, sp.order)
                if prev is not None:
                    afe[prev, 8] = 1.0
            afe[:, 9] = self.machines_frac
            ax.append(afe)
            uses_attr.append((self.place[gi, self.uses_src, self.uses_dst] / self.uses_mult)[:, None])
        data = HeteroData()
        data.num_states = n
        data["group"].x = _t(np.concatenate(gx))
        data["device"].x = _t(np.concatenate(dx))
        data["action"].x = _t(np.concatenate(ax))
        for nt, cnt in (("group", k), ("device", d), ("action", a)):
            data[nt].batch = torch.arange(n).repeat_interleave(cnt)
            data[nt].num_nodes = n * cnt
        data["group"].current = _t(np.concatenate([x[:, 12] for x in gx]))

        def rep(src, dst, ns, nd):
            off_s = (np.arange(n) * ns)[:, None]
            off_d = (np.arange(n) * nd)[:, None]
            return torch.from_numpy(np.stack([(src[None] + off_s).reshape(-1), (dst[None] + off_d).reshape(-1)]))

        data[REL["feeds"]].edge_index = rep(self.flow_src, self.flow_dst, k, k)
        data[REL["feeds"]].edge_attr = _t(np.concatenate(feeds_attr))
        data[REL["fed_by"]].edge_index = rep(self.flow_dst, self.flow_src, k, k)
        data[REL["fed_by"]].edge_attr = data[REL["feeds"]].edge_attr
        data[REL["link"]].edge_index = rep(self.link_src, self.link_dst, d, d)
        data[REL["link"]].edge_attr = _t(np.tile(self.link_attr, (n, 1)))
        if self.coarse is not None:  # devices per node (tag.gnn.model reads these; absent: one each)
            data["device"].mult = _t(np.tile(self.mult, n))
            data[REL["link"]].log_mult = _t(np.tile(self.link_log_mult, n))
            data[REL["hosts"]].log_mult = _t(np.tile(np.log(self.mult)[self.on_dst], n))
            data[REL["uses"]].mult = _t(np.tile(self.uses_mult, n))
        data[REL["on"]].edge_index = rep(self.on_src, self.on_dst, k, d)
        data[REL["on"]].edge_attr = _t(np.concatenate(on_attr))
        data[REL["hosts"]].edge_index = rep(self.on_dst, self.on_src, d, k)
        data[REL["hosts"]].edge_attr = data[REL["on"]].edge_attr
        data[REL["uses"]].edge_index = rep(self.uses_src, self.uses_dst, a, d)
        data[REL["uses"]].edge_attr = _t(np.concatenate(uses_attr))
        # per-state scale for the normalising transform
        data.t_ref = torch.full((n,), self.t_ref, dtype=torch.float32)
        data.bw_ref = torch.full((n,), self.bw_ref, dtype=torch.float32)
        data.param_ref = torch.full((n,), self.total_param_bytes, dtype=torch.float32)
        if targets is not None:
            data["action"].pi = _t(np.concatenate([np.asarray(t[0], dtype=np.float64) for t in targets]))
            data.value = torch.tensor([float(t[1]) for t in targets], dtype=torch.float32)
        return data


def _previous_decided(assign: np.ndarray, order: list[int]) -> int | None:
    prev = None
    for g in order:
        if assign[g] < 0:
            break
        prev = int(assign[g])
    return prev


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float32))


def _add_in_order(out: np.ndarray, cls: np.ndarray, devices: np.ndarray, w: np.ndarray) -> None:
    """``out[g, cls[devices[g, j]]] += w[g, j]`` for every ``j`` of row ``g`` in ascending order
    (``np.add.at`` row by row, the same sums bit for bit), ``devices`` -1 skipped. A node's
    ``r``-th device of a row is added in pass ``r``: a pass adds to each (row, node) once."""
    node = np.where(devices >= 0, cls[np.maximum(devices, 0)], -1)
    same = node.shape[0] > 0 and bool((node == node[0]).all())
    rows_node = node[:1] if same else node
    order = np.argsort(rows_node, axis=1, kind="stable")
    srt = np.take_along_axis(rows_node, order, 1)
    pos = np.arange(srt.shape[1])
    first = np.where(np.concatenate([np.ones((srt.shape[0], 1), bool), srt[:, 1:] != srt[:, :-1]], 1), pos, 0)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, pos - np.maximum.accumulate(first, axis=1), 1)
    rank[rows_node < 0] = -1
    for r in range(int(rank.max()) + 1 if rank.size else 0):
        if same:
            cols = np.flatnonzero(rank[0] == r)
            out[:, node[0, cols]] += w[:, cols]
        else:
            rows, cols = np.nonzero(rank == r)
            out[rows, node[rows, cols]] += w[rows, cols]

