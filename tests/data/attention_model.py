"""Test model outside the zoo: one pre-norm transformer layer whose attention is
``F.scaled_dot_product_attention`` (causal, called directly rather than through Hugging Face's
``attn_implementation``), a GELU MLP, a mean-pooled classifier (tests/test_executor.py,
tests/test_tensor_parallel.py).

inputs: ids [B, 12] int64 in [0, 50), labels [B] int64 in [0, 5)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

SEQ, DIM, HEADS, VOCAB, CLASSES = 12, 32, 4, 50, 5


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)  # q, k and v side by side (as GPT-2's c_attn)
        self.out = nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, t, d / heads]
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return F.cross_entropy(self.head(x.mean(1)), labels)


def make(batch_size: int = 8):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return Attention(), (ids, torch.randint(0, CLASSES, (batch_size,), generator=g))
