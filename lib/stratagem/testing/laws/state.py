"""Whole training state by key, and comparing it with tolerances: what the training laws report.

A snapshot is a flat ``{key: tensor}`` of everything a run would lose if it
were wrong: the module's parameters and buffers (``model.0.weight``,
``model.1.running_mean``, whole even when sharded) and the optimizer's state
by parameter name (``optimizer.0.weight.exp_avg``), whatever order or
sharding the optimizer keeps it in.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from stratagem.checkpoint import unwrap
from stratagem.optimizer_hooks import root_optimizer

__all__ = ["Difference", "first_difference", "hint", "snapshot"]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    gather = getattr(tensor, "full_tensor", None)  # a DTensor shard: the whole tensor
    return (gather() if callable(gather) else tensor).detach().cpu().clone()


def snapshot(module: torch.nn.Module, optimizer: Any | None = None) -> dict[str, torch.Tensor]:
    """Return the whole state of a (wrapped) module and its optimizer, by key.

    Every rank of a sharded module must call it (gathering a shard is a
    collective). Optimizer slots are keyed by the parameter's name in the
    module, so two optimizers that order or shard their state differently
    still compare key by key.
    """
    plain = unwrap(module)
    state = {f"model.{k}": _whole(v) for k, v in plain.state_dict(keep_vars=True).items()}
    if optimizer is not None:
        names = {id(p): n for n, p in plain.named_parameters(remove_duplicate=False)}
        root = root_optimizer(optimizer)
        local = getattr(root, "optim", None)  # ZeroRedundancyOptimizer: this rank's own part
        slots = (local if isinstance(local, torch.optim.Optimizer) else root).state
        for parameter, values in slots.items():
            name = names.get(id(parameter), f"<unnamed {tuple(parameter.shape)}>")
            for slot, value in values.items():
                if isinstance(value, torch.Tensor):
                    state[f"optimizer.{name}.{slot}"] = _whole(value)
    return state


@attrs.frozen
class Difference:
    """Where a state first departs from the reference, and by how much."""

    key: str
    absolute: float
    relative: float
    ours: torch.Tensor | None
    theirs: torch.Tensor | None

    def describe(self, against: str = "the reference") -> str:
        """Return ``key``, absolute and relative difference, as a report line."""
        if self.ours is None:
            return f"{self.key} is missing ({against} has it)"
        if self.theirs is None:
            return f"{self.key} is not in {against}"
        if self.ours.shape != self.theirs.shape:
            shapes = f"{tuple(self.ours.shape)}, {against} {tuple(self.theirs.shape)}"
            return f"{self.key} has shape {shapes}"
        return f"{self.key} differs by {self.absolute:.3g} (relative {self.relative:.3g})"


def _compare(key: str, ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    if ours.shape != theirs.shape:
        return math.inf, math.inf
    if ours.numel() == 0:
        return 0.0, 0.0
    a, b = ours.detach().cpu().double(), theirs.detach().cpu().double()
    absolute = float((a - b).abs().max())
    scale = float(b.abs().max())
    return absolute, absolute / scale if scale > 0 else (math.inf if absolute > 0 else 0.0)


def first_difference(
    ours: dict[str, torch.Tensor],
    theirs: dict[str, torch.Tensor],
    *,
    rtol: float,
    atol: float,
    keys: tuple[str, ...] | None = None,
    outliers: float = 0.0,
) -> Difference | None:
    """Return the first key (in the reference's order) where ``ours`` is not within tolerance.

    ``|ours - theirs| <= atol + rtol * |theirs|`` elementwise, as ``torch.allclose``,
    on the CPU wherever the tensors live; a tensor with at most ``outliers`` of
    its elements (a fraction) outside, each of them finite, passes (`law_outliers`).
    """
    wanted = keys if keys is not None else tuple(theirs)
    for key in wanted:
        if key not in ours or key not in theirs:
            return Difference(key, math.inf, math.inf, ours.get(key), theirs.get(key))
        a, b = ours[key].detach().cpu(), theirs[key].detach().cpu()  # compared on the CPU
        if a.shape != b.shape:
            return Difference(key, math.inf, math.inf, a, b)
        far = ~torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True)
        # Outliers are rounding's: a NaN or an infinity where the reference has none never is.
        if bool(far.any()) and (
            int(far.sum()) > outliers * far.numel() or not bool(a[far].isfinite().all())
        ):
            absolute, relative = _compare(key, a, b)
            return Difference(key, absolute, relative, a, b)
    extra = [key for key in ours if key not in theirs and keys is None]
    if extra:
        return Difference(extra[0], math.inf, math.inf, ours[extra[0]], None)
    return None


def hint(
    difference: Difference,
    start: dict[str, torch.Tensor],
    ranks_agree: bool,
    world_size: int,
) -> str:
    """Read a likely cause off the pattern of a difference.

    Ranks that differ from each other point at a missing broadcast or sync; an
    update whose size is the world size times the reference's, at a sum taken
    for a mean; one over the world size, at a division made twice.
    """
    if not ranks_agree:
        if difference.key.startswith("model.") and "running" in difference.key:
            return "the ranks hold different buffers: are buffers synchronised (or broadcast)?"
        return (
            "the ranks hold different values: a wrap that does not broadcast rank 0's "
            "weights, or an update that skips synchronising gradients, gives this"
        )
    ours, theirs, before = difference.ours, difference.theirs, start.get(difference.key)
    if ours is None or theirs is None or ours.shape != theirs.shape:
        if ours is None and difference.key.startswith("model."):
            return "the strategy lost this entry of the module's state"
        return "the state's keys or shapes differ from the reference's"
    if before is None:  # optimizer state appears with the first step
        before = torch.zeros_like(theirs)
    moved_ours = (ours.double() - before.double()).flatten()
    moved_theirs = (theirs.double() - before.double()).flatten()
    usable = moved_theirs.abs() > 1e-12
    if bool(usable.any()) and world_size > 1:
        ratio = float((moved_ours[usable] / moved_theirs[usable]).median())
        if abs(ratio - world_size) < 0.1 * world_size:
            return (
                f"updates are {ratio:.3g}x the reference's: a sum where a mean belongs (or a "
                "loss or gradient scaled by the world size)?"
            )
        if abs(ratio - 1 / world_size) < 0.1 / world_size:
            return f"updates are {ratio:.3g}x the reference's: divided by the world size twice?"
        if abs(ratio) < 1e-6:
            return "the state did not change where the reference's did: a step that was skipped?"
    return "the ranks agree with each other but not with the reference"
