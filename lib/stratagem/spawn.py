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

import contextlib
import gc
import multiprocessing
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import attrs
import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time

from stratagem.env import Env, detect_env
from stratagem.errors import LaunchError, RankError, UsageError, describe
from stratagem.launchers import in_place
from stratagem.strategy import StrategyLike

__all__ = ["Spawn"]


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UsageError(
            f"Spawn.{attribute.name} must be a positive number of seconds (got {describe(value)})."
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
    """

    stop_grace: float = attrs.field(default=5.0, validator=_positive_seconds)
    exit_timeout: float = attrs.field(default=30.0, validator=_positive_seconds)
    store_timeout: float = attrs.field(default=300.0, validator=_positive_seconds)

    def __call__(
        self, fn: Callable[..., Any], strategy: StrategyLike, devices: int, args: Sequence[Any]
    ) -> list[Any]:
        if devices == 1 or detect_env(os.environ).is_distributed:
            return in_place(fn, strategy, devices, args)
        payload = _payload(fn, strategy, args)
        with _rendezvous(self.store_timeout) as port:
            return _World(self, devices, port, payload).run()


def _payload(fn: Callable[..., Any], strategy: StrategyLike, args: Sequence[Any]) -> bytes:
    """Pickle what every rank needs, failing before any process starts."""
    for what, value in (("fn", fn), ("strategy", strategy), ("args", tuple(args))):
        try:
            pickle.dumps(value)
        except Exception as error:
            raise LaunchError(
                f"launch: {what} {describe(value)} cannot be sent to spawned processes "
                f"({type(error).__name__}: {error}). Define functions at module level (not "
                "lambdas or closures) and pass picklable arguments, or start the ranks "
                "with torchrun and a strategy that runs in place."
            ) from None
    return pickle.dumps((fn, strategy, tuple(args)))


@contextlib.contextmanager
def _rendezvous(timeout: float) -> Iterator[int]:
    """Serve a TCPStore from this process on a socket bound to 127.0.0.1; yield its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port: int = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    # The store takes the listening socket over (and closes it when it is freed).
    store = TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
        master_listen_fd=listener.detach(),
    )
    try:
        yield port
    finally:
        del store


def _remote_error(rank: int, body: list[Any]) -> RankError:
    exc_type, message, remote = body
    return RankError(rank, exc_type=exc_type, message=message, remote_traceback=remote)


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
        try:
            for rank in range(self.devices):
                reader, writer = context.Pipe(duplex=False)
                env = Env(
                    rank=rank,
                    local_rank=rank,
                    world_size=self.devices,
                    local_world_size=self.devices,
                    master_addr="127.0.0.1",
                    master_port=self.port,
                    source="spawn",
                    agent_store=True,
                )
                process = context.Process(
                    target=_rank_main,
                    args=(writer, self.payload, env),
                    name=f"stratagem-rank-{rank}",
                )
                process.start()
                writer.close()  # the child holds the only writing end: EOF means it is gone
                self.processes.append(process)
                self.pipes.append(reader)
            return self._collect()
        finally:
            self._stop()
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
                    del watching[rank]  # lingering after its result: `_stop` kills it
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
                    kind, *body = _receive(pipe)
                except EOFError:
                    del watching[rank]
                    if rank not in results:
                        raise self._died(rank) from None
                    continue
                if kind == "error":
                    raise _remote_error(rank, body)
                results[rank] = body[0]
                done_at[rank] = time.monotonic()
        return [results[rank] for rank in range(self.devices)]

    def _died(self, rank: int) -> RankError:
        process = self.processes[rank]
        process.join(self.options.stop_grace)
        code = process.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code} without reporting a result"
        return RankError(rank, exc_type=None, message=f"process {process.pid} {how}", exitcode=code)

    def _stop(self) -> None:
        """Let exiting ranks finish, terminate the rest, then kill what ignores SIGTERM."""
        deadline = time.monotonic() + self.options.stop_grace
        for process in self.processes:
            if process.is_alive() and process.exitcode is None:
                process.join(0.05)
        alive = [p for p in self.processes if p.is_alive()]
        for process in alive:
            process.terminate()
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
            process.close()


def _send(pipe: Connection, message: tuple[Any, ...]) -> None:
    # Plain pickle, not multiprocessing's: torch's reducers would share tensor storage
    # through file descriptors that die with this process before the parent reads them.
    pipe.send_bytes(pickle.dumps(message))


def _receive(pipe: Connection) -> tuple[Any, ...]:
    message: tuple[Any, ...] = pickle.loads(pipe.recv_bytes())
    return message


def _send_error(pipe: Connection, error: BaseException) -> None:
    kind = type(error)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    with contextlib.suppress(Exception):  # a broken pipe: the parent is gone, nobody to tell
        _send(pipe, ("error", name, str(error), traceback.format_exc()))


def _rank_main(pipe: Connection, payload: bytes, env: Env) -> None:
    """Body of a spawned rank: join, run, report, leave, and exit without interpreter teardown."""
    code = 0
    os.environ.setdefault(
        "GLOO_SOCKET_IFNAME", "lo"
    )  # loopback only: spawned ranks share this host
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    try:
        fn, strategy, args = pickle.loads(payload)
        ctx = strategy.setup(env)
        try:
            result = fn(strategy, ctx, *args)
            _send(pipe, ("ok", result))
            del result
        finally:
            # Free the user's objects (a DDP reducer above all) before the process group goes:
            # destroying a gloo group under a live DDP module can deadlock.
            gc.collect()
            strategy.teardown(ctx)
    except BaseException as error:  # report everything, KeyboardInterrupt included
        _send_error(pipe, error)
        code = 1
    finally:
        pipe.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter finalisation: atexit hooks of torch/gloo are where exits hang.
        os._exit(code)
