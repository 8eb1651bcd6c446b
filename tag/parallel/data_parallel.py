"""Data parallel with all-reduce (``GroupPlan.sync == "allreduce"``).

Every device of ``GroupPlan.devices`` is a replica running the whole op-group on its share of
the global batch (``local_batches``: contiguous sample ranges in device order). After the
group's backward its parameter gradients are summed over the replicas with one all-reduce (ring
or hierarchical, :mod:`tag.cost.comm`), then every replica applies the optimizer.
"""

from __future__ import annotations

from ..plan.format import GroupPlan
from .strategy import Collective, Strategy, Unit, check_shares, no_field, sample_replicas


class DataParallel(Strategy):
    name = "allreduce"
    collective_op = "allreduce"
    """The :class:`Collective` op summing the gradients (``allreduce`` or ``ps``)."""

    def validate(self, gp: GroupPlan, graph, g: int, num_devices: int, batch_size: int, where: str) -> None:
        check_shares(gp, batch_size, where)
        no_field(gp, "mp_splits", where, "mp")
        no_field(gp, "tp", where, "tp")
        self.check_server(gp, num_devices, where)

    def check_server(self, gp: GroupPlan, num_devices: int, where: str) -> None:
        """``GroupPlan.server`` as this strategy wants it: unset for an all-reduce."""
        no_field(gp, "server", where, "ps")

    def units(self, g: int, gp: GroupPlan, graph, batch_size: int) -> list[Unit]:
        return [Unit((g, 0), gp.sync, sample_replicas(gp.devices, gp.shares, batch_size), self.server(gp))]

    def server(self, gp: GroupPlan) -> int | None:
        """The device the gradients are reduced to (none for an all-reduce)."""
        return None

    def normalise(self, gp: GroupPlan, has_params: bool) -> GroupPlan:
        """No gradients to synchronise (one replica, or no parameters): a plain all-reduce plan."""
        if len(gp.devices) == 1 or not has_params:
            gp.sync, gp.server = DataParallel.name, None
        return gp

    def collective(self, gp: GroupPlan) -> Collective | None:
        c = Collective(self.collective_op, tuple(gp.devices), self.server(gp))
        return c if len(c.members) > 1 else None

