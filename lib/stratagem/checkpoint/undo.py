"""Keep what a load may change in the live objects, to put it back if the load fails half way.

A load reads tensors into the live ones in place, then hands each object its
state. Everything read is vetted first, but an object's own ``load_state_dict``
(a scheduler built with other parts, an optimizer's load hook, a user's check)
can refuse its state after others were written: the live objects are then put
back as they were, so that a failed load changes nothing. The tensors are kept
as host copies of this rank's part, so a load holds one extra copy of the live
state in host memory until it ends; nothing is kept on the accelerator.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import attrs
import torch

from stratagem.checkpoint.entries import Entry, leaf_paths


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """Return this rank's part of ``tensor`` (itself unless it is a DTensor), sharing its memory."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@attrs.frozen
class Kept:
    """What a load may change: tensors with host copies, optimizers' slots and groups, states."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    optimizers: list[tuple[torch.optim.Optimizer, Any, dict[Any, Any], list[Any], list[Any]]]
    objects: list[tuple[str, Any, Any]]


def keep(entries: list[Entry], templates: dict[str, Any], objects: dict[str, Any]) -> Kept:
    """Copy what loading ``templates`` and ``objects`` into ``entries`` may change."""
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each tensor once, by identity

    def hold(tensor: torch.Tensor) -> None:
        if id(tensor) not in tensors:
            local = _local(tensor)
            tensors[id(tensor)] = (local, local.detach().to("cpu", copy=True))

    for template in templates.values():
        for _, leaf in leaf_paths(template):
            if isinstance(leaf, torch.Tensor):
                hold(leaf)
    optimizers = []
    for entry in entries:
        if entry.kind == "optimizer" and entry.name in templates:
            optimizer = cast(torch.optim.Optimizer, entry.target)
            slots: dict[Any, Any] = {}
            for parameter, values in optimizer.state.items():
                slots[parameter] = dict(values)
                for value in values.values():
                    if isinstance(value, torch.Tensor):
                        hold(value)
            groups = list(optimizer.param_groups)
            settings = [
                {k: (v if k == "params" else copy.deepcopy(v)) for k, v in g.items()}
                for g in groups
            ]
            optimizers.append((optimizer, optimizer.state, slots, groups, settings))
    states = [
        (e.name, e.target, _copied(e.target.state_dict())) for e in entries if e.name in objects
    ]
    return Kept(list(tensors.values()), optimizers, states)


def _copied(state: Any) -> Any:
    try:
        return copy.deepcopy(state)
    except Exception:  # an object whose state does not copy: its state_dict is a fresh one
        return state


def put_back(kept: Kept) -> list[str]:
    """Restore what ``kept`` holds; return the names of objects that refused their old state."""
    with torch.no_grad():
        for live, host in kept.tensors:
            live.copy_(host)
    for optimizer, state, slots, groups, settings in kept.optimizers:
        state.clear()
        state.update(slots)
        optimizer.state = state
        for group, setting in zip(groups, settings, strict=True):
            group.clear()
            group.update(setting)
        optimizer.param_groups = groups
    refused = []
    for name, target, state in kept.objects:
        try:
            target.load_state_dict(state)
        except Exception:  # reported by name; the load's own error is the one raised
            refused.append(name)
    return refused
