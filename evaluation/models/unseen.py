"""Models outside TAG's zoo, for benchmarks that must hold "for models you have not seen".

User-factory workloads (``evaluation/models/unseen.py:mixer``): each function takes ``batch_size``
and returns ``(model, inputs)`` with ``model(*inputs)`` a scalar loss, built from plain
``torch.nn`` pieces the zoo does not use (token-mixing MLPs with GELU and LayerNorm over
transposed activations; ``nn.TransformerEncoder`` with its own multi-head attention).
"""

from __future__ import annotations

import torch
from torch import nn


class Mixer(nn.Module):
    """MLP-Mixer (Tolstikhin et al. 2021, arXiv 2105.01601) on random patch embeddings.

    inputs: patches [B, tokens, dim] float, labels [B] int64 in [0, classes)."""

    def __init__(self, tokens: int = 16, dim: int = 64, hidden: int = 128, depth: int = 4, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.LayerNorm(dim),
                "tok": nn.Sequential(nn.Linear(tokens, hidden), nn.GELU(), nn.Linear(hidden, tokens)),
                "norm2": nn.LayerNorm(dim),
                "ch": nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)),
            }))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b["tok"](b["norm1"](x).transpose(1, 2)).transpose(1, 2)  # mix over tokens
            x = x + b["ch"](b["norm2"](x))  # mix over channels
        return nn.functional.cross_entropy(self.head(self.norm(x).mean(dim=1)), labels)


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (pre-norm, GELU) over random token embeddings, mean-pooled classifier.

    inputs: tokens [B, seq] int64 in [0, vocab), labels [B] int64 in [0, classes)."""

    def __init__(self, vocab: int = 1000, seq: int = 32, dim: int = 64, heads: int = 4, depth: int = 2,
                 classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos)
        return nn.functional.cross_entropy(self.head(h.mean(dim=1)), labels)


def mixer(batch_size: int = 16):
    g = torch.Generator().manual_seed(1)
    return Mixer(), (torch.randn(batch_size, 16, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g))


def encoder(batch_size: int = 16):
    g = torch.Generator().manual_seed(1)
    return Encoder(), (torch.randint(0, 1000, (batch_size, 32), generator=g),
                       torch.randint(0, 10, (batch_size,), generator=g))
