"""The spawn launcher: start N local ranks, collect their results, never wait forever.

The parent hosts the rendezvous store on a socket it bound to 127.0.0.1 (no
port race, nothing listening on other interfaces), starts one ``spawn``
process per rank, and reads one message per rank from a pipe: the result, or
the exception with its traceback. A rank that fails stops the others within
``stop_grace`` seconds; a rank that does not exit after sending its result is
killed after ``exit_timeout`` seconds, so a hang in process-group teardown
cannot hang the caller.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import attrs

from stratagem.env import Env, detect_env
from stratagem.errors import UsageError, describe
from stratagem.launchers import check_field_arguments, in_place
from stratagem.processes import (
    death_error,
    forwarding_signals,
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
from stratagem.strategy import StrategyLike

__all__ = ["MAX_SECONDS", "Spawn", "spawn_launcher"]


# The pipes' wait() takes milliseconds as a C int: about 24 days at most. Longer waits are a
# typo or a wish for "forever", which a launcher should not grant a hung rank.
MAX_SECONDS = 1_000_000


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_SECONDS  # also refuses NaN and infinity
    ):
        raise UsageError(
            f"Spawn.{attribute.name} must be a positive number of seconds, at most "
            f"{MAX_SECONDS} (got {describe(value)})."
        )


@attrs.frozen(kw_only=True)
class Spawn:
    """Launch field that starts ``devices`` processes on this host.

    Inside a world torchrun or SLURM started, or for ``devices=1``, it runs in
    place instead: a launcher never starts processes inside another launcher's world.

    Attributes:
        stop_grace: seconds the surviving ranks get to exit after SIGTERM when
            a rank failed, before SIGKILL.
        exit_timeout: seconds a rank gets to exit after it sent its result,
            before it is killed (its result is kept).
        store_timeout: seconds the rendezvous store waits for a rank to connect.

    Raises:
        UsageError: a setting is not a positive number of seconds up to `MAX_SECONDS`.
    """

    stop_grace: float = attrs.field(default=5.0, validator=_positive_seconds)
    exit_timeout: float = attrs.field(default=30.0, validator=_positive_seconds)
    store_timeout: float = attrs.field(default=300.0, validator=_positive_seconds)

    def __call__(
        self, fn: Callable[..., Any], strategy: StrategyLike, devices: int, args: Sequence[Any]
    ) -> list[Any]:
        check_field_arguments(fn, devices, args)
        if devices == 1 or detect_env(os.environ).is_distributed:
            return in_place(fn, strategy, devices, args)
        payload = pack(fn, strategy, args)
        with rendezvous(self.store_timeout) as port:
            return _World(self, devices, port, payload).run()


def spawn_launcher(start: object, factory: str) -> Spawn:
    """Return the launch field of a ``*_spawn`` factory: ``start``, or ``Spawn()`` for None.

    Raises:
        UsageError: ``start`` is neither None nor a `Spawn`.
    """
    if start is None:
        return Spawn()
    if not isinstance(start, Spawn):
        raise UsageError(
            f"{factory}: 'start' must be None or a Spawn (got {describe(start)}), e.g. "
            "Spawn(stop_grace=10)."
        )
    return start


@attrs.define
class _World:
    """The parent's view of the spawned ranks, for one launch."""

    options: Spawn
    devices: int
    port: int
    payload: bytes
    processes: list[BaseProcess] = attrs.field(factory=list)
    pipes: list[Connection] = attrs.field(factory=list)

    def run(self) -> list[Any]:
        context = multiprocessing.get_context("spawn")
        with forwarding_signals(self.processes):
            return self._start_and_collect(context)

    def _start_and_collect(self, context: Any) -> list[Any]:
        try:
            for rank in range(self.devices):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(
                    target=_rank_main,
                    args=(writer, self.payload, local_env(rank, self.devices, self.port)),
                    name=f"stratagem-rank-{rank}",
                )
                process.start()
                writer.close()  # the child holds the only writing end: EOF means it is gone
                self.processes.append(process)
                self.pipes.append(reader)
            return self._collect()
        finally:
            stop(self.processes, self.options.stop_grace)
            for pipe in self.pipes:
                pipe.close()

    def _collect(self) -> list[Any]:
        """Read every rank's result; raise on the first error or death.

        After its result a rank only tears down, so it gets ``exit_timeout``
        seconds to close its pipe (a teardown error still arrives as a message);
        past that it is killed and its result kept.
        """
        results: dict[int, Any] = {}
        done_at: dict[int, float] = {}
        watching = dict(enumerate(self.pipes))
        while watching:
            now = time.monotonic()
            for rank in [r for r in watching if r in done_at]:
                if now - done_at[rank] > self.options.exit_timeout:
                    del watching[rank]  # lingering after its result: `stop` kills it
            if not watching:
                break
            deadlines = [
                done_at[r] + self.options.exit_timeout - now for r in watching if r in done_at
            ]
            timeout = max(0.0, min(deadlines)) if len(deadlines) == len(watching) else None
            ready = wait(list(watching.values()), timeout)
            for rank, pipe in list(watching.items()):
                if pipe not in ready:
                    continue
                try:
                    kind, *body = receive(pipe)
                except EOFError:
                    del watching[rank]
                    if rank not in results:
                        raise death_error(
                            rank, self.processes[rank], self.options.stop_grace
                        ) from None
                    continue
                if kind == "error":
                    raise remote_error(rank, body)
                results[rank] = body[0]
                done_at[rank] = time.monotonic()
        return [results[rank] for rank in range(self.devices)]


def _rank_main(pipe: Connection, payload: bytes, env: Env) -> None:
    """Body of a spawned rank: join, run, report, leave, and exit without interpreter teardown."""
    code = 0
    prepare_rank(env)
    try:
        fn, strategy, args = pickle.loads(payload)
        ctx = strategy.setup(env)
        try:
            result = fn(strategy, ctx, *args)
            send(pipe, ("ok", result))
            del result
        finally:
            # Free the user's objects (a DDP reducer above all) before the process group goes:
            # destroying a gloo group under a live DDP module can deadlock.
            gc.collect()
            strategy.teardown(ctx)
    except BaseException as error:  # report everything, KeyboardInterrupt included
        send_error(pipe, error)
        code = 1
    finally:
        pipe.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter finalisation: atexit hooks of torch/gloo are where exits hang.
        os._exit(code)
