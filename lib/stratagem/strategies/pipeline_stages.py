"""Splitting a module into pipeline stages: the split's checks, the stage views, the wrap field.

``wrap`` returns a *view* of the user's module that holds only this rank's
stages' submodules, at their original names (``state_dict`` keys are the
unsplit module's, as torchtitan's splitting keeps them). The view shares its
kept submodules, and so its parameters, with the module it was given: as
``ddp()`` trains the given module in place, so does a pipeline. The torch
``PipelineStage`` and schedule objects that run the view are per-run state,
kept in `PipelineRun`, found from the view with `run_of`.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from stratagem import training
from stratagem.env import Context
from stratagem.errors import UsageError, describe, with_submodules
from stratagem.fields import ForwardFn
from stratagem.meshes import mesh_with
from stratagem.parts import Part, hold_part
from stratagem.replicas import copy_rank0
from stratagem.strategies.pipeline_loss import MicroLoss
from stratagem.strategies.pipeline_schedules import (
    SCHEDULES,
    check_microbatches,
    check_stage_count,
    default_stage_count,
    rank_of_stage,
    schedule_class,
    stages_of_rank,
)
from stratagem.validators import require

__all__ = [
    "NOT_A_PIPELINE_MODULE",
    "PipelineRun",
    "PipelineWrap",
    "Split",
    "StageFn",
    "check_split",
    "run_of",
    "stage_view",
]

StageFn = Callable[[torch.nn.Module, int, int], torch.nn.Module]
"""``(module, stage_index, num_stages) -> stage module``: a user's own split (one stage a rank)."""

Split = tuple[tuple[str, ...], ...] | StageFn
"""Module paths per stage, in forward order, or a `StageFn`."""

NOT_A_PIPELINE_MODULE = (
    "{function}: 'module' must be the module that a pipeline strategy's wrap returned "
    "(got {got}); a pipeline's step, backward, update and no_sync find the stages and "
    "schedule of the module wrap returned, and of no other."
)

_RUNS: weakref.WeakKeyDictionary[torch.nn.Module, PipelineRun] = weakref.WeakKeyDictionary()


@attrs.define(eq=False)
class PipelineRun:
    """One rank's part of a running pipeline: its stages, the schedule, the step in flight.

    Attributes:
        schedule: the torch schedule object.
        stages: this rank's ``PipelineStage`` objects, in stage order.
        first: whether this rank holds the first stage (it feeds the inputs).
        last: whether it holds the last stage (it computes the loss).
        microbatches: micro-batches per step.
        pp_group: the process group of this rank's pipeline.
        last_rank: the global rank that holds this pipeline's last stage.
        dp_group: the group of this rank's data-parallel replicas, None without any.
        dp_size: the number of those replicas (1 without any).
        stages_held: the indices of this rank's stages.
        forward: the user's forward of the step in flight.
        chunks: the micro-batches of the step in flight.
        loss: the loss the last step returned (what backward must be given).
    """

    schedule: Any
    stages: list[Any]
    first: bool
    last: bool
    microbatches: int
    pp_group: Any
    last_rank: int
    dp_group: Any
    dp_size: int
    stages_held: tuple[int, ...]
    forward: ForwardFn | None = None
    chunks: list[Any] = attrs.Factory(list)
    loss: torch.Tensor | None = None


def run_of(module: object, function: str) -> PipelineRun:
    """Return the `PipelineRun` of a module a pipeline's wrap returned.

    Raises:
        UsageError: ``module`` is not one (`NOT_A_PIPELINE_MODULE`).
    """
    run = _RUNS.get(module) if isinstance(module, torch.nn.Module) else None
    if run is None:
        raise UsageError(NOT_A_PIPELINE_MODULE.format(function=function, got=describe(module)))
    return run


def _covers(path: str, name: str) -> bool:
    return name == path or name.startswith(path + ".")


def check_split(module: torch.nn.Module, split: tuple[tuple[str, ...], ...]) -> None:
    """Check that ``split`` names submodules of ``module`` that hold each tensor exactly once.

    Raises:
        UsageError: a path names no submodule, or a parameter or buffer belongs
            to no stage or to two; the message lists the submodules there are.
    """
    for index, paths in enumerate(split):
        for path in paths:
            try:
                module.get_submodule(path)
            except AttributeError:
                raise UsageError(
                    f"pipeline: stages[{index}] names {path!r}, which is no submodule of "
                    f"{with_submodules(module)}; use paths as model.named_modules() gives them."
                ) from None
    owners: dict[str, list[int]] = {}
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
    for name, _ in tensors:
        owners[name] = [i for i, paths in enumerate(split) if any(_covers(p, name) for p in paths)]
    orphans = [name for name, held in owners.items() if not held]
    if orphans:
        raise UsageError(
            f"pipeline: {orphans[:8]} of {type(module).__name__} belong to no stage, so no "
            "rank would hold or train them; add the submodules that hold them to 'stages', or "
            "split with a function (module, stage_index, num_stages) -> module."
        )
    shared = {name: held for name, held in owners.items() if len(held) > 1}
    if shared:
        name, held = next(iter(shared.items()))
        raise UsageError(
            f"pipeline: {name!r} belongs to stages {held}; a tensor can live in one stage only "
            "(tied weights across stages are not supported): give each submodule to one stage."
        )


def _pruned(module: torch.nn.Module, prefix: str, keep: set[str]) -> torch.nn.Module:
    if prefix in keep:
        return module  # shared: the view trains the given module's own parameters
    view = copy.copy(module)  # its _parameters and _buffers dicts are shared, not copied
    children: dict[str, torch.nn.Module | None] = {}
    for name, child in module._modules.items():  # noqa: SLF001  # the one way to prune a copy
        path = f"{prefix}.{name}" if prefix else name
        if child is not None and any(_covers(path, kept) for kept in keep):
            children[name] = _pruned(child, path, keep)
    view.__dict__["_modules"] = children
    return view


def stage_view(module: torch.nn.Module, paths: Sequence[str]) -> torch.nn.Module:
    """Return a view of ``module`` that holds only the submodules at ``paths``, at their names.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> sorted(stage_view(model, ["1"]).state_dict())
        ['1.bias', '1.weight']
    """
    return _pruned(module, "", set(paths))


@attrs.frozen
class PipelineWrap:
    """Wrap field: copy rank 0's weights everywhere, keep this rank's stages, build the schedule."""

    split: Split
    schedule: str
    microbatches: int

    def stage_count(self, size: int) -> int:
        """Return the number of stages of a pipeline of ``size`` ranks."""
        if callable(self.split):
            return default_stage_count(self.schedule, size)
        return len(self.split)

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        from torch.distributed.pipelining import PipelineStage

        require(isinstance(module, torch.nn.Module), "wrap: 'module'", "a torch.nn.Module", module)
        if not callable(self.split):
            check_split(module, self.split)  # the same module everywhere: every rank raises
        mesh, names = mesh_with(ctx, "pp", "wrap", "pipeline")
        pp_mesh, replicate = mesh[names.pp], names.replicate
        size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        count = self.stage_count(size)
        check_stage_count(self.schedule, count, size)
        check_microbatches(self.schedule, self.microbatches, count, size)
        module = training.to_device(module, ctx)
        copy_rank0(module, ctx)
        held = stages_of_rank(self.schedule, count, size, pp_rank)
        group = pp_mesh.get_group()
        if callable(self.split):
            view = self.split(module, held[0], count)
            require(
                isinstance(view, torch.nn.Module),
                "wrap: the pipeline's stage function",
                "to return the stage's module",
                view,
            )
            parts = [view]
        else:
            split = self.split
            view = stage_view(module, [p for s in held for p in split[s]])
            parts = [torch.nn.Sequential(*(view.get_submodule(p) for p in split[s])) for s in held]
        stages = [
            PipelineStage(part, index, count, ctx.device, group=group)
            for part, index in zip(parts, held, strict=True)
        ]
        dp_group, dp_size, first_replica = None, 1, int(pp_mesh.mesh[pp_rank])
        if replicate in (mesh.mesh_dim_names or ()) and mesh[replicate].size() > 1:
            dp_group, dp_size = mesh[replicate].get_group(), mesh[replicate].size()
            first_replica = int(mesh.mesh[0, pp_rank])  # this stage's copy in the first pipeline
        last_rank = rank_of_stage(self.schedule, count - 1, count, size)
        run = PipelineRun(
            schedule=None,
            stages=stages,
            first=0 in held,
            last=count - 1 in held,
            microbatches=self.microbatches,
            pp_group=group,
            last_rank=int(pp_mesh.mesh.flatten()[last_rank]),
            dp_group=dp_group,
            dp_size=dp_size,
            stages_held=tuple(held),
        )
        cls = schedule_class(self.schedule)
        run.schedule = cls(
            stages if SCHEDULES[self.schedule].multi else stages[0],
            n_microbatches=self.microbatches,
            loss_fn=MicroLoss(run),
            scale_grads=True,  # each micro-batch's mean loss / microbatches: the batch's mean
        )
        _RUNS[view] = run
        if size > 1:  # other ranks hold the other stages: save each stage once, by its names
            hold_part(view, Part(first_replica == ctx.rank, first_replica, group))
        return view
