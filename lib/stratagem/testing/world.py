"""`World`: persistent local ranks that run many functions, for property tests.

Spawning a world costs seconds; a hypothesis test wants hundreds of examples.
A `World` starts its ranks once and then runs each function on all of them,
with the same calling convention as `stratagem.launch`.

Each rank joins the world through the base of the strategy's ``setup`` (what
is left once the combinators' layers are peeled off: ``ddp()``'s join, say)
the first time it sees that base, and keeps the joined `Context` for every
later run with an equal base, so the process group is built once per kind of
world, not per example or per combinator stack. The combinators' setup layers
run again for every run, on that joined context: every run starts from fresh
per-run state (``ctx.extras``: accumulation counters, scalers), so a law's
verdict never depends on what ran before. A run with a different base leaves
the old world (the old strategy's ``teardown``) and joins anew through a fresh
rendezvous store.

A run that raised is followed, before it is reported, by every rank leaving
its world; a rank whose leaving fails (a background save still failing in
the teardown, say), dies or hangs is replaced, with all the others, by fresh
processes. A rank found dead before a run is replaced too. So the next run
starts clean, and its verdict names only its own strategy.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, TypeVar

import attrs

from stratagem._processes import (
    death_error,
    local_env,
    pack,
    prepare_rank,
    receive,
    remote_error,
    rendezvous,
    send,
    send_error,
    stop,
)
from stratagem.env import Context, Env
from stratagem.errors import LaunchError, RankError, UsageError
from stratagem.layers import peel, rebased
from stratagem.strategy import StrategyLike
from stratagem.validators import is_int, is_number, require

__all__ = ["World", "WorldTimeoutError"]

R = TypeVar("R")

_START_TIMEOUT = 120.0  # seconds for a rank to import torch and report, on a loaded machine


class WorldTimeoutError(RankError, TimeoutError):
    """A rank of a `World` did not finish within the world's timeout; the world was restarted."""


class World:
    """Persistent local ranks with a joined process group, for running many functions.

    Use it as a context manager; no rank outlives the ``with`` block.

    Args:
        world_size: number of ranks (processes) to start.
        timeout: seconds a run may take on every rank. A rank that takes longer
            is taken as hung: the world is torn down, restarted, and the run
            raises `WorldTimeoutError` naming the ranks that did not finish.
        error_grace: seconds the other ranks get to finish once one rank has
            raised; ranks still busy then (waiting in a collective for the
            rank that raised) are stopped and the world restarted.

    Raises:
        UsageError: ``world_size`` is not a positive int, or a timeout is not positive.

    Example:
        >>> import stratagem as sg
        >>> from stratagem.testing import World
        >>> from stratagem.testing.examples import rank_and_size
        >>> with World(2) as world:
        ...     world.run(rank_and_size, sg.ddp())
        [(0, 2), (1, 2)]
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0, error_grace: float = 5.0) -> None:
        require(is_int(world_size, 1), "World: 'world_size'", "a positive int", world_size)
        for name, value in (("timeout", timeout), ("error_grace", error_grace)):
            seconds = is_number(value, above=0, finite=False)
            require(seconds, f"World: '{name}'", "a positive number of seconds", value)
        self.world_size = world_size
        self.timeout = float(timeout)
        self.error_grace = float(error_grace)
        self._processes: list[BaseProcess] = []
        self._to_ranks: list[Connection] = []
        self._from_ranks: list[Connection] = []
        self._store = contextlib.ExitStack()  # the rendezvous of the current setup
        self._setup: object = None  # the setup the ranks have joined with, None: not joined
        self._generation = 0
        self._port = 0
        self.restarts = 0

    # --- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Start the ranks (a `World` used as a context manager does this itself)."""
        if self._processes:
            return
        context = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            task_reader, task_writer = context.Pipe(duplex=False)
            result_reader, result_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_loop,
                args=(rank, self.world_size, task_reader, result_writer),
                name=f"stratagem-world-rank-{rank}",
            )
            process.start()
            task_reader.close()
            result_writer.close()
            self._processes.append(process)
            self._to_ranks.append(task_writer)
            self._from_ranks.append(result_reader)
        self._await_ready()

    def _await_ready(self) -> None:
        """Wait until every rank has imported what it needs, so runs are timed, not start-up."""
        deadline = time.monotonic() + _START_TIMEOUT
        for rank, pipe in enumerate(self._from_ranks):
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise LaunchError(f"World: rank {rank} did not start within {_START_TIMEOUT:g} s.")
            try:
                receive(pipe)
            except EOFError:
                error = death_error(rank, self._processes[rank], self.error_grace)
                self.close()
                raise error from None

    def close(self) -> None:
        """Ask every rank to leave its world and exit; stop the ones that do not."""
        for pipe in self._to_ranks:
            with contextlib.suppress(OSError):  # that rank is already gone
                send(pipe, ("stop",))
        deadline = time.monotonic() + self.error_grace
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        stop(self._processes, self.error_grace)
        for pipe in (*self._to_ranks, *self._from_ranks):
            pipe.close()
        self._processes, self._to_ranks, self._from_ranks = [], [], []
        self._leave_store()

    def restart(self) -> None:
        """Stop every rank and start fresh ones (after a hang or a rank that died)."""
        self.close()
        self.restarts += 1
        self.start()

    def _leave_store(self) -> None:
        self._store.close()
        self._setup = None

    # --- running ------------------------------------------------------------------------

    def run(self, fn: Callable[..., R], strategy: StrategyLike, *args: Any) -> list[R]:
        """Call ``fn(strategy, ctx, *args)`` on every rank; return the results in rank order.

        Raises:
            LaunchError: ``fn``, ``strategy`` or ``args`` cannot be pickled.
            RankError: a rank raised (the lowest such rank is named, with its traceback)
                or died; a world with a dead or stuck rank is restarted first.
            WorldTimeoutError: a rank did not finish within ``timeout``.
        """
        if not self._processes:
            raise UsageError("World.run: the world is not started; use it as a context manager.")
        payload = pack(fn, strategy, args)
        if not all(process.is_alive() for process in self._processes):
            self.restart()  # a rank died after the last run: this run must not be blamed
        port = self._join_port(strategy)
        for pipe in self._to_ranks:
            send(pipe, ("run", self._generation, port, payload))
        return self._collect()

    def _join_port(self, strategy: StrategyLike) -> int:
        """Port of the rendezvous for the base of ``strategy``'s setup: the current one, or anew."""
        base = peel(strategy.setup)[1]
        if self._setup is None or self._setup != base:
            self._leave_store()
            self._port = self._store.enter_context(rendezvous(max(self.timeout, 30.0)))
            self._setup, self._generation = base, self._generation + 1
        return self._port

    def _collect(self) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, RankError] = {}
        deadline = time.monotonic() + self.timeout
        watching = dict(enumerate(self._from_ranks))
        while watching:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = wait(list(watching.values()), remaining)
            for rank, pipe in list(watching.items()):
                if pipe not in ready:
                    continue
                del watching[rank]
                try:
                    kind, *body = receive(pipe)
                except EOFError:
                    errors[rank] = death_error(rank, self._processes[rank], self.error_grace)
                    continue
                if kind == "ok":
                    results[rank] = body[0]
                else:
                    errors[rank] = remote_error(rank, body)
            if errors and watching:
                deadline = min(deadline, time.monotonic() + self.error_grace)
        if watching or any(e.exc_type is None for e in errors.values()):
            stuck = sorted(watching)
            self.restart()  # a rank is hung or dead: nothing it shares can be trusted
            if errors:
                raise errors[min(errors)]
            raise WorldTimeoutError(
                stuck[0],
                exc_type=None,
                message=(
                    f"ranks {stuck} did not finish within {self.timeout:g} s; "
                    "the world was restarted"
                ),
            )
        if errors:
            # Ranks that raised left their setup's state unknown: every rank leaves its world
            # now, and a world that cannot be left is replaced, so the next run starts clean.
            if not self._left():
                self.restart()
            self._leave_store()
            raise errors[min(errors)]
        return [results[rank] for rank in range(self.world_size)]

    def _left(self) -> bool:
        """Ask every rank to leave its world; whether all did, cleanly, within the timeout."""
        try:
            for pipe in self._to_ranks:
                send(pipe, ("leave",))
        except OSError:
            return False
        deadline = time.monotonic() + self.timeout
        for pipe in self._from_ranks:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                return False
            try:
                reply = receive(pipe)
            except (EOFError, OSError):
                return False
            if reply != ("left",):
                return False
        return True


@attrs.frozen
class _Joined:
    """A setup base that returns the context joined earlier, so only the layers above run again."""

    ctx: Context

    def __call__(self, env: Env) -> Context:
        return self.ctx


def _rank_loop(rank: int, world_size: int, tasks: Connection, results: Connection) -> None:
    """Body of a world rank: run tasks until told to stop, rejoining when the setup's base changes.

    Every setup layer (an attrs callable with an ``inner`` field, as combinators make)
    runs again for every run: a layer must only add per-run state, never join a group
    or hold a resource that the base's teardown does not release.
    """
    joined: tuple[int, StrategyLike, Context] | None = None
    unclean: BaseException | None = None  # a teardown that raised after a failed run

    def leave() -> None:
        nonlocal joined
        if joined is not None:
            _, strategy, ctx = joined
            joined = None
            gc.collect()  # a live DDP reducer must not outlast the group it uses
            strategy.teardown(ctx)

    prepare_rank(local_env(rank, world_size, 0))
    send(results, ("ready",))
    try:
        while True:
            message = receive(tasks)
            if message[0] == "stop":
                break
            if message[0] == "leave":  # after a failed run: leave, and say whether it went well
                try:
                    leave()
                    if unclean is not None:
                        raise unclean
                    send(results, ("left",))
                except BaseException as error:
                    send_error(results, error)  # the parent replaces this process
                    break
                continue
            _, generation, port, payload = message
            try:
                fn, strategy, args = pickle.loads(payload)
                env = local_env(rank, world_size, port)
                layers, base = peel(strategy.setup)
                if joined is None or joined[0] != generation:
                    leave()
                    joined = (generation, strategy, base(env))
                # The layers' per-run state is made afresh for every run, on the joined world.
                result = fn(strategy, rebased(layers, _Joined(joined[2]))(env), *args)
                send(results, ("ok", result))
            except BaseException as error:  # everything goes back to the parent
                send_error(results, error)
                try:
                    leave()  # at once: ranks waiting for this one in a collective see it go
                except BaseException as failed:  # reported when the parent asks ("leave")
                    unclean = failed
            finally:
                result = None
    except EOFError:
        pass  # the parent is gone
    finally:
        try:
            leave()
        finally:
            results.close()
            os._exit(0)  # skip interpreter finalisation, where gloo teardown can hang
