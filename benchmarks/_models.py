"""The modules the benchmark builds remotely, importable by name in every process.

``SeededLinear`` is the RemoteModule case's ``Linear(16, 16)``; the split model (``Stage`` x 2 on two
workers, ``Head`` local) is the training case's. Each seeds its own weights, so whichever process builds it
gets the same numbers, and every system's first output or loss can be checked against the others.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH = 32  # both cases
LR, MOMENTUM = 0.01, 0.9  # the training case's SGD


class SeededLinear(nn.Linear):
    """``Linear(16, 16)`` with the same weights wherever it is built."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(16, 16)


def linear_input() -> torch.Tensor:
    return torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(1))


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


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()
