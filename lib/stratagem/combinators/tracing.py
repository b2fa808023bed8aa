"""``traced``: record every call of every field (rank, argument shapes, duration) to a sink.

A sink is any callable ``sink(event)``. For spawned ranks it must be
picklable: `JsonLinesSink` appends one JSON line per event to a file that
every rank shares; `ChromeTraceSink` keeps a Chrome/Perfetto trace (Trace
Event Format, one track per rank) that every rank shares; `ListSink` keeps
events in this process's memory. `chrome_trace` turns any list of events
(e.g. ``JsonLinesSink(path).events()``) into the same trace.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, cast

import attrs

from stratagem.combinators._base import check_once, check_strategy
from stratagem.env import Context, Env
from stratagem.errors import UsageError, describe
from stratagem.strategy import FIELD_SIGNATURES, Strategy
from stratagem.trees import tensors_in
from stratagem.validators import instance_of, require

__all__ = [
    "COLLECTIVE_FIELDS",
    "LAUNCH_PID",
    "STEP_FIELDS",
    "ChromeTraceSink",
    "JsonLinesSink",
    "ListSink",
    "Sink",
    "TraceEvent",
    "Traced",
    "chrome_trace",
    "chrome_trace_events",
    "traced",
]

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


def _checked_path(path: object, owner: str) -> str:
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    wanted = "a non-empty str or os.PathLike, the file every rank appends to"
    require(isinstance(text, str) and text != "", f"{owner}: 'path'", wanted, path)
    text = cast(str, text)
    # Checked here, not at the first event: a rank that cannot write its trace fails at once,
    # before any training, instead of with a raw OSError in the middle of a field.
    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise UsageError(f"{owner}: 'path' is a directory (got {text!r}); name a file inside it.")
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise UsageError(
            f"{owner}: 'path' is under {parent!r}, which is not a directory (got {text!r}); "
            "name a file in a directory."
        )
    if not os.path.isdir(parent):
        raise UsageError(
            f"{owner}: 'path' is in a directory that does not exist ({parent!r}, got {text!r}); "
            "create it first (os.makedirs), or name a file in an existing directory."
        )
    return text


def _sink_path(path: object) -> str:
    return _checked_path(path, "JsonLinesSink")


def _trace_path(path: object) -> str:
    return _checked_path(path, "ChromeTraceSink")


@attrs.frozen
class JsonLinesSink:
    """Sink that appends each event as one JSON line to ``path`` (every rank to the same file).

    Each event is one ``write`` to a file opened for appending, so lines of
    different ranks never interleave, and an event is on disk before the call
    that follows it: a trace survives a rank that hangs or is killed.

    Attributes:
        path: the file; created if missing, never truncated.

    Raises:
        UsageError: ``path`` is not a str or path-like, is a directory, or its
            directory does not exist.
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


# ------------------------------------------------------------ Chrome / Perfetto trace events

COLLECTIVE_FIELDS = frozenset({"reduce", "gather", "broadcast", "barrier"})
"""Fields whose calls are collectives: category ``"collective"`` in a Chrome trace."""
STEP_FIELDS = frozenset({"step", "backward", "update", "no_sync"})
"""Fields of a training step: category ``"step"``; every other field is ``"lifecycle"``."""
LAUNCH_PID = 1_000_000
"""The Chrome-trace process of events without a rank (``launch``, in the launching process)."""


def _category(field: str) -> str:
    if field in COLLECTIVE_FIELDS:
        return "collective"
    return "step" if field in STEP_FIELDS else "lifecycle"


def chrome_trace_events(event: TraceEvent) -> list[dict[str, Any]]:
    """Return ``event`` as Trace Event Format dicts: one ``"X"`` span, after ``"M"`` names.

    The span has ``ts`` (start, microseconds since the epoch, so ranks line
    up), ``dur`` (microseconds), ``pid`` (the rank, or `LAUNCH_PID` without
    one), ``tid`` 0 (one track per rank), ``name`` (the field), ``cat``
    (``"collective"``, ``"step"`` or ``"lifecycle"``) and ``args`` (shapes,
    dtypes, error). A ``setup`` or ``launch`` event, which each process sends
    once per run, is preceded by the metadata events that name its track
    (``process_name``, ``process_sort_index``, ``thread_name``).

    Raises:
        UsageError: ``event`` is not a `TraceEvent`.
    """
    if not isinstance(event, TraceEvent):
        raise UsageError(
            f"chrome_trace: each event must be a TraceEvent, as a sink receives it or "
            f"JsonLinesSink.events() returns it (got {describe(event)})."
        )
    pid = LAUNCH_PID if event.rank is None else event.rank
    span: dict[str, Any] = {
        "name": event.field,
        "cat": _category(event.field),
        "ph": "X",
        "ts": event.started * 1e6,
        "dur": event.duration_s * 1e6,
        "pid": pid,
        "tid": 0,
        "args": {
            "shapes": [list(shape) for shape in event.shapes],
            "dtypes": list(event.dtypes),
            "error": event.error,
        },
    }
    if event.field not in ("setup", "launch"):
        return [span]
    label = "launch" if event.rank is None else f"rank {event.rank}"
    named = [
        ("process_name", {"name": label}),
        ("process_sort_index", {"sort_index": pid}),
        ("thread_name", {"name": "strategy fields"}),
    ]
    meta = [{"name": n, "ph": "M", "pid": pid, "tid": 0, "args": a} for n, a in named]
    return [*meta, span]


def chrome_trace(events: Iterable[TraceEvent]) -> dict[str, Any]:
    """Return a Chrome/Perfetto trace (``{"traceEvents": [...]}``) of ``events``, any ranks.

    Write it with ``json.dump`` and open it in https://ui.perfetto.dev or
    ``chrome://tracing``: one track per rank, every call a span.

    Example:
        >>> import stratagem as sg
        >>> from stratagem.combinators.tracing import chrome_trace
        >>> event = sg.TraceEvent("reduce", 1, ((3,),), ("torch.float32",), 2.0, 0.5)
        >>> [span] = chrome_trace([event])["traceEvents"]
        >>> [span[key] for key in ("ph", "name", "cat", "pid", "tid", "ts", "dur")]
        ['X', 'reduce', 'collective', 1, 0, 2000000.0, 500000.0]
    """
    return {
        "displayTimeUnit": "ms",
        "traceEvents": [entry for event in events for entry in chrome_trace_events(event)],
    }


_HEAD = '{"displayTimeUnit": "ms", "traceEvents": [\n'
_TAIL = "\n]}\n"


@attrs.frozen
class ChromeTraceSink:
    """Sink that keeps ``path`` a Chrome/Perfetto trace of every event (every rank to one file).

    The ranks share the file, each its own track (``pid`` = rank, as
    `chrome_trace_events` writes them). Each event is added under an exclusive
    lock (``flock``) by rewriting the closing ``]}`` after it, so the file is
    valid JSON after every event: a trace of a rank that hangs or is killed
    loads, and ends at its last call. Load it in https://ui.perfetto.dev,
    ``chrome://tracing``, or with ``json.load``.

    Attributes:
        path: the file; created if missing, never truncated (delete it to start over).

    Raises:
        UsageError: ``path`` is not a str or path-like, is a directory, or its
            directory does not exist; on an event, the file
            holds something this sink did not write.
    """

    path: str = attrs.field(converter=_trace_path)

    def __call__(self, event: TraceEvent) -> None:
        body = ",\n".join(json.dumps(entry) for entry in chrome_trace_events(event))
        # Opened per event, as JsonLinesSink is: the record holds no handle, a killed rank loses
        # nothing; the lock orders the ranks' read-modify-writes of the tail.
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            size = os.fstat(descriptor).st_size
            if size == 0:
                os.write(descriptor, (_HEAD + body + _TAIL).encode())
                return
            tail = len(_TAIL)
            if (
                size < len(_HEAD) + tail
                or os.pread(descriptor, tail, size - tail) != _TAIL.encode()
            ):
                raise UsageError(
                    f"ChromeTraceSink: {self.path!r} is not a trace this sink wrote (it does not "
                    "end in ']}'); delete it, or give the sink a new path."
                )
            os.pwrite(descriptor, (",\n" + body + _TAIL).encode(), size - tail)
        finally:
            os.close(descriptor)  # releases the lock

    def load(self) -> dict[str, Any]:
        """Read the trace back, as ``json.load`` does."""
        with open(self.path, encoding="utf-8") as file:
            loaded: dict[str, Any] = json.load(file)
            return loaded


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
    in_reference: ClassVar[bool] = False  # it records; it does not train

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
            tensors = list(tensors_in((args, [v for k, v in kwargs.items() if k != "forward"])))
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
            (`JsonLinesSink`, `ChromeTraceSink`), or a `ListSink` in a single process.

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
    hint = "; use sg.JsonLinesSink(path), sg.ChromeTraceSink(path) or sg.ListSink()"
    require(callable(sink), "traced: 'sink'", "callable as sink(event)", sink, hint=hint)
    check_once(strategy, Traced, "traced", "is already traced", "apply traced once")
    changes = {name: Traced(getattr(strategy, name), sink, name) for name in FIELD_SIGNATURES}
    return attrs.evolve(strategy, name=f"{strategy.name}+traced", **changes)
