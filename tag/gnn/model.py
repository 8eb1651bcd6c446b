"""The joint GNN: encoder over op-groups and devices, a policy head, a value head and a plan head."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch_geometric.data import HeteroData
from torch_geometric.utils import scatter, softmax

from .features import MESSAGE_RELATIONS, NODE_TYPES, REL, dims
from .layers import JointConv
from .plan_head import PLAN_FEATURES

VALUE_CLIP = 5.0
"""Value targets are ``log(t / t_ref)`` clipped to ``[-VALUE_CLIP, VALUE_CLIP]`` (OOM: the top)."""


@dataclass
class NetConfig:
    """Shape of :class:`TagNet`."""

    hidden: int = 64
    """Width of node embeddings."""
    layers: int = 3
    """Message-passing rounds."""
    heads: int = 4
    """Attention heads per relation (must divide ``hidden``)."""
    dropout: float = 0.0
    """Attention dropout."""

    def __post_init__(self):
        if self.hidden < 4:
            raise ValueError(f"hidden: expected >= 4, got {self.hidden}")
        if self.layers < 1:
            raise ValueError(f"layers: expected >= 1, got {self.layers}")
        if self.heads < 1 or self.hidden % self.heads:
            raise ValueError(f"heads: expected a divisor of hidden ({self.hidden}), got {self.heads}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: expected in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


def _mlp(i: int, h: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.ELU(), nn.Linear(h, o))


class TagNet(nn.Module):
    r"""Policy / value network over the joint encoding (:mod:`tag.gnn.features`).

    Node and edge features are embedded by per-type linear maps, refined by ``layers``
    :class:`JointConv` rounds, then

    * **policy**: for each candidate action :math:`a` of the group :math:`g` being decided,
      :math:`\ell_a = \mathrm{MLP}([\mathbf{h}_g \,\|\, \mathrm{mean}_{d \in a} \mathbf{h}_d \,\|\,
      \max_{d \in a} \mathbf{h}_d \,\|\, \sum_{d \in a} s_{ad} \mathbf{h}_d \,\|\, \mathbf{x}_a \,\|\, \mathbf{z}])`,
      softmax over each state's actions (:math:`s_{ad}` the batch share, :math:`\mathbf{z}` the
      pooled graph embedding);
    * **value**: :math:`\mathrm{MLP}(\mathbf{z})`, the predicted ``log(t / t_ref)`` of the final plan;
    * **plan** (:meth:`plan_logits`): for each option :math:`o` of a plan-level pipeline decision
      (stage count, cut, stage deployment, micro-batches, schedule),
      :math:`\ell_o = \mathrm{MLP}([\mathbf{z} \,\|\, \mathbf{x}_o])` with :math:`\mathbf{x}_o` the
      option's features (:func:`tag.gnn.plan_head.plan_option_features`), softmax over the options.

    Args:
        cfg: :class:`NetConfig`.

    Shapes:
        - **input:** a (batched) normalised ``HeteroData`` from :meth:`JointContext.encode`.
        - **output:** ``(logits (|V_action|,), value (num_states,))``; logits are normalised
          with :func:`action_log_probs`.
        - :meth:`embed`: ``z (num_states, 2 * hidden)``; :meth:`plan_logits`: ``z (n, 2 * hidden)``
          and option features ``(n, O, PLAN_FEATURES)`` -> ``(n, O)``.
    """

    def __init__(self, cfg: NetConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or NetConfig()
        dm = dims()
        h = cfg.hidden
        self.node_in = nn.ModuleDict({t: nn.Linear(dm[t], h) for t in NODE_TYPES})
        self.rels = [REL[r] for r in MESSAGE_RELATIONS]
        self.edge_in = nn.ModuleDict({r: nn.Linear(dm[r], h // 2) for r in MESSAGE_RELATIONS})
        edge_dim = {REL[r]: h // 2 for r in MESSAGE_RELATIONS}
        self.convs = nn.ModuleList([
            JointConv(self.rels, ["group", "device"], h, edge_dim, cfg.heads, cfg.dropout)
            for _ in range(cfg.layers)
        ])
        self.uses_in = nn.Linear(dm["uses"], 1)
        self.policy = _mlp(6 * h, h, 1)
        self.value = _mlp(2 * h, h, 1)
        self.plan = _mlp(2 * h + PLAN_FEATURES, h, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        for c in self.convs:
            c.reset_parameters()

    def forward(self, data: HeteroData) -> tuple[Tensor, Tensor]:
        hg, hd, ha, z = self._encode(data)
        gb, ab = data["group"].batch, data["action"].batch
        n = z.size(0)
        cur_mask = data["group"].current > 0.5
        h_cur = torch.zeros(n, hg.size(1), dtype=hg.dtype)
        h_cur = h_cur.index_add(0, gb[cur_mask], hg[cur_mask])
        src, dst = data[REL["uses"]].edge_index
        share = data[REL["uses"]].edge_attr[:, :1]
        um = data[REL["uses"]].get("mult")  # [E] devices each edge stands for (coarse), else None: one
        na = ha.size(0)
        mean_d = _mean(hd[dst], src, na, um)
        max_d = scatter(hd[dst], src, 0, dim_size=na, reduce="max")
        wsum = scatter(hd[dst] * (share if um is None else share * um[:, None]), src, 0, dim_size=na, reduce="sum")
        feats = torch.cat([h_cur[ab], mean_d, max_d, wsum, ha, z[ab][:, : hg.size(1)]], 1)
        logits = self.policy(feats).squeeze(-1)
        value = self.value(z).squeeze(-1)
        return logits, value

    def embed(self, data: HeteroData) -> Tensor:
        """[num_states, 2 * hidden] pooled graph embedding ``z`` of each encoded state."""
        return self._encode(data)[3]

    def plan_logits(self, z: Tensor, options: Tensor) -> Tensor:
        """[n, O] logits of the plan head: ``z`` [n, 2 * hidden] (:meth:`embed`), ``options``
        [n, O, PLAN_FEATURES] (padded rows are scored too; mask them before the softmax)."""
        first, rest = self.plan[0], self.plan[1:]  # Linear([z, x_o]) = W_z z + W_x x_o + b, z once per state
        nz = z.size(1)
        hz = z @ first.weight[:, :nz].T
        hx = options.to(z.dtype) @ first.weight[:, nz:].T + first.bias
        return rest(hz[:, None, :] + hx).squeeze(-1)

    def _encode(self, data: HeteroData) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Group, device and action embeddings after message passing, and ``z`` per state."""
        x = {t: torch.relu(self.node_in[t](data[t].x)) for t in NODE_TYPES}
        ei = {REL[r]: data[REL[r]].edge_index for r in MESSAGE_RELATIONS}
        ea = {REL[r]: torch.cat([self.edge_in[r](data[REL[r]].edge_attr), _edge_log_mult(data[REL[r]])], 1)
              for r in MESSAGE_RELATIONS}  # features, then log of the edges each stands for
        hx = {"group": x["group"], "device": x["device"]}
        for conv in self.convs:
            hx = conv(hx, ei, ea)
        hg, hd, ha = hx["group"], hx["device"], x["action"]
        gb, db = data["group"].batch, data["device"].batch
        n = int(data.t_ref.numel())
        z = torch.cat([scatter(hg, gb, 0, dim_size=n, reduce="mean"),
                       _mean(hd, db, n, data["device"].get("mult"))], 1)  # devices per node (coarse)
        return hg, hd, ha, z


def _mean(x: Tensor, index: Tensor, n: int, weight: Tensor | None) -> Tensor:
    """[n, F] mean of the rows of ``x`` [N, F] per ``index``, each row counted ``weight`` [N] times
    (the devices a coarse node or edge stands for; None: once)."""
    if weight is None:
        return scatter(x, index, 0, dim_size=n, reduce="mean")
    w = weight.to(x.dtype)[:, None]
    return scatter(x * w, index, 0, dim_size=n, reduce="sum") / scatter(w, index, 0, dim_size=n, reduce="sum").clamp_min(1)


def _edge_log_mult(store) -> Tensor:
    """[E, 1] log of the edges each edge of ``store`` stands for (0 when not given)."""
    if "log_mult" in store:
        return store.log_mult.to(store.edge_attr.dtype)[:, None]
    return store.edge_attr.new_zeros(store.edge_attr.size(0), 1)


def action_log_probs(logits: Tensor, batch: Tensor) -> Tensor:
    """Log-softmax of ``logits`` within each state (``batch``: state of each action)."""
    return torch.log(softmax(logits, batch).clamp_min(1e-12))


def value_to_reward(v: Tensor) -> Tensor:
    """Predicted ``log(t / t_ref)`` -> reward ``t_ref / t - 1``."""
    return torch.exp(-v.clamp(-VALUE_CLIP, VALUE_CLIP)) - 1.0


def reward_to_value(r: float) -> float:
    """Reward (``-1`` = OOM) -> value target ``log(t / t_ref)`` clipped."""
    import math
    if r <= -1.0 + 1e-9:
        return VALUE_CLIP
    return max(-VALUE_CLIP, min(VALUE_CLIP, -math.log(1.0 + r)))
