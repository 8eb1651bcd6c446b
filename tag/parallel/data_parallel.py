"""Data parallel with all-reduce (``GroupPlan.sync == "allreduce"``).

Every device of ``GroupPlan.devices`` is a replica running the whole op-group on its share of
the global batch (``local_batches``: contiguous sample ranges in device order). After the
group's backward its parameter gradients are summed over the replicas with one all-reduce (ring
or hierarchical, :mod:`tag.cost.comm`), then every replica applies the optimizer.
"""

from __future__ import annotations

import numpy as np

from ..cost.comm import ring_allreduce_time, uniform_ps_time
from ..plan.format import GroupPlan
from .strategy import Collective, SearchTable, Strategy, Unit, check_shares, no_field, sample_replicas


class DataParallel(Strategy):
    name = "allreduce"
    search_pass = 0
    feature_sync = "allreduce"
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

    def sfb_op(self) -> str | None:
        """Replicas of the whole group summing their gradients by :attr:`collective_op`: SFB may
        replace part of that sync."""
        return self.collective_op

    def collective(self, gp: GroupPlan) -> Collective | None:
        c = Collective(self.collective_op, tuple(gp.devices), self.server(gp))
        return c if len(c.members) > 1 else None


    # ---- the search's actions (see Strategy.search_options)
    def search_options(self, devices: tuple[int, ...], family: str, space) -> list:
        """One action on every subset, a single device included (one replica, nothing to sync)."""
        return [None]

    def search_plan(self, space, g: int, devices: tuple[int, ...], option) -> GroupPlan:
        """Replicas on every device of ``devices``, batch shares proportional to the group's speed
        on each (``1 / t_group(device)``, full batch), the last share closing the sum to 1."""
        devs = list(devices)
        if len(devs) == 1:
            return GroupPlan(devs, [1.0], DataParallel.name)
        rate = 1.0 / np.maximum(space.costs.group_time_full[g][devs], 1e-15)
        shares = (rate / rate.sum()).tolist()
        shares[-1] = 1.0 - sum(shares[:-1])
        return GroupPlan(devs, shares, self.name, self.search_server(space, devices, option))

    def search_key(self, space, g: int, devices: tuple[int, ...], option) -> tuple:
        """Shares and server are functions of (group, subset): the subset and the normalised sync
        (:meth:`normalise`: all-reduce on one replica or without parameters) identify the plan."""
        if len(devices) == 1 or space.costs.param_bytes[g] == 0:
            return (devices, DataParallel.name)
        return (devices, self.name)

    def search_estimate(self, space, g: int, devices: tuple[int, ...], option, plan: GroupPlan, bmin: float,
                        lmax: float) -> tuple[float, float, float]:
        """Replicas synchronised by a ring all-reduce over the slowest link (a parameter server:
        :meth:`Strategy.search_estimate`)."""
        if self.collective_op != "allreduce":
            return super().search_estimate(space, g, devices, option, plan, bmin, lmax)
        sync = 0.0 if len(devices) == 1 else ring_allreduce_time(len(devices), space.costs.param_bytes[g], bmin, lmax)
        return self.replicated_estimate(space, g, devices, sync)

    def search_table(self, space, devices: tuple[int, ...], option, bmin: float, lmax: float) -> SearchTable:
        """:meth:`search_plan` and :meth:`search_estimate` of every group at once (the same
        operations per row: shares over each row's summed rates, the last closing the row's running
        sum to 1)."""
        if not self._search_inherited(DataParallel, ("search_plan", "search_estimate", "replicated_estimate")):
            return super().search_table(space, devices, option, bmin, lmax)
        c, k, n = space.costs, space.num_groups, len(devices)
        devs = np.broadcast_to(np.asarray(devices, dtype=np.int64), (k, n))
        if n == 1:
            shares, server = np.ones((k, 1)), np.full(k, -1, dtype=np.int64)
        else:
            rate = 1.0 / np.maximum(np.ascontiguousarray(c.group_time_full[:, list(devices)]), 1e-15)  # [K, n]
            shares = rate / rate.sum(axis=1, keepdims=True)
            shares[:, -1] = 1.0 - np.cumsum(shares[:, :-1], axis=1)[:, -1]  # (the plan's left-to-right sum)
            srv = self.search_server(space, devices, option)
            server = np.full(k, -1 if srv is None else srv, dtype=np.int64)
        if n == 1:
            sync = 0.0
        elif self.collective_op == "allreduce":
            sync = ring_allreduce_time(n, c.param_bytes, bmin, lmax)
        else:
            sync = uniform_ps_time(n, c.param_bytes, bmin, lmax)
        return SearchTable(devs, shares, server, self.replicated_estimates(space, devices, sync))

