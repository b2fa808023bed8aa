"""Process plumbing (private): the spawn launcher's ranks, and what the kit's `World` shares.

Messages between parent and ranks are tuples pickled with plain ``pickle``
over one-way pipes; the rendezvous store is served by the parent on a socket
bound to 127.0.0.1.

A spawned rank must die with the process that started it, whenever that dies,
also in its first seconds. This module is what a rank unpickles first (its
entry point, `rank_main`), so it imports no torch at module level: the
parent-death signal is armed before the slow imports, and the parent checked
again after arming (see `die_with_parent`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import inspect
import multiprocessing
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import attrs

from stratagem import pending
from stratagem.arrivals import mark_left
from stratagem.errors import LaunchError, Preempted, RankError, describe

if TYPE_CHECKING:
    from stratagem.env import Context, Env
    from stratagem.fields import StrategyLike

_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>

__all__ = [
    "LEFT_DURING_COLLECTIVE",
    "NO_MAIN_GUARD",
    "SpawnedWorld",
    "death_error",
    "die_with_parent",
    "error_message",
    "error_report",
    "first_cause",
    "forwarding_signals",
    "handling",
    "in_collective",
    "local_env",
    "local_variables",
    "pack",
    "prepare_rank",
    "rank_main",
    "receive",
    "remote_error",
    "rendezvous",
    "send",
    "send_error",
    "stop",
    "torn_down",
]

LEFT_DURING_COLLECTIVE = (
    "rank(s) {finished} returned from the launched function while rank {rank} was still in a "
    "collective, so rank {rank}'s collective failed ({exc_type}: {message}). Every rank must "
    "make the same collective calls in the same order: call it on rank(s) {finished} too, or "
    "on no rank."
)


def _arm_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; whether that is now set."""
    if not sys.platform.startswith("linux"):
        return False
    # prctl is variadic and reads unsigned longs: pass them as such, and check the result.
    arguments = (ctypes.c_ulong(signal.SIGKILL), *(ctypes.c_ulong(0),) * 3)
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, *arguments)) == 0
    except (OSError, AttributeError):
        return False


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(sentinel: int) -> None:
    wait([sentinel])  # readable (EOF) only once the parent's end is closed: it is gone
    _kill_self()


def die_with_parent() -> None:
    """End this spawned process when the process that started it ends, whenever that happens.

    The parent-death signal (SIGKILL, which no handler catches) only covers a
    parent that dies after it is armed; a parent that died in the child's
    first moments has left it to init already, which the check of the parent
    pid that follows catches. Where the signal cannot be armed (not Linux), a
    daemon thread watches the parent's sentinel instead. Outside a
    multiprocessing child this does nothing.
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return
    armed = _arm_parent_death_signal()
    if os.getppid() != parent.pid:  # the launcher died before the signal was armed
        _kill_self()
    if not armed and parent.sentinel is not None:
        threading.Thread(
            target=_watch_parent, args=(parent.sentinel,), name="stratagem-parent", daemon=True
        ).start()


class _Interrupted(BaseException):
    """A signal reached the launching process while ranks were running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@attrs.define
class Signalled:
    """The stop signal the launching process passed on to its ranks, and when."""

    signum: int = 0
    at: float = 0.0


# A scheduler's stop signals: passed on, they give the ranks stop_grace seconds to save and
# end (as `sg.on_preemption` lets them); SIGINT (Ctrl-C) stops the ranks at once.
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)
)


@contextlib.contextmanager
def handling(signals: Iterable[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Inside, ``handler`` handles ``signals``; on the way out, the handlers before it again."""
    previous = {number: signal.signal(number, handler) for number in signals}
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


@contextlib.contextmanager
def forwarding_signals(processes: Sequence[BaseProcess]) -> Iterator[Signalled]:
    """Inside, SIGINT, SIGTERM and SIGUSR1 reach the ranks too; a second signal kills them.

    SIGINT ends the launch at once. SIGTERM and SIGUSR1, a scheduler's stop
    signals, only set the yielded `Signalled`: the launch goes on collecting, so
    ranks that save and raise `Preempted` end the launch the same way, and
    ranks that ignore the signal are stopped after ``stop_grace`` seconds
    (`SpawnedWorld`). When the launch ends because of a signal, it is delivered
    to this process as it would have been: SIGINT as ``KeyboardInterrupt``, the
    others to the handler that was installed before (by default, the process ends).
    Outside the main thread, signals cannot be caught and nothing changes.
    """
    signalled = Signalled()
    if threading.current_thread() is not threading.main_thread():
        yield signalled
        return
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        for process in processes:
            with contextlib.suppress(ProcessLookupError, ValueError, AttributeError):
                if process.is_alive() and process.pid is not None:
                    os.kill(process.pid, signal.SIGKILL if len(received) > 1 else signum)
        if len(received) == 1 and signum in _STOP_SIGNALS:
            signalled.signum, signalled.at = signum, time.monotonic()
        elif len(received) == 1:
            raise _Interrupted(signum)

    try:
        with handling((signal.SIGINT, *_STOP_SIGNALS), handler):
            yield signalled
    except _Interrupted as interrupted:
        if interrupted.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        os.kill(os.getpid(), interrupted.signum)  # now handled as before the launch
        raise


def local_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    """Return the variables of rank ``rank`` of a world on this host, as torchrun gives its ranks.

    The launcher serves the store (``TORCHELASTIC_USE_AGENT_STORE``). Ray's actors
    get them in their ``os.environ``; a spawned rank reads its `Env` from them.
    """
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "true",
    }


def local_env(rank: int, world_size: int, port: int) -> Env:
    """Describe rank ``rank`` of a world spawned on this host, its store served by the parent."""
    from stratagem.env import detect_env  # imports torch: not before a rank armed its death signal

    return attrs.evolve(detect_env(local_variables(rank, world_size, port)), source="spawn")


def prepare_rank(env: Env) -> None:
    """Settle a spawned rank's process before it joins: loopback sockets, a fair share of cores.

    First of all it makes the rank die with its parent (`die_with_parent`).
    """
    die_with_parent()
    import torch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # spawned ranks share this host
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))


_SPAWN_FIX = (
    ". Define functions at module level (not lambdas or closures) and pass picklable "
    "arguments, or start the ranks with torchrun and a strategy that runs in place"
)


def pack(
    fn: Callable[..., Any],
    strategy: StrategyLike,
    args: Sequence[Any],
    *,
    dumps: Callable[[object], bytes] = pickle.dumps,
    to: str = "spawned processes",
    fix: str = _SPAWN_FIX,
) -> bytes:
    """Pickle what every rank needs with ``dumps``, failing before any process starts.

    Raises:
        LaunchError: something cannot be pickled; the message names the part
            (``fn``, ``strategy`` or ``args``), where it was to go (``to``) and the ``fix``.
    """
    args = tuple(args)
    whole: object = (fn, strategy, args)
    try:
        return bytes(dumps(whole))
    except Exception as error:
        what, value, failure = "(fn, strategy, args)", whole, error
    for name, part in (("fn", fn), ("strategy", strategy), ("args", args)):
        try:  # name the part that cannot travel
            dumps(part)
        except Exception as error:
            what, value, failure = name, part, error
            break
    raise LaunchError(
        f"launch: {what} {describe(value)} cannot be sent to {to} "
        f"({type(failure).__name__}: {failure}){fix}."
    ) from None


@contextlib.contextmanager
def rendezvous(timeout: float) -> Iterator[int]:
    """Serve a TCPStore from this process on a socket bound to 127.0.0.1; yield its port."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time

    listener = socket.create_server(("127.0.0.1", 0), backlog=128)  # closed if it fails
    port: int = listener.getsockname()[1]
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


def error_message(error: BaseException) -> str:
    """Return ``str(error)``, or its ``repr`` (and what failed) when its ``__str__`` raises."""
    try:
        return str(error)
    except Exception as failure:
        shown = _shown(functools.partial(repr, error), f"<{type(error).__qualname__} object>")
        cause = f"{type(failure).__name__}: {_shown(functools.partial(str, failure), '?')}"
        return f"{shown} (its __str__ raised {cause})"


def _shown(show: Callable[[], str], otherwise: str) -> str:
    """Return ``show()``, or ``otherwise`` where that raises: a report must not fail on its text."""
    try:
        return show()
    except Exception:
        return otherwise


def error_report(error: BaseException) -> tuple[str, str, str, str]:
    """Return ``("error", type name, message, traceback)``: what a rank reports of ``error``."""
    kind = type(error)
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    remote = _shown(traceback.format_exc, "")
    return ("error", module + kind.__qualname__, error_message(error), remote)


def send_error(pipe: Connection, error: BaseException) -> None:
    with contextlib.suppress(Exception):  # a broken pipe: the parent is gone, nobody to tell
        send(pipe, error_report(error))


NO_MAIN_GUARD = (
    "the script launches at import: each spawned rank imports the main script again, and its "
    'top-level launch ran there too. Put the launch call under `if __name__ == "__main__":`.'
)
_NO_MAIN_GUARD_EXIT = 87  # a spawned rank's exit code for NO_MAIN_GUARD, before it can report


def refuse_launch_at_import() -> None:
    """In a spawned rank that is importing the main script, end it: the script has no guard.

    Without ``if __name__ == "__main__":`` the rank would start ranks of its own
    (multiprocessing refuses, in a long traceback); one line and an exit code the
    launcher recognises say what to change instead.
    """
    if "__mp_main__" not in sys.modules:  # only a spawned child imports the script under it
        return
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "__mp_main__" and frame.f_code.co_name == "<module>":
            print(f"stratagem: {NO_MAIN_GUARD}", file=sys.stderr, flush=True)
            os._exit(_NO_MAIN_GUARD_EXIT)
        frame = frame.f_back


def death_error(rank: int, process: BaseProcess, grace: float) -> RankError:
    """Describe a rank whose process ended without reporting (killed, crashed)."""
    process.join(grace)
    code = process.exitcode
    if code == _NO_MAIN_GUARD_EXIT:
        return RankError(rank, exc_type=None, message=NO_MAIN_GUARD, exitcode=code)
    if code is not None and code < 0:
        how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code} without reporting a result"
    return RankError(rank, exc_type=None, message=f"process {process.pid} {how}", exitcode=code)


KILL_WAIT = 10.0  # seconds a killed process gets to be reaped


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
            # Bounded: a process in uninterruptible sleep outlives SIGKILL until the kernel
            # lets go; the launcher reports and returns rather than hang with it.
            process.join(KILL_WAIT)
        if process.exitcode is not None:  # close() refuses a process still running
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
    signalled: Signalled = attrs.field(factory=Signalled)

    def run(self) -> list[Any]:
        context = multiprocessing.get_context("spawn")
        with forwarding_signals(self.processes) as self.signalled:
            try:
                for rank in range(self.devices):
                    reader, writer = context.Pipe(duplex=False)
                    process = context.Process(
                        target=rank_main,
                        # Plain ints, not an Env: unpickling one would import torch before the
                        # rank could arm its parent-death signal.
                        args=(writer, self.payload, rank, self.devices, self.port),
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
        preempted: dict[int, int] = {}  # rank -> the signal its Preempted names
        watching = dict(enumerate(self.pipes))
        while watching:
            now = time.monotonic()
            for rank in [r for r in watching if r in done_at]:
                if now - done_at[rank] > self.options.exit_timeout:
                    del watching[rank]  # lingering after its result: `stop` kills it
            if not watching:
                break
            signalled = self.signalled.signum
            if signalled and now - self.signalled.at > self.options.stop_grace:
                raise _Interrupted(signalled)  # the ranks had their grace: stop them
            # Wake for the first rank to overstay, once every rank is past its result, or
            # for the end of the ranks' grace after a stop signal; else only for a message.
            ends = [done_at[r] + self.options.exit_timeout for r in watching if r in done_at]
            ends = ends if len(ends) == len(watching) else []
            if signalled:
                ends.append(self.signalled.at + self.options.stop_grace)
            ready = wait(list(watching.values()), max(0.0, min(ends) - now) if ends else None)
            for rank, pipe in list(watching.items()):
                if pipe not in ready:
                    continue
                try:
                    kind, *body = receive(pipe)
                except EOFError:
                    del watching[rank]
                    if rank not in results and rank not in preempted:
                        died = death_error(rank, self.processes[rank], self.options.stop_grace)
                        if self.signalled.signum and died.exitcode == -self.signalled.signum:
                            raise _Interrupted(self.signalled.signum) from None  # not handled
                        raise died from None
                    continue
                if kind == "error":
                    raise first_cause(
                        remote_error(rank, body), results, self._late(rank, watching, results)
                    )
                # "preempted": it saved and raised Preempted, and the others will too.
                kept = preempted if kind == "preempted" else results
                kept[rank] = body[0]
                done_at[rank] = time.monotonic()
        if preempted:
            raise Preempted(preempted[min(preempted)])  # 75 under SLURM, else 128 + signal
        return [results[rank] for rank in range(self.devices)]

    def _late(
        self, rank: int, watching: dict[int, Connection], results: dict[int, Any]
    ) -> Iterator[tuple[int, RankError | None]]:
        """Yield what the other ranks sent before ``rank``'s error, for `first_cause`."""
        others = {other: pipe for other, pipe in watching.items() if other != rank}
        ready = wait(list(others.values()), _CAUSE_GRACE) if others else []
        for other, pipe in others.items():
            if pipe not in ready:
                continue
            try:
                kind, *_ = receive(pipe)
            except EOFError:
                if other not in results:
                    yield other, death_error(other, self.processes[other], self.options.stop_grace)
                continue
            if kind == "ok":
                yield other, None


# Seconds the parent waits, after a rank's collective failed, for what the others sent before.
_CAUSE_GRACE = 0.5
_FRAME = re.compile(r'^\s*File "([^"]*)"', re.MULTILINE)


def first_cause(
    error: RankError, finished: Iterable[int], late: Iterable[tuple[int, RankError | None]]
) -> RankError:
    """Return the error to raise for a rank's ``error``: its own, or what caused it.

    A collective fails on one rank because another left it: that one died
    (its death is the error), or it returned early (then the message says so,
    instead of blaming the rank that waited for it). What the others sent
    before this error is read first (``late``, only for an error in a
    collective: ``(rank, its death)``, or ``(rank, None)`` for a result): a
    rank's result or its death precedes the broken connection it causes.
    ``finished`` are the ranks whose result came already.
    """
    if not in_collective(error.remote_traceback):
        return error
    returned = set(finished)
    for other, died in late:
        if died is not None:
            return died
        returned.add(other)
    blamed = sorted(returned - {error.rank})
    if not blamed:  # none returned early: the error itself is the cause
        return error
    return RankError(
        error.rank,
        exc_type=error.exc_type,
        message=LEFT_DURING_COLLECTIVE.format(
            finished=", ".join(map(str, blamed)),
            rank=error.rank,
            exc_type=error.exc_type,
            message=error.message,
        ),
        remote_traceback=error.remote_traceback,
    )


def in_collective(remote_traceback: str) -> bool:
    """Whether a traceback ends inside torch.distributed (a collective or the store failed)."""
    frames = _FRAME.findall(remote_traceback)
    return bool(frames) and re.search(r"torch[/\\]distributed[/\\]", frames[-1]) is not None


def ran(fn: Callable[..., Any], strategy: StrategyLike, ctx: Context, args: Sequence[Any]) -> Any:
    """Return ``fn(strategy, ctx, *args)``; then tell the world this rank has left its function.

    A rank still waiting for this one at a save or a barrier then names it at
    once (`stratagem.arrivals.mark_left`), instead of after the arrival timeout.
    """
    try:
        result = fn(strategy, ctx, *args)
        # A background save still committing ends before the result goes: a launcher that
        # stops ranks some time after their result would otherwise stop the commit.
        pending.settle()
    except BaseException as error:
        mark_left(ctx.arrivals, ctx.rank, f"raised {type(error).__name__} in its function")
        raise
    mark_left(ctx.arrivals, ctx.rank, "returned from its function")
    return result


def torn_down(strategy: StrategyLike, ctx: Context) -> None:
    """Tear down ``ctx``'s world with ``strategy``, the user's objects freed first."""
    # A DDP reducer above all: destroying a gloo group under a live DDP module can deadlock.
    gc.collect()
    strategy.teardown(ctx)


def release_semaphores() -> None:
    """Give back the semaphores this process made (tqdm's lock, a user's own) before ``os._exit``.

    Their finalizers run at a normal exit only; skipped, the resource tracker
    shared with the launcher reports them as leaked once the prompt has returned.
    """
    from multiprocessing import util

    with contextlib.suppress(Exception):  # cleanup on the way out must not replace the result
        util._run_finalizers(0)  # type: ignore[attr-defined]  # noqa: SLF001  # SemLock: priority 0


def rank_main(pipe: Connection, payload: bytes, rank: int, world_size: int, port: int) -> None:
    """Body of a spawned rank: join, run, report, leave, and exit without interpreter teardown."""
    die_with_parent()  # first: nothing slow may come before it
    code = 0
    env = local_env(rank, world_size, port)
    prepare_rank(env)
    try:
        fn, strategy, args = pickle.loads(payload)
        ctx = strategy.setup(env)
        try:
            result = ran(fn, strategy, ctx, args)
            send(pipe, ("ok", result))
            del result
        finally:
            torn_down(strategy, ctx)
    except BaseException as error:  # report everything, KeyboardInterrupt included
        if isinstance(error, Preempted):  # it saved: the parent ends the launch as preempted
            with contextlib.suppress(Exception):  # the parent is gone: nobody to tell
                send(pipe, ("preempted", error.signum))
        else:
            send_error(pipe, error)
        code = 1
    finally:
        pipe.close()
        release_semaphores()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter finalisation: atexit hooks of torch/gloo are where exits hang.
        os._exit(code)
