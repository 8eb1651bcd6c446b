"""Data parallel with a parameter server (``GroupPlan.sync == "ps"``).

Replicas as :mod:`tag.parallel.data_parallel`; the gradients are reduced to ``GroupPlan.server``
(any device of the topology, a replica or not) and the sum broadcast back to every replica. The
executor issues the reduces as groups finish their backward and the broadcasts once every reduce
of the iteration was issued (:class:`tag.executor.comm.DistComm`); the simulator costs the pair
as one job (:meth:`tag.cost.comm.CommModel.ps_time`).
"""

from __future__ import annotations

from ..errors import PlanError
from ..plan.format import GroupPlan
from .data_parallel import DataParallel


class ParameterServer(DataParallel):
    name = "ps"
    collective_op = "ps"
    search_pass = 0
    feature_sync = "ps"

    def check_server(self, gp: GroupPlan, num_devices: int, where: str) -> None:
        s = gp.server
        if s is None or isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_devices:
            raise PlanError(f"{where}.server: expected a device index in 0..{num_devices - 1} for sync 'ps', "
                            f"got {s!r}")

    def server(self, gp: GroupPlan) -> int | None:
        return gp.server


    def search_options(self, devices: tuple[int, ...], family: str, space) -> list:
        """One action on subsets of two devices or more."""
        return [None] if len(devices) > 1 else []

    def search_server(self, space, devices: tuple[int, ...], option) -> int | None:
        """The subset's device with the most bandwidth to the others (``space.server_of``)."""
        return space.server_of(devices)
