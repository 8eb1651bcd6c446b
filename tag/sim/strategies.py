"""Strategies the simulator costs in a way of their own, looked up by name.

The simulator costs a group from its strategy's lowering (:meth:`tag.parallel.Strategy.units` and
:meth:`~tag.parallel.Strategy.collective`): a unit over the whole group on a batch split, or
position chunks on one device each, then the gradient collective. A strategy whose cost is not
that (tensor parallelism: split blocks with blocking all-reduces inside its stages, on a layout
of its own) registers a **group costing** here under its name (``GroupPlan.sync``), and
:meth:`tag.sim.Simulator.group_data` calls it instead; nothing in the engine names the strategy.
The built-in one is ``tp`` (:mod:`tag.sim.tensor_parallel`, registered when :mod:`tag.sim` is
imported). docs/design.md "Adding a strategy".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..parallel.registry import Registry

if TYPE_CHECKING:
    from ..parallel import Unit
    from ..plan.format import GroupPlan
    from .engine import Simulator
    from .units import GroupData

GroupCosting = Callable[["Simulator", int, "GroupPlan", "list[Unit]"], "GroupData"]
"""``costing(sim, g, gp, units) -> GroupData``: group ``g`` deployed as ``gp``, ``units`` its
strategy's lowering at the batch the simulator runs (the graph's, or a pipeline's micro-batch).
Its result is cached by the simulator per deployment; its own caches may live in
:meth:`Simulator.cache <tag.sim.Simulator.cache>` (each entry's approximate bytes counted by
:meth:`Simulator.charge <tag.sim.Simulator.charge>`, layouts kept by
:meth:`Simulator.store_layout <tag.sim.Simulator.store_layout>`: they are emptied with the
simulator's own past :attr:`Simulator.cache_bytes <tag.sim.Simulator.cache_bytes>`)."""

_COSTINGS: Registry[GroupCosting] = Registry("group costing")


def register_costing(name: str, costing: GroupCosting) -> GroupCosting:
    """Cost the groups of strategy ``name`` with ``costing`` (replacing any earlier one)."""
    return _COSTINGS.register(costing, name)


unregister_costing = _COSTINGS.unregister
"""``unregister_costing(name)``: back to the lowering's costing for strategy ``name`` (no error if
it had none)."""
costing_of = _COSTINGS.find
"""``costing_of(name)``: the group costing registered for strategy ``name``, or None (the
lowering's)."""


__all__ = ["GroupCosting", "costing_of", "register_costing", "unregister_costing"]
