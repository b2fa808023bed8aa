"""``pipeline()``: pipeline parallelism, with ``torch.distributed.pipelining``'s schedules.

``pipeline()`` is ``ddp()`` with six fields substituted: the mesh's setup
(`JoinPipeline`, here), the split and the schedule as ``wrap``
(`stratagem.strategies.pipeline_stages`), the step that runs the schedule (and
so the backward, which ``backward`` only checks), the update that averages
data-parallel replicas and the ``no_sync`` that defers it
(`stratagem.strategies.pipeline_step`). Collectives, shard, checkpoints and
teardown are ``ddp()``'s. docs/pipeline.md explains why a pipeline's
``step`` runs the backward too and the training loop stays that of ``ddp()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard, Unpack, cast

import attrs

from stratagem.env import Context, Env, MeshNames, check_env
from stratagem.env import mesh_names as env_mesh_names
from stratagem.errors import UsageError
from stratagem.fields import BackwardInStep, SetupFn
from stratagem.process_group import JoinProcessGroup, WorldOptions
from stratagem.strategies.ddp import ddp
from stratagem.strategies.pipeline_schedules import (
    SCHEDULES,
    ScheduleName,
    check_microbatches,
    check_stage_count,
    default_stage_count,
)
from stratagem.strategies.pipeline_stages import PipelineWrap, Split, StageFn
from stratagem.strategies.pipeline_step import (
    pipeline_backward,
    pipeline_no_sync,
    pipeline_step,
    pipeline_update,
)
from stratagem.strategy import Strategy
from stratagem.validators import choice, field, is_int, positive_int, require

__all__ = ["JoinPipeline", "pipeline"]

_SCHEDULE = choice("pipeline: '{name}'", tuple(SCHEDULES))
MAX_MICROBATCHES = 2**16
_POSITIVE = positive_int("pipeline: '{name}'")
_AT_MOST = field(
    lambda v: v <= MAX_MICROBATCHES,
    "pipeline: '{name}'",
    f"at most {MAX_MICROBATCHES}",
    hint="; a batch splits into no more micro-batches than it has rows",
)
_MICROBATCHES = attrs.validators.and_(_POSITIVE, _AT_MOST)


PIPELINE_NAMES = MeshNames(replicate="dp")
"""A pipeline's mesh dimensions unless renamed: ``("dp", "pp")``."""


def pipeline_names(names: object) -> MeshNames:
    """Convert ``mesh_names=`` of `pipeline` (None, a mapping of roles, or `MeshNames`).

    Roles not given keep the pipeline's own names, ``"dp"`` and ``"pp"``.
    """
    if names is None:
        return PIPELINE_NAMES
    if isinstance(names, Mapping):
        return env_mesh_names({"replicate": PIPELINE_NAMES.replicate, **names})
    return env_mesh_names(names)


@attrs.frozen(kw_only=True)
class JoinPipeline:
    """Setup field: check the pipeline's shape against the world, join, add the mesh.

    The mesh is ``("pp",)`` of every rank, or ``("dp", "pp")`` with pipelines of
    ``size`` consecutive ranks; ``ctx.data_parallel`` is then the index of this
    rank's pipeline among the ``world / size`` replicas. ``names`` renames the
    two dimensions by role (`MeshNames`: ``replicate`` and ``pp``).
    """

    join: SetupFn = attrs.field(factory=JoinProcessGroup)
    schedule: str = attrs.field(default="1f1b", validator=_SCHEDULE)
    stages: int | None = attrs.field(
        default=None, validator=positive_int("JoinPipeline({name}=...)", optional="None")
    )
    microbatches: int = attrs.field(default=1, validator=_MICROBATCHES)
    size: int | None = attrs.field(
        default=None, validator=positive_int("pipeline: '{name}'", optional="None (every rank)")
    )
    names: MeshNames = attrs.field(default=PIPELINE_NAMES, converter=pipeline_names)

    def shape(self, env: Env) -> tuple[int, int]:
        """Return ``(replicas, ranks per pipeline)`` for ``env``'s world.

        Raises:
            UsageError: the pipelines do not divide the world, or the stages or
                micro-batches do not fit the schedule.
        """
        world = env.world_size
        size = world if self.size is None else self.size
        if world % size:
            raise UsageError(
                f"pipeline: size={size} does not divide the world of {world} ranks into equal "
                f"pipelines; use one of {[d for d in range(1, world + 1) if world % d == 0]}."
            )
        stages = default_stage_count(self.schedule, size) if self.stages is None else self.stages
        check_stage_count(self.schedule, stages, size)
        check_microbatches(self.schedule, self.microbatches, stages, size)
        return world // size, size

    def __call__(self, env: Env) -> Context:
        from torch.distributed.device_mesh import init_device_mesh

        replicas, size = self.shape(check_env(env, "setup"))  # before joining: fail fast
        ctx = self.join(env)
        replicated = ((self.names.replicate, replicas),) if replicas > 1 else ()
        names, shape = zip(*replicated, (self.names.pp, size), strict=True)
        mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
        return ctx.with_extras(mesh=mesh, mesh_names=self.names)


def _check_split(stages: object, schedule: str) -> Split:
    if callable(stages):
        if SCHEDULES[schedule].multi:
            raise UsageError(
                f"pipeline: schedule={schedule!r} puts several stages on each rank, which a "
                "split function (module, stage_index, num_stages) -> module cannot give as one "
                "module with the unsplit module's names; give 'stages' as module paths, e.g. "
                "[['0', '1'], ['2'], ['3'], ['4', '5']]."
            )
        fn: StageFn = stages
        return fn
    wanted = (
        "a list of stages, each a non-empty list of module paths (model.named_modules() "
        "names), or a function (module, stage_index, num_stages) -> module"
    )
    require(_is_paths(stages), "pipeline: 'stages'", wanted, stages)
    assert isinstance(stages, Sequence)
    return tuple(tuple(paths) for paths in stages)


def _is_sequence(value: object) -> TypeGuard[Sequence[Any]]:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0


def _is_paths(stages: object) -> bool:
    return _is_sequence(stages) and all(
        _is_sequence(paths) and all(isinstance(p, str) and p for p in paths) for paths in stages
    )


def pipeline(
    *,
    stages: Sequence[Sequence[str]] | StageFn,
    schedule: ScheduleName = "1f1b",
    microbatches: int,
    size: int | None = None,
    mesh_names: MeshNames | Mapping[str, str] | None = None,
    **world: Unpack[WorldOptions],
) -> Strategy:
    """Pipeline parallelism on the ranks that torchrun or SLURM started (``spawned(...)`` here).

    ``wrap`` splits the module into ``stages`` and returns this rank's stages as
    one module whose ``state_dict`` keys are the unsplit module's; ``step``
    runs the schedule on micro-batches of ``(inputs, targets)`` batches, with
    the loss of the user's ``forward`` on the last stage, and returns the
    mean loss on every rank; ``backward`` only checks (the schedule ran it);
    ``update`` averages gradients over data-parallel replicas and steps.

    Args:
        stages: module paths of each stage, in forward order (each stage runs
            its submodules one after another), e.g. ``[["0", "1"], ["2", "3"]]``
            for a ``Sequential``; or a function ``(module, stage_index,
            num_stages) -> stage module`` (schedules of one stage per rank only).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
            ``"looped-bfs"``, ``"interleaved-zero-bubble"`` or ``"zbv-zero-bubble"``.
        microbatches: micro-batches per step; must divide every batch.
        size: ranks per pipeline; ``None`` for all. A smaller size gives a
            ``("dp", "pp")`` mesh of ``world / size`` data-parallel pipelines.
        mesh_names: the mesh's dimension names by role (`MeshNames`, or a
            mapping such as ``{"replicate": "dp_replicate"}``); ``None``
            keeps ``"dp"`` and ``"pp"``.
        **world: how the ranks join their world (`WorldOptions`), as for
            `ddp`; ``timeout`` also bounds every transfer between stages.

    Raises:
        UsageError: an argument has the wrong type or value (an unknown
            schedule, a stage count the schedule cannot run, ...).

    Example:
        >>> import stratagem as sg
        >>> sg.pipeline(stages=[["0"], ["1", "2"]], schedule="gpipe", microbatches=4).name
        'pipeline-gpipe'
    """
    _SCHEDULE(None, attrs.fields(JoinPipeline).schedule, schedule)
    split = _check_split(stages, schedule)
    # A schedule lists every micro-batch's actions at wrap: 10**6 took a minute, 10**30 forever.
    _MICROBATCHES(None, attrs.fields(JoinPipeline).microbatches, microbatches)
    require(size is None or is_int(size, 1), "pipeline: 'size'", "None or a positive int", size)
    wrap = PipelineWrap(split, schedule, microbatches)
    if size is not None and not callable(split):
        check_stage_count(schedule, len(split), size)
        check_microbatches(schedule, microbatches, len(split), size)
    base = ddp(**world)
    return attrs.evolve(
        base,
        name=f"pipeline-{schedule}",
        setup=JoinPipeline(
            join=cast(JoinProcessGroup, base.setup),
            schedule=schedule,
            stages=None if callable(split) else len(split),
            microbatches=microbatches,
            size=size,
            names=pipeline_names(mesh_names),
        ),
        wrap=wrap,
        step=pipeline_step,
        backward=BackwardInStep(pipeline_backward, microbatches),
        update=pipeline_update,
        no_sync=pipeline_no_sync,
    )
