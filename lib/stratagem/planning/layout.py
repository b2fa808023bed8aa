"""`Layout`: how a wrapped model is split, read from its FSDP states and its DTensor parameters.

The collective-count law derives the collectives a step must issue from it.
FSDP2 keeps its groups' settings in private attributes; they are read here
only, so one place follows torch when they move.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

__all__ = ["Layout", "read_layout"]


@attrs.frozen(kw_only=True)
class Layout:
    """How a wrapped model is split across ranks.

    Attributes:
        fsdp_units: FSDP groups that hold parameters (each ``fully_shard`` call).
        resharded_units: of those, the groups freed after forward, so gathered
            again for backward.
        shard_size: ranks each FSDP group shards over (1: none).
        replicas: replicas of each shard across which HSDP all-reduces (1: none).
        row_splits: linear layers that tensor parallelism splits row-wise (their
            weight is ``Shard(1)`` on the ``"tp"`` mesh dimension).
        column_splits: linear layers split column-wise (``Shard(0)`` on ``"tp"``).
        tp_size: ranks in each tensor-parallel group (1: none).
    """

    fsdp_units: int = 0
    resharded_units: int = 0
    shard_size: int = 1
    replicas: int = 1
    row_splits: int = 0
    column_splits: int = 0
    tp_size: int = 1


def read_layout(module: torch.nn.Module, tp: str = "tp") -> Layout:
    """Read how ``module`` (wrapped, and after one step: FSDP settles its root lazily) is split.

    ``tp`` is what the mesh calls its tensor-parallel dimension (``ctx.mesh_names.tp``).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    groups: list[Any] = []  # FSDP2's groups that hold parameters
    placements: list[object] = []  # on "tp", of each tensor-parallel linear layer's weight
    tp_size = 1
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            group = sub._get_fsdp_state()._fsdp_param_group  # noqa: SLF001  # FSDP2's group
            if group is not None:
                groups.append(group)
        weight = getattr(sub, "weight", None)
        if isinstance(sub, torch.nn.Linear) and isinstance(weight, DTensor):
            names = weight.device_mesh.mesh_dim_names or ()
            if tp in names:
                dim = names.index(tp)
                tp_size = weight.device_mesh.size(dim)
                placements.append(weight.placements[dim])
    mesh = groups[-1].mesh_info if groups else None  # the last group's, as for tp_size
    return Layout(
        fsdp_units=len(groups),
        resharded_units=sum(group.post_forward_mesh_info is not None for group in groups),
        shard_size=getattr(mesh, "shard_mesh_size", 1),
        replicas=getattr(mesh, "replicate_mesh_size", 1),
        row_splits=placements.count(Shard(1)),
        column_splits=placements.count(Shard(0)),
        tp_size=tp_size,
    )
