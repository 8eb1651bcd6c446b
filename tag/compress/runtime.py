"""Executor side of SFB: all-gather factor rows across replicas and recompute the full gradient.

Per SFB op of a group, every replica

1. all-gathers each factor along its ``batch_dim`` with :func:`gather_rows` (replica ``r``
   contributes its ``b_r`` rows; rows are concatenated in replica order, which is the global
   sample order since replica ``r`` owns samples ``[sum(b_<r), sum(b_<=r))``);
2. evaluates the joint-graph nodes from the factors to the parameter's gradient on the gathered
   tensors with :func:`sfb_kernel` -- the joint graph was captured at the global batch, which is
   exactly the gathered batch, so its fixed view shapes fit;
3. uses the result as the parameter's full gradient and leaves it out of the all-reduce.

Units: the gathered rows must be in "full-batch units" (summing the replicas' local products
gives the full-batch gradient). The executor scales the loss-gradient seed by ``b_r / B`` inside
the loss unit's backward (docs/design.md "Loss scaling"), so every backward factor row already
is; an implementation that scaled gradients only after the backward would have to scale the
backward factor rows it contributes by ``b_r / B`` before gathering (dW is linear in dY).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..graph.capture import Captured
from ..graph.stages import Stage, build_stages
from .cost import SfbError
from .detect import Candidate


def gather_rows(local: torch.Tensor, batch_dim: int, counts: Sequence[int], group=None,
                sample_order: Sequence[int] | None = None) -> torch.Tensor:
    """All-gather ``local`` (``counts[rank]`` rows along ``batch_dim``) into the full tensor.

    Uneven counts are handled by padding every contribution to ``max(counts)`` rows, gathering,
    and slicing the padding off (gloo and NCCL ``all_gather`` need equal sizes). ``counts`` is
    known to every rank from the plan (``local_batches``), so no size exchange is needed.

    Args:
        counts: rows held by each rank of ``group``, indexed by *group rank*.
        group: ``torch.distributed`` process group of exactly the op-group's replicas.
        sample_order: group ranks in the order their samples come in the global batch (the
            order of ``GroupPlan.devices``); default ``0..n-1``. ``dist.new_group`` numbers
            group ranks by ascending global rank, which differs when ``devices`` is unsorted.
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    if local.shape[batch_dim] != counts[rank]:
        raise SfbError(f"gather_rows: local: expected {counts[rank]} rows along dim {batch_dim} on group "
                       f"rank {rank}, got {local.shape[batch_dim]}")
    width = max(counts)
    pad = list(local.shape)
    pad[batch_dim] = width - counts[rank]
    padded = torch.cat([local, local.new_zeros(pad)], dim=batch_dim).contiguous()
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    order = range(len(counts)) if sample_order is None else sample_order
    return torch.cat([parts[r].narrow(batch_dim, 0, counts[r]) for r in order], dim=batch_dim)


@dataclass
class _JointOnly:
    """The one attribute of :class:`Captured` that ``build_stages`` reads."""

    joint: torch.fx.GraphModule


@dataclass
class SfbKernel:
    """Computes one parameter's full gradient from its gathered factors."""

    candidate: Candidate
    stage: Stage
    """Joint-graph piece from the factor nodes to the gradient node."""
    grad_node: str
    """Joint-graph node name of the parameter's gradient (``Captured.grad_outputs[param]``)."""

    def __call__(self, factors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``factors``: factor node name -> full (global-batch) tensor; returns the gradient."""
        return self.stage(factors)[self.grad_node]


def sfb_kernel(joint: Captured | torch.fx.GraphModule, cand: Candidate) -> SfbKernel:
    """Build (once per op; cache it) the kernel recomputing ``cand.param``'s gradient.

    ``joint``: a :class:`Captured` or any joint-graph ``GraphModule`` exported at the *global*
    batch with the capture's node names (e.g. the executor's ``export_at(model, make_inputs, B)``).
    """
    gm = joint.joint if isinstance(joint, Captured) else joint
    nodes = {n.name: n for n in gm.graph.nodes}
    grad_node = cand.grad_node
    factor_names = {f.name for f in cand.factors}
    inside: set[str] = set()
    stack = [nodes[grad_node]]
    while stack:
        n = stack.pop()
        if n.name in inside or n.name in factor_names:
            continue
        if n.op != "call_function":
            raise SfbError(f"sfb: op {cand.op_name!r}: gradient of {cand.param!r} depends on input "
                           f"{n.name!r} that is not one of its factors {sorted(factor_names)}")
        inside.add(n.name)
        stack.extend(n.all_input_nodes)
    key = ("sfb", cand.op_name)
    stage = build_stages(_JointOnly(gm), {name: key for name in inside})[key]
    return SfbKernel(cand, stage, grad_node)
