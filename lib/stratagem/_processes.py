"""Process plumbing (private): the spawn launcher's ranks, and what the kit's `World` shares.

Messages between parent and ranks are tuples pickled with plain ``pickle``
over one-way pipes; the rendezvous store is served by the parent on a socket
bound to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
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

from stratagem.env import Env
from stratagem.errors import LaunchError, RankError, describe
from stratagem.strategy import StrategyLike

_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>

__all__ = [
    "SpawnedWorld",
    "death_error",
    "forwarding_signals",
    "local_env",
    "pack",
    "prepare_rank",
    "rank_main",
    "receive",
    "remote_error",
    "rendezvous",
    "send",
    "send_error",
    "stop",
]


def _die_with_parent() -> None:
    # Linux: if the launching process dies without cleaning up (SIGKILL), its ranks die too.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Interrupted(BaseException):
    """A signal reached the launching process while ranks were running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def forwarding_signals(processes: Sequence[BaseProcess]) -> Iterator[None]:
    """Inside, SIGINT and SIGTERM reach the ranks too; a second signal kills them at once.

    After the ranks are stopped, the first signal is delivered to this process
    as it would have been: SIGINT as ``KeyboardInterrupt``, SIGTERM to the
    handler that was installed before (by default, the process ends).
    Outside the main thread, signals cannot be caught and nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        for process in processes:
            with contextlib.suppress(ProcessLookupError, ValueError, AttributeError):
                if process.is_alive() and process.pid is not None:
                    os.kill(process.pid, signal.SIGKILL if len(received) > 1 else signum)
        if len(received) == 1:
            raise _Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except _Interrupted as interrupted:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if interrupted.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        os.kill(os.getpid(), interrupted.signum)  # now handled as before the launch
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def local_env(rank: int, world_size: int, port: int) -> Env:
    """Describe rank ``rank`` of a world spawned on this host, its store served by the parent."""
    return Env(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        master_addr="127.0.0.1",
        master_port=port,
        source="spawn",
        agent_store=True,
    )


def prepare_rank(env: Env) -> None:
    """Settle a spawned rank's process before it joins: loopback sockets, a fair share of cores."""
    _die_with_parent()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # spawned ranks share this host
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))


def pack(fn: Callable[..., Any], strategy: StrategyLike, args: Sequence[Any]) -> bytes:
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
def rendezvous(timeout: float) -> Iterator[int]:
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


def remote_error(rank: int, body: list[Any]) -> RankError:
    exc_type, message, remote = body
    return RankError(rank, exc_type=exc_type, message=message, remote_traceback=remote)


def send(pipe: Connection, message: tuple[Any, ...]) -> None:
    # Plain pickle, not multiprocessing's: torch's reducers would share tensor storage
    # through file descriptors that die with this process before the parent reads them.
    pipe.send_bytes(pickle.dumps(message))


def receive(pipe: Connection) -> tuple[Any, ...]:
    message: tuple[Any, ...] = pickle.loads(pipe.recv_bytes())
    return message


def send_error(pipe: Connection, error: BaseException) -> None:
    kind = type(error)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    with contextlib.suppress(Exception):  # a broken pipe: the parent is gone, nobody to tell
        send(pipe, ("error", name, str(error), traceback.format_exc()))


def death_error(rank: int, process: BaseProcess, grace: float) -> RankError:
    """Describe a rank whose process ended without reporting (killed, crashed)."""
    process.join(grace)
    code = process.exitcode
    if code is not None and code < 0:
        how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code} without reporting a result"
    return RankError(rank, exc_type=None, message=f"process {process.pid} {how}", exitcode=code)


def stop(processes: Sequence[BaseProcess], grace: float) -> None:
    """Let exiting processes finish, terminate the rest, then kill what ignores SIGTERM."""
    deadline = time.monotonic() + grace
    for process in processes:
        if process.is_alive():
            process.join(0.05)
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
        process.close()


@attrs.define
class SpawnedWorld:
    """The parent's view of the spawned ranks, for one launch."""

    options: Any  # the Spawn launch field: stop_grace, exit_timeout
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
                    target=rank_main,
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


def rank_main(pipe: Connection, payload: bytes, env: Env) -> None:
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
