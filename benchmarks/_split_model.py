"""The split model of bench_training.py, in a module of its own so that every process imports it by name."""

from __future__ import annotations

import torch
from torch import nn

BATCH = 32


class Stage(nn.Module):
    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same weights in whichever process builds it
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Head(nn.Module):
    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 64, generator=generator), torch.randn(BATCH, 1, generator=generator)
