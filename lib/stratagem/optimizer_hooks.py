"""An optimizer seen through the combinators that act at its step (unscaling, clipping).

A combinator that must act just before the optimizer steps does not replace
``update``: it passes the inner ``update`` an `OptimizerHook` whose ``step``
runs the combinator's code around the real step. Below the combinators, so
that the checks of `stratagem.training` see the real optimizer through any
number of hooks (`root_optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from stratagem.errors import CombinatorError

__all__ = ["OptimizerHook", "root_optimizer"]


@attrs.define
class OptimizerHook:
    """An optimizer whose ``step`` goes through ``on_step(real_step)``; the rest is the optimizer's.

    Attributes:
        optimizer: the optimizer (or another hook) being wrapped.
        on_step: called with the wrapped ``step``; decides whether and how to call it.
    """

    optimizer: Any
    on_step: Callable[[Callable[[], Any]], Any]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise CombinatorError("stratagem combinators do not support optimizer closures.")
        return self.on_step(self.optimizer.step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> Any:
        """The wrapped optimizer's; read by every update's check, so not via ``__getattr__``."""
        return self.optimizer.param_groups

    def __getattr__(self, name: str) -> Any:
        # param_groups, state, state_dict, ...: the wrapped optimizer's own.
        if name in ("optimizer", "on_step"):  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def root_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Return the real optimizer under any number of `OptimizerHook` layers."""
    while isinstance(optimizer, OptimizerHook):
        optimizer = optimizer.optimizer
    return optimizer  # type: ignore[no-any-return]
