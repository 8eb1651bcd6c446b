"""The executor's optimizers: defined once in :mod:`tag.cost.optim`, which the profiler times."""

from ..cost.optim import ADAM_LR, SGD_LR, SGD_MOMENTUM, implementation, make_optimizer

__all__ = ["ADAM_LR", "SGD_LR", "SGD_MOMENTUM", "implementation", "make_optimizer"]
