"""The collectives a step issues, by kind, group size, count and bytes, seen at torch's dispatcher.

FSDP's and DDP's collectives (``torch.ops.c10d``, which a process group's own
methods call too) and DTensor's (``_c10d_functional``) pass the dispatcher, so
a function hooked there sees each one with its tensors and its group.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

__all__ = ["CollectiveCount", "CollectiveRecorder", "ring_bytes"]

# An op's name -> (kind, index of the argument that holds what this rank puts in).
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 1),
    "_allgather_base_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 1),
    "reduce_": ("reduce", 0),
    "barrier": ("barrier", -1),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


@attrs.frozen(kw_only=True)
class CollectiveCount:
    """The collectives of one kind over groups of one size, in one optimizer step.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``,
            ``"broadcast"``, ``"all_to_all"``, ``"send"``, ``"recv"``, ...
        group_size: ranks in each call's group.
        count: calls.
        bytes: what this rank put in, summed over the calls (an all-gather's
            input shard, a reduce-scatter's whole input, an all-reduce's tensor).
        ring_bytes: what this rank sends under a bandwidth-optimal algorithm
            (a ring), summed: the lower bound of its traffic. ``(g-1)/g`` of the
            whole for an all-gather or a reduce-scatter, ``2(g-1)/g`` for an
            all-reduce, where ``g`` is ``group_size``.
    """

    kind: str
    group_size: int
    count: int
    bytes: int
    ring_bytes: int


def ring_bytes(kind: str, group_size: int, put_in: int) -> int:
    """Bytes one rank sends for a collective of ``kind`` under a ring, the bandwidth lower bound."""
    g = group_size
    if g <= 1:
        return 0
    if kind == "all_gather":  # puts in its shard, receives the others
        return (g - 1) * put_in
    if kind in ("reduce_scatter", "all_to_all"):
        return put_in * (g - 1) // g
    if kind == "all_reduce":
        return 2 * put_in * (g - 1) // g
    if kind in ("broadcast", "send", "scatter", "reduce", "gather"):
        return put_in
    return 0  # recv, barrier


def _bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _group_size(args: tuple[object, ...]) -> int:
    for arg in args:
        if isinstance(arg, torch.ScriptObject):  # how a c10d op carries its ProcessGroup
            return dist.ProcessGroup.unbox(arg).size()
        if isinstance(arg, dist.ProcessGroup):
            return arg.size()
    names = [arg for arg in args if isinstance(arg, str)]
    if names:  # a functional collective names its group last (after a reduce op's name)
        # The only way from a functional collective's group name to its group.
        resolve = dist.distributed_c10d._resolve_process_group  # type: ignore[attr-defined]  # noqa: SLF001
        try:
            return int(resolve(names[-1]).size())  # type: ignore[arg-type]  # a GroupName is a str
        except (KeyError, RuntimeError, ValueError) as error:
            # Counting it over the world would be a wrong figure, not a plan.
            raise RuntimeError(
                f"a collective names process group {names[-1]!r}, which this world does not "
                "have (a mesh of a world that is gone, kept in a cache?)"
            ) from error
    return dist.get_world_size()


def _identify(func: Any, args: tuple[object, ...]) -> tuple[str, int, int] | None:
    """(kind, group size, bytes put in) of a collective op, or None for any other op."""
    namespace, name = func.namespace, func.__name__.split(".")[0]
    if namespace == "c10d" and name in _C10D:
        kind, held = _C10D[name]
        put_in = _bytes(args[held]) if held >= 0 else 0
    elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
        kind, put_in = _FUNCTIONAL[name], _bytes(args[0])
    else:
        return None
    return kind, _group_size(args), put_in


@attrs.define
class CollectiveRecorder:
    """Count the collectives that pass torch's dispatcher while `recording`, by kind and group size.

    It hooks torch's ``DebugMode`` (a dispatch mode that calls a function per
    op) rather than defining a mode of its own.
    """

    calls: Counter[tuple[str, int]] = attrs.field(factory=Counter)
    bytes: Counter[tuple[str, int]] = attrs.field(factory=Counter)

    def _see(
        self, func: Any, types: Any, args: tuple[object, ...], kwargs: Any, result: Any
    ) -> None:
        seen = _identify(func, args)
        if seen is not None:
            kind, group_size, put_in = seen
            self.calls[kind, group_size] += 1
            self.bytes[kind, group_size] += put_in

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Count every collective issued inside, fake tensors' included."""
        from torch.utils._debug_mode import DebugMode  # loads dynamo: only when recording

        mode = DebugMode(record_faketensor=True, record_realtensor=True, record_output=False)
        with mode, DebugMode.dispatch_hooks(record_hook=self._see):
            yield
        mode.operators.clear()  # the calls it kept hold their arguments

    def counts(self) -> tuple[CollectiveCount, ...]:
        """Return what passed, one record per kind and group size, largest traffic first."""
        made = [
            CollectiveCount(
                kind=kind,
                group_size=size,
                count=count,
                bytes=self.bytes[kind, size],
                ring_bytes=ring_bytes(kind, size, self.bytes[kind, size]),
            )
            for (kind, size), count in self.calls.items()
        ]
        return tuple(sorted(made, key=lambda c: (-c.ring_bytes, c.kind, c.group_size)))
