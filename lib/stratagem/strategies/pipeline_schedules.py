"""The schedules `pipeline` runs: their names, how they place stages on ranks, what they need.

Every check here is a pure function of the configuration and the pipeline's
size, so `pipeline` refuses a bad combination at construction or in ``setup``,
before any rank joins the world, with the same message on every rank.
``torch.distributed.pipelining`` is imported where a schedule is built, never
by ``import stratagem``.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from stratagem.errors import UsageError

__all__ = [
    "SCHEDULES",
    "ScheduleName",
    "ScheduleSpec",
    "check_microbatches",
    "check_stage_count",
    "default_stage_count",
    "schedule_class",
    "stages_of_rank",
]

ScheduleName = Literal[
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "looped-bfs",
    "interleaved-zero-bubble",
    "zbv-zero-bubble",
]


@attrs.frozen
class ScheduleSpec:
    """What `pipeline` needs to know of a torch schedule.

    Attributes:
        torch_name: the class in ``torch.distributed.pipelining``.
        multi: whether a rank may hold several stages (``PipelineScheduleMulti``).
        placement: ``"loop"`` (stage ``s`` on pipeline rank ``s % size``) or
            ``"v"`` (rank ``r`` holds stages ``r`` and ``2 * size - 1 - r``).
        at_least_stages: whether it needs as many micro-batches as stages (1F1B).
        rounds: whether micro-batches must be a multiple of ``max(1, m // size)``.
    """

    torch_name: str
    multi: bool
    placement: Literal["loop", "v"] = "loop"
    at_least_stages: bool = False
    rounds: bool = False


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", multi=False),
    "1f1b": ScheduleSpec("Schedule1F1B", multi=False, at_least_stages=True),
    "interleaved-1f1b": ScheduleSpec("ScheduleInterleaved1F1B", multi=True, rounds=True),
    "looped-bfs": ScheduleSpec("ScheduleLoopedBFS", multi=True),
    "interleaved-zero-bubble": ScheduleSpec(
        "ScheduleInterleavedZeroBubble", multi=True, rounds=True
    ),
    "zbv-zero-bubble": ScheduleSpec("ScheduleZBVZeroBubble", multi=True, placement="v"),
}
"""The schedule names `pipeline` accepts, each with what it needs."""


def schedule_class(name: str) -> Any:
    """Return the torch schedule class of ``name`` (imports ``torch.distributed.pipelining``)."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULES[name].torch_name)


def default_stage_count(name: str, size: int) -> int:
    """Stages of a pipeline of ``size`` ranks split by a function: one per rank, two if multi."""
    return size * (2 if SCHEDULES[name].multi else 1)


def check_stage_count(name: str, stages: int, size: int) -> None:
    """Check that ``stages`` stages fit schedule ``name`` on a pipeline of ``size`` ranks.

    Raises:
        UsageError: they do not; the message gives the counts that do.
    """
    spec = SCHEDULES[name]
    if not spec.multi:
        ok, wanted = stages == size, f"exactly {size} (one per pipeline rank)"
    elif spec.placement == "v":
        ok, wanted = stages == 2 * size, f"exactly {2 * size} (two per pipeline rank, a V)"
    else:
        ok = stages % size == 0 and stages >= 2 * size
        wanted = f"a multiple of {size} of at least {2 * size} (several per pipeline rank)"
    if not ok:
        raise UsageError(
            f"pipeline: schedule={name!r} on a pipeline of {size} ranks needs {wanted} stages, "
            f"but 'stages' gives {stages}; split the module into {wanted.split(' (')[0]} parts, "
            "or change 'size' (ranks per pipeline) or the schedule."
        )


def check_microbatches(name: str, microbatches: int, stages: int, size: int) -> None:
    """Check that schedule ``name`` can run ``microbatches`` micro-batches of ``stages`` stages.

    Raises:
        UsageError: it cannot; the message says what it needs.
    """
    spec = SCHEDULES[name]
    if spec.at_least_stages and microbatches < stages:
        raise UsageError(
            f"pipeline: schedule={name!r} needs at least as many micro-batches as stages, but "
            f"microbatches={microbatches} < {stages} stages; use microbatches >= {stages}."
        )
    rounds = max(1, microbatches // size)
    if spec.rounds and microbatches % rounds:
        raise UsageError(
            f"pipeline: schedule={name!r} on {size} pipeline ranks runs micro-batches in "
            f"rounds of {size}, but microbatches={microbatches} is not a multiple of the "
            f"{rounds} rounds; use a multiple of {size}."
        )


def stages_of_rank(name: str, stages: int, size: int, rank: int) -> list[int]:
    """Return the indices of the stages pipeline rank ``rank`` holds, in order."""
    if SCHEDULES[name].placement == "v":
        return [rank, 2 * size - 1 - rank]
    return list(range(rank, stages, size))


def rank_of_stage(name: str, stage: int, stages: int, size: int) -> int:
    """Return the pipeline rank that holds stage ``stage``."""
    return next(r for r in range(size) if stage in stages_of_rank(name, stages, size, r))
