"""Feature normalisation as a PyG transform: raw physical features -> scale-free values.

Per state, with ``t_ref`` the better data-parallel iteration time, ``bw_ref`` the median link
bandwidth and ``P`` the model's parameter bytes:

=========  ===================================  ==========================================
kind       raw unit                             normalised
=========  ===================================  ==========================================
time       seconds                              ``log1p(x / t_ref)``
lat        seconds                              ``log1p(100 x / t_ref)``
bytes      bytes                                ``log1p(x / (bw_ref t_ref))`` (time on a typical link)
bw         bytes/s                              ``log1p(P / (x t_ref))`` (moving the model over it)
mem        bytes                                ``log1p(x / P) / 4`` (model copies that fit)
flops      FLOP/s                               ``log(x / 1e13)``
membw      bytes/s                              ``log(x / 1e12)``
ratio      1                                    clipped to ``[0, 10]``
flag       0/1                                  unchanged
=========  ===================================  ==========================================
"""

from __future__ import annotations

import torch
from torch_geometric.data import HeteroData
from torch_geometric.transforms import BaseTransform

from .features import EDGE_SCHEMA, NODE_TYPES, REL, SCHEMA


def normalise_columns(x: torch.Tensor, kinds: list[str], t_ref: torch.Tensor, bw_ref: torch.Tensor,
                      p_ref: torch.Tensor) -> torch.Tensor:
    """Normalise ``x`` [N, F] column-wise; ``t_ref``/``bw_ref``/``p_ref`` are per-row [N]."""
    if x.numel() == 0:
        return x
    out = torch.empty_like(x)
    t = t_ref.clamp_min(1e-12)
    bw = bw_ref.clamp_min(1.0)
    p = p_ref.clamp_min(1.0)
    for j, kind in enumerate(kinds):
        c = x[:, j].clamp_min(0)
        if kind == "time":
            v = torch.log1p(c / t)
        elif kind == "lat":
            v = torch.log1p(100.0 * c / t)
        elif kind == "bytes":
            v = torch.log1p(c / (bw * t))
        elif kind == "bw":
            v = torch.log1p(p / (c.clamp_min(1.0) * t))
        elif kind == "mem":
            v = torch.log1p(c / p) / 4.0
        elif kind == "flops":
            v = torch.log(c.clamp_min(1.0) / 1e13)
        elif kind == "membw":
            v = torch.log(c.clamp_min(1.0) / 1e12)
        elif kind == "ratio":
            v = c.clamp(0, 10)
        elif kind == "flag":
            v = c
        else:  # pragma: no cover - schema error
            raise ValueError(f"unknown feature kind {kind!r}")
        out[:, j] = v
    return torch.nan_to_num(out, nan=0.0, posinf=10.0, neginf=-10.0)


class JointNormalize(BaseTransform):
    """Normalise a raw joint encoding (idempotent: marks the data ``normalised``)."""

    def forward(self, data: HeteroData) -> HeteroData:
        if getattr(data, "normalised", False):
            return data
        t_ref, bw_ref, p_ref = data.t_ref.float(), data.bw_ref.float(), data.param_ref.float()

        def idx(nt):
            st = data[nt]
            if "batch" in st:
                return st.batch
            return torch.zeros(st.num_nodes, dtype=torch.long)

        for nt in NODE_TYPES:
            i = idx(nt)
            data[nt].x = normalise_columns(data[nt].x, [k for _, k in SCHEMA[nt]], t_ref[i], bw_ref[i], p_ref[i])
        done = set()
        for rel, et in REL.items():
            store = data[et]
            if "edge_attr" not in store:
                continue
            if rel == "fed_by" or rel == "hosts":
                continue  # shared tensors: normalised with feeds / on below
            i = idx(et[0])[store.edge_index[0]]
            store.edge_attr = normalise_columns(store.edge_attr, [k for _, k in SCHEMA[EDGE_SCHEMA[rel]]],
                                                t_ref[i], bw_ref[i], p_ref[i])
            done.add(rel)
        data[REL["fed_by"]].edge_attr = data[REL["feeds"]].edge_attr
        data[REL["hosts"]].edge_attr = data[REL["on"]].edge_attr
        data.normalised = True
        return data
