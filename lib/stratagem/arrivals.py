"""Arrival checks: find out, within a bounded time, that some ranks did not call a collective.

``if ctx.is_main: save(...)`` is the idiom of most training scripts, and it
hangs: rank 0 waits in the save's first collective for ranks that never come,
until the process group's timeout (30 minutes) ends it with a backend error
that names nothing. Before `save`, `load` and `barrier` (and, under
``checked``, before every collective) each rank signs in at the world's store;
a rank that finds the others absent after ``Arrivals.timeout`` seconds raises
`NOT_CALLED_BY_ALL`, naming them and what they were last seen doing.

Each call costs a few store round trips (about a hundred microseconds on one
host): right for checkpoints and barriers, not for every gradient.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import attrs

from stratagem.errors import CollectiveCallError
from stratagem.validators import is_number, require

if TYPE_CHECKING:  # not at run time: a spawned rank imports this before it may import torch
    from torch.distributed import Store  # type: ignore[attr-defined]  # exported at run time

__all__ = [
    "CANNOT_COME",
    "NOT_CALLED_BY_ALL",
    "Arrivals",
    "CollectiveCallError",
    "arrive",
    "check_arrival_timeout",
    "mark_left",
]

NOT_CALLED_BY_ALL = (
    "{what} is collective: every rank must call it, but rank(s) {missing} did not within "
    "{timeout:g} s ({seen}). Call {what} on every rank, not under `if ctx.is_main:` (the "
    "writing itself is done by the ranks that own each part); if a rank is just slow, "
    "raise arrival_timeout (a strategy option)."
)

CANNOT_COME = (
    "{what} is collective: every rank must call it, but rank {rank} waits in it ({call}) for "
    "ranks that cannot come: {reasons}. Call {what} on every rank, in the same order, not "
    "under `if ctx.is_main:` (the writing itself is done by the ranks that own each part)."
)

DEFAULT_TIMEOUT = 60.0
_FIRST_LOOK, _LAST_LOOK = 0.2, 5.0  # seconds between two looks at why a wait goes on
_POLL = 0.02  # seconds between two looks at the store, at most
_CALL = re.compile(r"\(([^()]*#\d+)\)$")
_PREFIX = "stratagem/arrivals"


def check_arrival_timeout(value: object) -> float:
    """Return ``value`` as seconds if it is a positive finite number.

    Raises:
        UsageError: it is not.
    """
    require(
        is_number(value, above=0, at_most=timedelta.max.total_seconds()),
        "'arrival_timeout'",
        "a positive number of seconds",
        value,
        hint="; it bounds how long save, load and barrier wait for every rank to call them",
    )
    return float(cast(float, value))


@attrs.define(eq=False)
class Arrivals:
    """A world's sign-in sheet: the store every rank reaches, and this rank's call counts.

    `JoinProcessGroup` puts one in ``Context.arrivals``; a `Context` without
    one (built by hand) skips the checks and waits as long as the backend does.

    Attributes:
        store: the world's rendezvous store (a ``torch.distributed.Store``).
        timeout: seconds to wait for every rank to arrive at a call.
        calls: calls made so far on this rank, by series.
    """

    store: Store
    timeout: float = attrs.field(default=DEFAULT_TIMEOUT, converter=check_arrival_timeout)
    calls: dict[str, int] = attrs.field(factory=dict)


def _key(*parts: object) -> str:
    return "/".join((_PREFIX, *map(str, parts)))


def arrive(arrivals: Arrivals, what: str, rank: int, world_size: int, *, series: str = "") -> None:
    """Sign in for ``what`` and wait until every rank has, or raise naming the absent ones.

    Args:
        arrivals: the world's `Arrivals`.
        what: the call, as the message names it (``"save"``).
        rank: this rank.
        world_size: ranks that must arrive.
        series: calls counted together (default: ``what``'s own), so that ranks
            calling different members of a series meet and can compare.

    Raises:
        CollectiveCallError: some rank did not arrive within ``arrivals.timeout``.
    """
    name = series or what
    number = arrivals.calls.get(name, 0) + 1
    arrivals.calls[name] = number
    call, store = f"{name}#{number}", arrivals.store
    store.set(_key("rank", rank), f"{what} ({call})")
    done = _key(call, "all")
    if store.add(_key(call), 1) == world_size:
        store.set(done, "")
    else:
        _wait(arrivals, what, call, rank, world_size)
    if rank == 0 and number > 1:
        # Every rank has passed the previous call of the series: its keys are not needed.
        previous = f"{name}#{number - 1}"
        store.delete_key(_key(previous))
        store.delete_key(_key(previous, "all"))


def _wait(arrivals: Arrivals, what: str, call: str, rank: int, world_size: int) -> None:
    """Wait for every rank at ``call``; raise as soon as one cannot come, or at the timeout.

    A rank cannot come when it has left its function (`mark_left`) or waits in
    another collective call, which cannot end while this rank waits here. The
    store is polled (a timed-out ``store.wait`` makes torch print a socket
    warning), at first every millisecond, then at most every `_POLL` seconds;
    why a wait goes on is looked into at growing intervals, from a fifth of a
    second to a few seconds, so a slow rank costs the store a handful of looks.
    """
    store, done = arrivals.store, _key(call, "all")
    started = time.monotonic()
    deadline, look, pause = started + arrivals.timeout, started + _FIRST_LOOK, 0.001
    piece = _FIRST_LOOK
    while not store.check([done]):
        now = time.monotonic()
        error = None
        if now >= look:
            error = _cannot_come(store, what, call, rank, world_size)
            piece = min(piece * 2, _LAST_LOOK)
            look = now + piece
        if error is None and now >= deadline:
            error = _absent(arrivals, what, call, rank, world_size)
            if error is None:
                store.wait([done], timedelta(seconds=arrivals.timeout))  # all came, just late
                return
        if error is not None and not store.check([done]):  # unless all came as we looked
            raise error from None
        time.sleep(pause)
        pause = min(pause * 2, _POLL)


def mark_left(arrivals: Arrivals | None, rank: int, how: str) -> None:
    """Record that ``rank`` has left the user's function (``how``: returned, raised ...).

    A launcher calls it once the function ends, so a rank still waiting for this
    one at a collective call says so at once instead of after its timeout.
    """
    if arrivals is None:
        return
    with contextlib.suppress(RuntimeError):  # the store is gone: nobody is left to tell
        arrivals.store.set(_key("left", rank), how)
        arrivals.store.add(_key("left"), 1)


def _last_seen(store: Store, rank: int, world_size: int) -> Iterator[tuple[int, str]]:
    """Yield every other rank and the call it last signed in at (``""`` if it never did)."""
    for other in range(world_size):
        if other != rank:
            key = _key("rank", other)
            yield other, store.get(key).decode() if store.check([key]) else ""


def _cannot_come(
    store: Store, what: str, call: str, rank: int, world_size: int
) -> CollectiveCallError | None:
    left = store.add(_key("left"), 0) > 0  # one look, and the names only when someone left
    gone, elsewhere = [], []
    for other, last in _last_seen(store, rank, world_size):
        if left and store.check([_key("left", other)]):
            how = store.get(_key("left", other)).decode()
            # Where it was when it left: its own error may reach the launcher after this one.
            gone.append(f"rank {other} {how}" + (f", last in {last}" if last else ""))
            continue
        match = _CALL.search(last)
        if match is None or match.group(1) == call:
            continue
        waiting = store.add(_key(match.group(1)), 0)  # ranks signed in at that call so far
        if 0 < waiting < world_size:
            elsewhere.append(f"rank {other} waits in {last}")
    if not (gone or elsewhere):
        return None
    return CollectiveCallError(
        CANNOT_COME.format(what=what, rank=rank, call=call, reasons="; ".join(gone + elsewhere))
    )


def _absent(
    arrivals: Arrivals, what: str, call: str, rank: int, world_size: int
) -> CollectiveCallError | None:
    missing, seen = [], []
    for other, last in _last_seen(arrivals.store, rank, world_size):
        if not last.endswith(f"({call})"):
            missing.append(other)
            seen.append(
                f"rank {other}: last seen at {last}" if last else f"rank {other}: never seen"
            )
    if not missing:  # the last rank came just after the deadline
        return None
    return CollectiveCallError(
        NOT_CALLED_BY_ALL.format(
            what=what,
            missing=", ".join(map(str, missing)),
            timeout=arrivals.timeout,
            seen="; ".join(seen),
        )
    )
