"""Message-passing layer of the joint op-group / device graph."""

from __future__ import annotations

import linecache
import tempfile
from pathlib import Path

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GATv2Conv, HeteroConv
from torch_geometric.utils import softmax

EdgeType = tuple[str, str, str]


class MultGATv2Conv(GATv2Conv):
    """:class:`GATv2Conv` whose edges may stand for several identical ones: the last column of
    ``edge_attr`` is ``log m`` (0: one edge), added to the attention logit before the softmax, as
    ``m`` parallel copies of the edge would weigh; the other columns are the edge features. Same
    parameters as :class:`GATv2Conv` (checkpoints load unchanged)."""

    def edge_update(self, x_j: Tensor, x_i: Tensor, edge_attr: Tensor, index: Tensor, ptr: Tensor | None,
                    dim_size: int | None) -> Tensor:
        feats, log_mult = edge_attr[:, :-1], edge_attr[:, -1]
        x = x_i + x_j + self.lin_edge(feats).view(-1, self.heads, self.out_channels)
        x = F.leaky_relu(x, self.negative_slope)
        alpha = (x * self.att).sum(dim=-1) + log_mult[:, None]  # [E, heads]
        alpha = softmax(alpha, index, ptr, dim_size)
        return F.dropout(alpha, p=self.dropout, training=self.training)


class JointConv(nn.Module):
    r"""One round of attention message passing over a heterogeneous graph with edge features,
    followed by a residual connection and layer normalisation per node type.

    Each relation :math:`r = (s, \cdot, t)` has its own GATv2 operator (Brody et al., "How
    Attentive are Graph Attention Networks?", ICLR 2022, https://arxiv.org/abs/2105.14491) with
    edge features; messages from all relations into a node type are summed (``HeteroConv``):

    .. math::
        \alpha^{r}_{ij} = \operatorname{softmax}_{j \in \mathcal{N}_r(i)}\left(
            \mathbf{a}_r^\top \operatorname{LeakyReLU}\left(\mathbf{W}_r [\mathbf{h}_i \,\|\,
            \mathbf{h}_j \,\|\, \mathbf{e}_{ji}]\right)\right)

        \mathbf{m}_i = \sum_{r} \Big\Vert_{k=1}^{H} \sum_{j \in \mathcal{N}_r(i)}
            \alpha^{r,k}_{ij} \mathbf{\Theta}^{k}_r \mathbf{h}_j

        \mathbf{h}'_i = \operatorname{LayerNorm}\left(\mathbf{h}_i + \operatorname{ELU}(\mathbf{m}_i)\right)

    Node types that receive no message (e.g. the policy's ``action`` nodes) pass through
    unchanged. An edge may stand for ``m`` identical edges (:class:`MultGATv2Conv`: the last
    column of its features is ``log m``; the coarse device graph of :mod:`tag.gnn.features`).

    Args:
        relations: the edge types ``(src, rel, dst)`` that carry messages.
        node_types: every node type that may be updated.
        hidden: width of node embeddings (input and output), divisible by ``heads``.
        edge_dim: width of each relation's edge features (dict by edge type).
        heads: attention heads (outputs concatenated).
        dropout: dropout on attention coefficients.

    Shapes:
        - **input:** ``x_dict[t]`` :math:`(|V_t|, \text{hidden})`, ``edge_index_dict[r]``
          :math:`(2, |E_r|)`, ``edge_attr_dict[r]`` :math:`(|E_r|, \text{edge\_dim}[r] + 1)` (the
          edge features, then ``log m``)
        - **output:** ``x_dict[t]`` :math:`(|V_t|, \text{hidden})` for every input node type.
    """

    def __init__(self, relations: list[EdgeType], node_types: list[str], hidden: int,
                 edge_dim: dict[EdgeType, int], heads: int = 4, dropout: float = 0.0):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.relations = list(relations)
        with _template_files_removed():
            convs = {r: MultGATv2Conv((hidden, hidden), hidden // heads, heads=heads, edge_dim=edge_dim[r],
                                  add_self_loops=False, dropout=dropout, share_weights=False)
                     for r in self.relations}
        self.conv = HeteroConv(convs, aggr="sum")
        self.norm = nn.ModuleDict({t: nn.LayerNorm(hidden) for t in node_types})
        self.act = nn.ELU()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()
        for n in self.norm.values():
            n.reset_parameters()

    def forward(self, x_dict: dict[str, Tensor], edge_index_dict: dict[EdgeType, Tensor],
                edge_attr_dict: dict[EdgeType, Tensor]) -> dict[str, Tensor]:
        ei = {r: edge_index_dict[r] for r in self.relations if r in edge_index_dict}
        ea = {r: edge_attr_dict[r] for r in ei}
        out = self.conv(x_dict, ei, edge_attr_dict=ea)
        new = {}
        for t, h in x_dict.items():
            if t in out and t in self.norm:
                new[t] = self.norm[t](h + self.act(out[t]))
            else:
                new[t] = h
        return new

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(relations={len(self.relations)}, norm={list(self.norm)})"


class _template_files_removed:
    """torch_geometric renders a message-passing class's ``propagate``/``edge_updater`` from jinja
    templates into ``NamedTemporaryFile(delete=False)`` modules (``torch_geometric.*.py`` in the
    system temp folder; once per class and process, no setting turns it off) and never removes
    them. Within this block they go to a private folder removed on exit; their source stays in
    :mod:`linecache` (entry with mtime None: never invalidated), so ``inspect.getsource`` and
    TorchScript still find it. Not thread-safe (``tempfile.tempdir`` is global)."""

    def __enter__(self):
        self._dir = tempfile.TemporaryDirectory(prefix="tag-pyg-")
        self._old, tempfile.tempdir = tempfile.tempdir, self._dir.name
        return self

    def __exit__(self, *exc):
        tempfile.tempdir = self._old
        for f in Path(self._dir.name).glob("*.py"):
            lines = f.read_text().splitlines(keepends=True)
            linecache.cache[str(f)] = (sum(map(len, lines)), None, lines, str(f))
        self._dir.cleanup()
        return False
