"""The modules the laws train when the caller gives none: small, seeded, each with a trap.

- `mlp`: the plain case;
- `batchnorm_mlp`: BatchNorm buffers, whose running statistics a strategy must
  keep as it promises (broadcast from rank 0, or per rank) and must save;
- `tied_mlp`: one weight shared by two layers, which a strategy must keep one
  tensor through wrap, training and a checkpoint.

Each takes four input features and returns two outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["batchnorm_mlp", "default_modules", "mlp", "tied_mlp"]


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return build()
    finally:
        torch.random.set_rng_state(state)


def mlp() -> torch.nn.Module:
    """Return a seeded ``Linear(4, 8) -> Tanh -> Linear(8, 2)``."""
    return _seeded(
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    )


def batchnorm_mlp() -> torch.nn.Module:
    """Return a seeded MLP with a ``BatchNorm1d`` (no bias before it, as real networks do)."""
    return _seeded(
        lambda: torch.nn.Sequential(
            torch.nn.Linear(4, 8, bias=False),
            torch.nn.BatchNorm1d(8),
            torch.nn.Tanh(),
            torch.nn.Linear(8, 2),
        )
    )


def _tied() -> torch.nn.Module:
    # A Sequential, not a class of our own: nothing in lib/ subclasses torch.nn.Module.
    layers = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 4),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 2),
    )
    layers[2].weight = layers[0].weight  # one tensor, two layers: as an embedding and its output
    return layers


def tied_mlp() -> torch.nn.Module:
    """Return a seeded MLP whose first two layers share one weight."""
    return _seeded(_tied)


def default_modules() -> dict[str, torch.nn.Module]:
    """Return the laws' default modules by name."""
    return {"mlp": mlp(), "batchnorm": batchnorm_mlp(), "tied": tied_mlp()}
