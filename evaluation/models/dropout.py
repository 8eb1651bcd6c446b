"""A model with dropout, for the checks that the executor's random streams are seeded and that a
recomputed group draws its forward's masks again (``tests/test_recompute.py``,
``evaluation/gpu_check.py``).

``evaluation/models/dropout.py:make``: an MLP 8 -> 16 -> 16 -> 1 with dropout 0.5 and 0.3 after
its first two layers, a mean squared output as the loss; inputs ``[batch_size, 8]`` from a fixed
generator.
"""

from __future__ import annotations

import torch
from torch import nn


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(0.3),
                                 nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def make(batch_size: int = 8):
    """``(model, (x,))``: parameters from the caller's seed (``load_workload`` seeds factories)."""
    return DropoutMLP(), (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0)),)
