"""The per-step functions every built-in shares: place, forward, backward, update.

A built-in substitutes only what differs (``ddp`` wraps the module, for
example); these are the plain-PyTorch meaning of each field.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from stratagem.env import Context
from stratagem.errors import UsageError, describe
from stratagem.fields import ForwardFn

__all__ = ["backward", "move_to_device", "no_sync", "step", "to_device", "update"]


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Return ``batch`` with every tensor inside it moved to ``device``.

    Looks inside tuples (named ones too), lists, dicts and dataclass instances;
    anything else is returned as it is. A tensor already on ``device`` is not copied.
    """
    # The common cases first, with cheap checks: this runs on every step.
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, tuple):
        moved = [move_to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if isinstance(batch, list):
        return [move_to_device(v, device) for v in batch]
    if isinstance(batch, Mapping):
        return type(batch)({k: move_to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: move_to_device(getattr(batch, f.name), device)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def to_device(module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
    """Move ``module`` to ``ctx.device`` (the ``wrap`` of a single device).

    Raises:
        UsageError: ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"wrap: 'module' must be a torch.nn.Module (got {describe(module)}).")
    return module.to(ctx.device)


def step(
    module: torch.nn.Module, batch: Any, ctx: Context, *, forward: ForwardFn | None = None
) -> Any:
    """Move ``batch`` to the device and run ``forward(module, batch)`` (default ``module(batch)``).

    Put loss logic in ``forward`` rather than substituting ``step``: a
    combinator's forward context (autocast, ...) wraps this function.
    """
    batch = move_to_device(batch, ctx.device)
    if forward is None:
        return module(batch)
    return forward(module, batch)


def backward(loss: torch.Tensor, module: torch.nn.Module, ctx: Context) -> None:
    """Backpropagate a scalar ``loss``.

    Raises:
        UsageError: ``loss`` is not a one-element tensor that requires grad.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shown = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else describe(loss)
        )
        raise UsageError(
            f"backward: 'loss' must be a one-element tensor (got {shown}); reduce it first, "
            "e.g. loss.mean()."
        )
    if not loss.requires_grad:
        raise UsageError(
            "backward: 'loss' does not require grad: it was computed without the module's "
            "parameters, under torch.no_grad(), or after .detach()."
        )
    torch.autograd.backward(loss)


def update(optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context) -> None:
    """Step ``optimizer``, then set the gradients to ``None``."""
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def no_sync(module: torch.nn.Module, ctx: Context) -> contextlib.AbstractContextManager[None]:
    """Return a context that does nothing: one process has no gradients to synchronise."""
    return contextlib.nullcontext()
