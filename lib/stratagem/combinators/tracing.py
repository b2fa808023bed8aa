"""``traced``: record every call of every field (rank, argument shapes, duration) to a sink.

A sink is any callable ``sink(event)``. For spawned ranks it must be
picklable: `JsonLinesSink` appends one JSON line per event to a file that
every rank shares; `ListSink` keeps events in this process's memory.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, cast

import attrs

from stratagem.combinators._base import CombinatorError, applied, check_strategy
from stratagem.env import Context, Env
from stratagem.strategy import FIELD_SIGNATURES, Strategy
from stratagem.trees import tensors_in
from stratagem.validators import instance_of, require

__all__ = ["JsonLinesSink", "ListSink", "Sink", "TraceEvent", "Traced", "traced"]

Shape = tuple[int, ...]


@attrs.frozen
class TraceEvent:
    """One call of one field of a traced strategy.

    Attributes:
        field: the field called (``"step"``, ``"reduce"``, ...).
        rank: the caller's global rank, from the call's `Context` or `Env`;
            ``None`` for ``launch`` (it runs before ranks exist).
        shapes: shapes of the tensors among the arguments, in order, looking
            inside tuples (named ones too), lists, mappings and dataclass
            instances, as `stratagem.trees.tensors_in` does (a batch's leaves);
            modules, optimizers and other objects are left out.
        dtypes: the dtypes of those tensors, as strings.
        started: wall-clock time of the call, seconds since the epoch (to
            order events of different ranks).
        duration_s: seconds the call took on this host (without waiting for
            asynchronous device work).
        error: the qualified name of the exception the call raised, or None.
    """

    field: str
    rank: int | None
    shapes: tuple[Shape, ...]
    dtypes: tuple[str, ...]
    started: float
    duration_s: float
    error: str | None = None

    def to_json(self) -> str:
        """Return the event as one line of JSON (no newline)."""
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, line: str) -> TraceEvent:
        """Read back an event written by `to_json`."""
        data = json.loads(line)
        data["shapes"] = tuple(tuple(shape) for shape in data["shapes"])
        data["dtypes"] = tuple(data["dtypes"])
        return cls(**data)


Sink = Callable[[TraceEvent], object]
"""Where events go: any callable taking a `TraceEvent` (picklable, for spawned ranks)."""


def _sink_path(path: object) -> str:
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    wanted = "a non-empty str or os.PathLike, the file every rank appends to"
    require(isinstance(text, str) and text != "", "JsonLinesSink: 'path'", wanted, path)
    return cast(str, text)


@attrs.frozen
class JsonLinesSink:
    """Sink that appends each event as one JSON line to ``path`` (every rank to the same file).

    Each event is one ``write`` to a file opened for appending, so lines of
    different ranks never interleave, and an event is on disk before the call
    that follows it: a trace survives a rank that hangs or is killed.

    Attributes:
        path: the file; created if missing, never truncated.

    Raises:
        UsageError: ``path`` is not a str or path-like.
    """

    path: str = attrs.field(converter=_sink_path)

    def __call__(self, event: TraceEvent) -> None:
        # Opened per event: the record holds no file handle, and a killed rank loses nothing.
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, (event.to_json() + "\n").encode())
        finally:
            os.close(descriptor)

    def events(self) -> list[TraceEvent]:
        """Read back every event in the file, in the order written."""
        with open(self.path, encoding="utf-8") as file:
            return [TraceEvent.from_json(line) for line in file if line.strip()]


_EVENTS = instance_of(
    "ListSink: '{name}'", list, "a list to append to", hint="; ListSink() starts with an empty one"
)


@attrs.define(eq=False, repr=False)
class ListSink:
    """Sink that keeps events in a list in this process (single-process use).

    Equality is identity: a record holding it stays equal to itself as events arrive.

    Attributes:
        events: the events recorded so far, oldest first.
    """

    events: list[TraceEvent] = attrs.field(factory=list, validator=_EVENTS)

    def __call__(self, event: TraceEvent) -> None:
        self.events.append(event)

    def __repr__(self) -> str:
        return f"ListSink(<{len(self.events)} events>)"

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned rank would fill a copy that nobody reads: fail when it is sent instead.
        raise TypeError(
            "ListSink keeps events in this process; spawned ranks need a sink they can "
            "share, e.g. JsonLinesSink(path)."
        )


def _rank(args: tuple[Any, ...]) -> int | None:
    return next((value.rank for value in args if isinstance(value, (Context, Env))), None)


@attrs.frozen
class Traced:
    """Any field: call ``inner``, then send a `TraceEvent` of the call to ``sink``.

    Attributes:
        inner: the field being traced.
        sink: where the event goes.
        field: the field's name, as the event reports it.
    """

    inner: Callable[..., Any]
    sink: Sink
    field: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        start = time.perf_counter()
        error: str | None = None
        try:
            return self.inner(*args, **kwargs)
        except BaseException as raised:
            kind = type(raised)
            error = f"{kind.__module__}.{kind.__qualname__}"
            raise
        finally:
            duration = time.perf_counter() - start
            tensors = [
                *tensors_in(args),
                *tensors_in([v for k, v in kwargs.items() if k != "forward"]),
            ]
            self.sink(
                TraceEvent(
                    field=self.field,
                    rank=_rank(args),
                    shapes=tuple(tuple(t.shape) for t in tensors),
                    dtypes=tuple(str(t.dtype) for t in tensors),
                    started=started,
                    duration_s=duration,
                    error=error,
                )
            )


def traced(strategy: Strategy, sink: Sink) -> Strategy:
    """Record every call of every field to ``sink``, for debugging; the results are unchanged.

    Each call sends one `TraceEvent` (field, rank, argument shapes and dtypes,
    start time, duration, exception) to ``sink`` after the call returns or
    raises. A strategy not traced pays nothing: tracing is these wrappers only.

    Fields touched: every function field (`Traced`); ``name`` gains ``+traced``.

    Args:
        strategy: the strategy to observe.
        sink: a callable taking each `TraceEvent`; picklable for spawned ranks
            (`JsonLinesSink`), or a `ListSink` in a single process.

    Returns:
        The strategy, each field wrapped in a recorder.

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, or ``sink`` is not callable.
        CombinatorError: the strategy is already traced.

    Example:
        >>> import torch, stratagem as sg
        >>> sink = sg.ListSink()
        >>> strategy = sg.traced(sg.single_device("cpu"), sink)
        >>> ctx = strategy.setup(sg.Env())
        >>> _ = strategy.reduce(torch.ones(3), "sum", ctx)
        >>> [(e.field, e.rank, e.shapes) for e in sink.events]
        [('setup', 0, ()), ('reduce', 0, ((3,),))]
    """
    check_strategy(strategy, "traced")
    hint = "; use sg.JsonLinesSink(path) or sg.ListSink()"
    require(callable(sink), "traced: 'sink'", "callable as sink(event)", sink, hint=hint)
    if applied(strategy, Traced) is not None:
        raise CombinatorError(
            f"traced: strategy {strategy.name!r} is already traced; apply traced once."
        )
    changes = {name: Traced(getattr(strategy, name), sink, name) for name in FIELD_SIGNATURES}
    return attrs.evolve(strategy, name=f"{strategy.name}+traced", **changes)
