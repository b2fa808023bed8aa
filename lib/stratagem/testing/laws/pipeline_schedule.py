"""Law ``pipeline-schedule``: every rank's sends meet a receive, in order, and the schedule ends.

A pipeline schedule is a list of actions per rank (torch's schedule IR: ``"1F0"``
is stage 1's forward of micro-batch 0; ``B`` a whole backward, ``I`` and ``W``
its input and weight halves). The law checks it for a pipeline of any size in
this one process, with nothing run:

1. every stage runs one forward and one backward (whole, or input then weight)
   per micro-batch, a backward after its forward, each stage on one rank
   (torch's ``_validate_schedule``);
2. with the sends and receives that torch adds between ranks, the messages each
   rank sends another are the ones that rank receives, in the same order (p2p
   messages between two ranks match in order: a receive posted for micro-batch
   1 while micro-batch 0 is sent waits, or takes the wrong tensor);
3. simulated step by step, every rank's actions finish: no rank waits on a
   message that is sent only after it (torch's ``_simulate_comms_compute``).

What is checked is what runs. The schedules of several stages per rank run
the actions torch lowers them to (built here on a simulated world of ``size``
ranks, so a pipeline of 8 or 64 ranks needs none). GPipe and 1F1B run code of
their own, not their listed actions, so their order is taken from that code
(`compute_order`): torch 2.13's listing for 1F1B skips micro-batch 0's forward
on the last stage, which the run does not. A schedule of your own is given as
its actions per rank and lowered as torch lowers a loaded one.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stratagem.errors import UsageError
from stratagem.planning.simulated_world import simulated_world
from stratagem.strategies.pipeline import JoinPipeline
from stratagem.strategies.pipeline_schedules import (
    SCHEDULES,
    check_microbatches,
    check_stage_count,
    default_stage_count,
    schedule_class,
    stages_of_rank,
)
from stratagem.testing.laws._core import LawViolation
from stratagem.validators import is_int

__all__ = ["check_pipeline_schedule"]

LAW = "pipeline-schedule"

ScheduleLike = Any  # a pipeline() strategy, a built-in schedule's name, or actions per rank
Actions = dict[int, list[Any]]  # rank -> torch _Action or None (an idle step)

_COMPUTE = frozenset("FBIW")
_KINDS = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input)",
    "W": "backward (weights)",
    "SEND_F": "send of the forward output",
    "RECV_F": "receive of the forward input",
    "SEND_B": "send of the input gradient",
    "RECV_B": "receive of the output gradient",
}


def check_pipeline_schedule(
    schedule: ScheduleLike,
    *,
    size: int | None = None,
    microbatches: int | None = None,
    stages: int | None = None,
) -> None:
    """Check that ``schedule`` runs every micro-batch through and back, and ends.

    Args:
        schedule: a `pipeline` strategy (its schedule, stages and micro-batches),
            a built-in schedule's name (``"1f1b"``, ...), or a schedule of your
            own: a mapping of each pipeline rank to its actions in order, in
            torch's notation (``"0F1"``, ``"2B0"``, ``"1I0"``, ``"1W0"``; ``None``
            for an idle step), with its messages (``"0SEND_F1"``, ``"1RECV_F1"``,
            ...) where it lists them, else with those torch's lowering adds.
        size: ranks per pipeline; taken from the strategy's ``size`` or the
            mapping's ranks when not given.
        microbatches: micro-batches per step; the strategy's when not given,
            and for actions, one more than the largest micro-batch index.
        stages: stages of the pipeline; the strategy's split, else the
            schedule's default for ``size`` (one per rank, two when several per
            rank), and for actions, one more than the largest stage index.

    Raises:
        LawViolation: a stage misses a forward or backward, a message is sent
            that is not received in the same order, or a rank waits forever.
        UsageError: the arguments do not describe a schedule.

    Example:
        >>> from stratagem.testing.laws import check_pipeline_schedule
        >>> check_pipeline_schedule("interleaved-1f1b", size=4, stages=8, microbatches=8)
        >>> check_pipeline_schedule({0: ["0F0", "0B0"], 1: [None, "1F0", "1B0"]})
    """
    label, actions, stage_count, batch_count, lowered = _resolve(
        schedule, size, microbatches, stages
    )
    where = f"{len(actions)} ranks, {stage_count} stages, {batch_count} micro-batches"
    stage_to_rank = _validated(label, where, actions, stage_count, batch_count)
    if lowered is None:
        lowered = _lowered(label, where, actions, stage_to_rank, stage_count)
    _check_messages_in_order(label, where, lowered, stage_to_rank)
    _check_it_ends(label, where, lowered, stage_to_rank, stage_count)


def compute_order(
    schedule: ScheduleLike,
    *,
    size: int | None = None,
    microbatches: int | None = None,
    stages: int | None = None,
) -> dict[int, list[str]]:
    """Return the compute actions each pipeline rank runs, in order, as the law sees them.

    The arguments are `check_pipeline_schedule`'s; the actions are in torch's
    notation (``"1F0"``), idle steps left out.
    """
    _, actions, *_ = _resolve(schedule, size, microbatches, stages)
    return {
        rank: [str(a) for a in _flat(row) if _kind(a) in _COMPUTE] for rank, row in actions.items()
    }


Resolved = tuple[str, Actions, int, int, Actions | None]


def _resolve(
    schedule: ScheduleLike, size: int | None, microbatches: int | None, stages: int | None
) -> Resolved:
    """Return the label, compute actions per rank, stage count and micro-batch count.

    The fifth item is the actions with their messages, where the schedule has them
    already (torch's lowering, or a schedule of one's own that lists them); else None.
    """
    for name, value in (("size", size), ("microbatches", microbatches), ("stages", stages)):
        if value is not None and not is_int(value, 1):
            raise UsageError(
                f"check_pipeline_schedule: '{name}' must be None or a positive int, got {value!r}."
            )
    setup = getattr(schedule, "setup", None)
    if isinstance(setup, JoinPipeline):
        size = size if size is not None else setup.size
        if size is None:
            raise UsageError(
                f"check_pipeline_schedule: {schedule.name!r} spans every rank (size=None); "
                "pass size=N, the ranks of the pipeline to check (for example size=8)."
            )
        stages = stages if stages is not None else setup.stages
        microbatches = microbatches if microbatches is not None else setup.microbatches
        return _built_in(schedule.name, setup.schedule, size, microbatches, stages)
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise UsageError(
                f"check_pipeline_schedule: unknown schedule {schedule!r}; the built-in ones are "
                f"{', '.join(SCHEDULES)}, or pass your own as actions per rank."
            )
        if size is None or microbatches is None:
            raise UsageError(
                f"check_pipeline_schedule: schedule {schedule!r} needs size= (ranks per "
                "pipeline) and microbatches=; for example size=8, microbatches=8."
            )
        return _built_in(schedule, schedule, size, microbatches, stages)
    if isinstance(schedule, Mapping):
        return _own(schedule, size, microbatches, stages)
    raise UsageError(
        "check_pipeline_schedule: 'schedule' must be a pipeline() strategy, a built-in "
        f"schedule's name or a mapping of rank to actions, got {type(schedule).__name__}; "
        'for example check_pipeline_schedule("1f1b", size=8, microbatches=8).'
    )


def _built_in(label: str, name: str, size: int, microbatches: int, stages: int | None) -> Resolved:
    """Return the actions built-in schedule ``name`` runs on a pipeline of ``size`` ranks."""
    count = default_stage_count(name, size) if stages is None else stages
    check_stage_count(name, count, size)  # the pipeline's own refusals, with their fixes
    check_microbatches(name, microbatches, count, size)
    if not SCHEDULES[name].multi:
        return label, _single_stage_order(name, count, microbatches), count, microbatches, None
    from torch.distributed.pipelining import PipelineStage

    with simulated_world(size, caller="check_pipeline_schedule"):
        held = [
            PipelineStage(torch.nn.Identity(), index, count, torch.device("cpu"))
            for index in stages_of_rank(name, count, size, 0)
        ]
        built = schedule_class(name)(held, n_microbatches=microbatches, loss_fn=_no_loss)
    compute = {rank: list(row) for rank, row in built.pipeline_order.items()}
    lowered = {rank: list(row) for rank, row in built.pipeline_order_with_comms.items()}
    return label, compute, count, microbatches, lowered


def _single_stage_order(name: str, stages: int, microbatches: int) -> Actions:
    """Return the compute order of torch's GPipe and 1F1B runs (``_step_microbatches``).

    GPipe: every forward, then every backward. 1F1B on stage ``s``: the forwards of
    ``min(m, stages - s)`` micro-batches, then a backward and a forward in turn
    until every forward ran, then the remaining backwards.
    """
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    forward, backward = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    order: Actions = {}
    for stage in range(stages):
        if name == "gpipe":
            kinds = [forward] * microbatches + [backward] * microbatches
        else:
            warmup = min(microbatches, stages - stage)
            kinds = [forward] * warmup
            for _ in range(microbatches - warmup):
                kinds += [backward, forward]
            kinds += [backward] * (microbatches - kinds.count(backward))
        seen = {forward: 0, backward: 0}
        order[stage] = []
        for kind in kinds:
            order[stage].append(_Action(stage, kind, seen[kind]))
            seen[kind] += 1
    return order


def _no_loss(output: Any, target: Any) -> Any:  # the schedule needs one to plan backwards
    return output


def _own(
    schedule: Mapping[Any, Any], size: int | None, microbatches: int | None, stages: int | None
) -> Resolved:
    """Parse a schedule of the user's own: rank -> actions in torch's notation."""
    ranks = sorted(schedule, key=repr)
    if ranks != list(range(len(ranks))) or not ranks:
        raise UsageError(
            "check_pipeline_schedule: a schedule's keys must be the pipeline ranks 0, 1, ..., "
            f"got {ranks!r}."
        )
    if size is not None and size != len(ranks):
        raise UsageError(
            f"check_pipeline_schedule: size={size}, but the schedule lists {len(ranks)} ranks."
        )
    actions: Actions = {}
    for rank in ranks:
        row = schedule[rank]
        if isinstance(row, str) or not isinstance(row, Sequence):
            raise UsageError(
                f"check_pipeline_schedule: rank {rank}'s actions must be a list of strings such "
                f"as ['0F0', '0B0'], got {row!r}."
            )
        actions[rank] = []
        for step, text in enumerate(row):
            if text is None:
                actions[rank].append(None)
                continue
            parsed = _parsed(text)
            if parsed is None or _kind(parsed) not in _KINDS or parsed.microbatch_index is None:
                raise UsageError(
                    f"check_pipeline_schedule: rank {rank}, step {step}: {text!r} is not an "
                    "action; write stage, kind and micro-batch, as '0F1' (F forward, B "
                    "backward, I and W its input and weight halves; SEND_F, RECV_F, SEND_B, "
                    "RECV_B for a schedule that lists its messages), or None to idle."
                )
            actions[rank].append(parsed)
    used = [a for row in actions.values() for a in row if a is not None]
    if not used:
        raise UsageError("check_pipeline_schedule: the schedule has no actions.")
    count = stages if stages is not None else 1 + max(a.stage_index for a in used)
    batches = (
        microbatches if microbatches is not None else 1 + max(a.microbatch_index for a in used)
    )
    # A schedule that lists its messages runs them as listed; one that does not is lowered
    # as torch lowers a loaded one.
    listed = any(_kind(a) not in _COMPUTE for a in used)
    compute = {
        r: [a for a in row if a is None or _kind(a) in _COMPUTE] for r, row in actions.items()
    }
    return "a schedule of your own", compute, count, batches, actions if listed else None


def _parsed(text: object) -> Any:
    """Torch's action for ``text``, or None where it is not one."""
    from torch.distributed.pipelining.schedules import _Action

    if not isinstance(text, str):
        return None
    try:
        return _Action.from_str(text)
    except (RuntimeError, ValueError):
        return None


def _validated(
    label: str, where: str, actions: Actions, stages: int, microbatches: int
) -> Callable[[int], int]:
    """Run torch's validator on the compute actions; return stage -> rank."""
    from torch.distributed.pipelining.schedules import _validate_schedule

    try:
        mapping = _validate_schedule(actions, len(actions), stages, microbatches)
    except AssertionError as error:
        found = str(error).split("\n\nFull pipeline schedule")[0].strip()
        raise LawViolation(LAW, label, where, _plain(found)) from None
    missing = [s for s in range(stages) if s not in mapping]
    if missing:
        raise LawViolation(LAW, label, where, f"no rank runs stage(s) {missing}")
    return mapping.__getitem__


def _lowered(
    label: str, where: str, actions: Actions, stage_to_rank: Callable[[int], int], stages: int
) -> Actions:
    """Return the actions with the sends and receives torch adds between ranks."""
    from torch.distributed.pipelining.schedules import _add_send_recv

    left = {rank: [a for a in row if a is not None] for rank, row in actions.items()}
    try:
        return _add_send_recv(left, stage_to_rank=stage_to_rank, num_stages=stages)
    except AssertionError:  # no rank could take its next action: `left` holds where each stopped
        waits = "; ".join(
            f"rank {rank} waits at {_describe(row[0])}" for rank, row in left.items() if row
        )
        raise LawViolation(LAW, label, where, f"the schedule never ends: {waits}") from None


def _check_messages_in_order(
    label: str, where: str, lowered: Actions, stage_to_rank: Callable[[int], int]
) -> None:
    """Per pair of ranks: the messages one sends are the ones the other receives, in order."""
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for rank, row in lowered.items():
        for action in _flat(row):
            kind, stage, batch = _kind(action), action.stage_index, action.microbatch_index
            if kind == "SEND_F":
                sent.setdefault((rank, stage_to_rank(stage + 1)), []).append(("F", stage, batch))
            elif kind == "SEND_B":
                sent.setdefault((rank, stage_to_rank(stage - 1)), []).append(("B", stage, batch))
            elif kind == "RECV_F":
                peer = stage_to_rank(stage - 1)
                received.setdefault((peer, rank), []).append(("F", stage - 1, batch))
            elif kind == "RECV_B":
                peer = stage_to_rank(stage + 1)
                received.setdefault((peer, rank), []).append(("B", stage + 1, batch))
    for pair in sorted(set(sent) | set(received)):
        sends, receives = sent.get(pair, []), received.get(pair, [])
        if sends == receives:
            continue
        index = next(
            (i for i, (a, b) in enumerate(zip(sends, receives, strict=False)) if a != b),
            min(len(sends), len(receives)),
        )
        source, target = pair
        send = _message(sends[index]) if index < len(sends) else "nothing more"
        receive = _message(receives[index]) if index < len(receives) else "nothing more"
        raise LawViolation(
            LAW,
            label,
            where,
            f"rank {source}'s message {index + 1} to rank {target} is {send}, but rank "
            f"{target}'s receive {index + 1} from rank {source} expects {receive}",
        )


def _check_it_ends(
    label: str,
    where: str,
    lowered: Actions,
    stage_to_rank: Callable[[int], int],
    stages: int,
) -> None:
    """Simulate the ranks step by step: each must reach the end of its actions."""
    from torch.distributed.pipelining.schedules import _simulate_comms_compute

    order = {rank: [a for a in _flat(row) if _kind(a) in _KINDS] for rank, row in lowered.items()}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # torch prints the stuck schedule
            _simulate_comms_compute(order, stage_to_rank, stages)
    except ValueError:
        stuck = re.findall(r"rank=(\d+) next action= (\S+)", printed.getvalue())
        waits = "; ".join(
            f"rank {rank} waits at {_describe(_parsed(text))}" for rank, text in stuck
        )
        raise LawViolation(
            LAW, label, where, f"the schedule never ends: {waits or printed.getvalue().strip()}"
        ) from None


def _flat(row: list[Any]) -> list[Any]:
    """Return a row's actions, a combined action's parts in its place, idle steps dropped."""
    flat: list[Any] = []
    for action in row:
        if action is not None:
            flat.extend(action.sub_actions or (action,))
    return flat


def _kind(action: Any) -> str:
    """Torch's short name of an action's kind (``"F"``, ``"SEND_B"``, ...); ``""`` for idle."""
    return "" if action is None else str(action.computation_type.value)


def _message(message: tuple[str, int, int]) -> str:
    kind, stage, batch = message
    what = "forward output" if kind == "F" else "input gradient"
    return f"stage {stage}'s {what} of micro-batch {batch}"


def _describe(action: Any) -> str:
    kind = _KINDS.get(_kind(action), _kind(action))
    where = f"micro-batch {action.microbatch_index} at stage {action.stage_index}"
    return f"{action} ({kind} of {where})"


def _plain(found: str) -> str:
    """Torch's validator message in the law's words (micro-batch, one line)."""
    return " ".join(found.replace("microbatch", "micro-batch").split())
