"""A small mixture-of-experts model for the expert-parallel tests: top-1 routing, stacked experts.

The experts module follows the contract ``expert_parallel`` documents
(torchtitan's grouped experts): ``forward(tokens, counts)``, tokens sorted by
expert, weights stacked along dimension 0 and read with ``.to_local()`` when
they are DTensors.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

WIDTH, HIDDEN, EXPERTS = 16, 24, 4


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Experts(torch.nn.Module):
    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(experts, WIDTH, HIDDEN) / WIDTH**0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, HIDDEN, WIDTH) / HIDDEN**0.5)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        up, down = local(self.up), local(self.down)
        rows = torch.split(tokens, counts.tolist())
        out = [torch.nn.functional.gelu(x @ up[i]) @ down[i] for i, x in enumerate(rows)]
        return torch.cat(out)


class MoE(torch.nn.Module):
    """Route each token to its best expert; scale the expert's output by the router's weight."""

    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.router = torch.nn.Linear(WIDTH, experts, bias=False)
        self.experts = Experts(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, WIDTH)
        weight, choice = torch.softmax(self.router(flat), dim=-1).max(dim=-1)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=self.router.out_features)
        out = self.experts(flat[order], counts)
        unsorted = torch.empty_like(out).index_copy(0, order, out)
        return x + (unsorted * weight[:, None]).view_as(x)


class Model(torch.nn.Module):
    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(WIDTH, WIDTH)
        self.moe = MoE(experts)
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.head(self.moe(torch.tanh(self.embed(x))))


def make_model(seed: int = 0, experts: int = EXPERTS) -> Model:
    torch.manual_seed(seed)
    return Model(experts)
