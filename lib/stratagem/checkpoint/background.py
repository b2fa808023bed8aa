"""Saves that write while training goes on: ``save(..., blocking=False)``.

Before `save` returns, ``dcp.async_save`` has copied this rank's share of the
state to CPU memory, so the loop may step (and change every tensor) at once.
DCP's thread writes the files; a thread of ours then commits them exactly as
a blocking save does (checksums, manifest, rename, pruning, on rank 0), so a
checkpoint is visible only when complete, and one killed mid-write leaves the
previous one loadable.

Those threads' collectives run over a gloo group of their own, made once per
world: on the training loop's group they would interleave with its
all-reduces in an order that differs between ranks. One save is in flight at
a time: the next save, and the world's teardown, wait for it first, and raise
its error if it failed and nobody waited.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist

from stratagem import pending
from stratagem.checkpoint import directory
from stratagem.checkpoint.rank_zero import on_main
from stratagem.env import Context
from stratagem.errors import CheckpointError, UsageError, error_line
from stratagem.validators import is_number, require

__all__ = ["PendingSave", "settle", "start", "unseen_failure"]

# Seconds a wait without a timeout of its own allows: as long as the collectives may take.
DEFAULT_WAIT = 1800.0


@attrs.define(eq=False)
class PendingSave:
    """A save writing in the background, as ``save(..., blocking=False)`` returns it.

    ``wait()`` blocks until the checkpoint is committed at ``path`` (or raises
    why it is not); ``done()`` tells without blocking. Every rank holds one.

    Example:
        >>> import torch, stratagem as sg, tempfile, os
        >>> ctx = sg.single_device("cpu").setup(sg.Env())
        >>> model = torch.nn.Linear(2, 1)
        >>> before = model.weight.detach().clone()
        >>> path = os.path.join(tempfile.mkdtemp(), "step_1")
        >>> handle = sg.checkpoint.save(path, {"model": model}, ctx, blocking=False)
        >>> _ = model.weight.detach().zero_()  # the save already holds its copy
        >>> handle.wait()
        >>> _ = sg.checkpoint.load(path, {"model": model}, ctx)
        >>> torch.equal(model.weight, before)
        True
    """

    path: Path
    _finished: threading.Event = attrs.field(factory=threading.Event, repr=False)
    _error: BaseException | None = attrs.field(default=None, repr=False)
    _reported: bool = attrs.field(default=False, repr=False)

    def done(self) -> bool:
        """Whether the save has ended, committed or failed."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed.

        Args:
            timeout: seconds to wait at most (default: 30 minutes, the
                collectives' own bound).

        Raises:
            CheckpointError: the save failed (the previous checkpoint at
                ``path`` is intact), or it did not end within ``timeout``.
            UsageError: ``timeout`` is not a positive number.
        """
        ok = timeout is None or is_number(timeout, above=0)
        require(ok, "PendingSave.wait: 'timeout'", "None or a positive number of seconds", timeout)
        if timeout is not None and not timeout <= threading.TIMEOUT_MAX:
            raise UsageError(
                f"PendingSave.wait: 'timeout' must be at most {threading.TIMEOUT_MAX:g} s, the "
                f"longest wait threads allow (got {timeout!r}); pass None to wait as long as the "
                "save's collectives may."
            )
        limit = DEFAULT_WAIT if timeout is None else timeout
        if not self._finished.wait(limit):
            raise CheckpointError(
                f"save: the background save to {str(self.path)!r} did not end within {limit:g} s; "
                "a rank may have stopped taking part (see the other ranks' errors)."
            )
        self._reported = True
        if self._error is not None:
            raise self._error

    def _end(self, error: BaseException | None) -> None:
        self._error = error
        self._finished.set()


def retold(error: BaseException, message: str) -> BaseException:
    """Return ``error`` told by ``message``, of its own type where that type takes a message.

    So ``except OSError`` still catches a failed save's disk error, which now
    names the paths involved. Other types become a `CheckpointError`.
    """
    if not isinstance(error, Exception):
        return error  # an interrupt stays one
    told: BaseException
    try:
        told = (
            type(error)(error.errno, message)
            if isinstance(error, OSError) and error.errno is not None
            else type(error)(message)
        )
    except Exception:  # a type whose constructor takes other arguments
        told = CheckpointError(message)
    if message not in str(told):
        told = CheckpointError(message)
    told.__cause__ = error
    return told


def unseen_failure(target: Path) -> None:
    """Wait for the save in flight; if it failed unseen, raise its error naming ``target`` too.

    The save to ``target`` is then not made, and says so: an error that named
    only the earlier path would read as this save's failure, or be lost.

    Raises:
        Exception: the background save in flight failed and nobody waited for
            it: its error, of its type where possible, naming both paths.
    """
    while _in_flight:
        save = _in_flight[0]
        try:
            settle()
        except Exception as error:
            raise retold(
                error,
                f"save: the background save to {str(save.path)!r} failed, and nobody waited "
                f"for it ({error_line(error)}); so this save to "
                f"{str(target)!r} was not made: save again (call wait() on a background "
                "save's handle to see its error where it happens).",
            ) from None


_in_flight: list[PendingSave] = []
_side_groups: dict[Any, Any] = {}  # the world's group -> the gloo group saves write over


def settle() -> None:
    """Wait for the save in flight; raise its error if nobody has seen it yet."""
    while _in_flight:
        save = _in_flight.pop(0)
        if not save._reported:  # noqa: SLF001  # a reported save has ended: wait() saw it
            save.wait()


# A script that ends right after save returns, with no teardown, would stop the writing
# thread mid-save (a daemon): the interpreter's exit waits for the commit instead (a no-op
# with nothing in flight).
atexit.register(settle)


def _leave() -> None:
    try:
        settle()
    finally:
        _side_groups.clear()  # destroyed with the world's groups


def _side_context(ctx: Context) -> Context:
    if ctx.group is None or ctx.world_size == 1:
        return attrs.evolve(ctx, group=None, arrivals=None, cpu_group=None)
    side = _side_groups.get(ctx.group)
    if side is None:
        # Every rank saves at the same point of its program, so every rank makes it here.
        # Its collectives wait as long as the world's do (ddp(timeout=...)), not 30 minutes.
        from stratagem.process_group import collective_timeout

        side = dist.new_group(backend="gloo", timeout=collective_timeout(ctx.group))
        _side_groups[ctx.group] = side
    return attrs.evolve(ctx, group=side, arrivals=None, cpu_group=None)


def start(
    files: dict[str, Any],
    tmp: Path,
    target: Path,
    manifest: dict[str, Any],
    ctx: Context,
    *,
    keep_last: int | None,
    checksums: bool,
) -> PendingSave:
    """Stage ``files`` now and write, then commit, ``tmp`` as ``target`` in the background.

    Raises:
        CheckpointError: the state could not be staged (nothing is left behind).
    """
    from stratagem.checkpoint import dcp_files  # imports DCP (half a second): only when saving

    side = _side_context(ctx)
    handle = PendingSave(target)
    directory.stage_hook("staging")
    try:
        upload = dcp_files.write_async(tmp, files, side)
    except BaseException:
        if ctx.is_main:
            directory.abandon(tmp, target)
        raise

    def finish() -> None:
        error: BaseException | None = None
        try:
            try:
                upload.result()
            except (Exception, concurrent.futures.CancelledError) as caught:
                raise dcp_files.failure_of(caught, tmp) from None
            directory.stage_hook("written")
            if checksums:
                manifest["checksums"] = dcp_files.checksums(tmp, side)
            on_main(side, lambda: directory.commit(tmp, target, manifest, keep_last))
        except BaseException as caught:  # every failure reaches wait(), never the thread's end
            if ctx.is_main:
                directory.abandon(tmp, target)
            error = directory.disk_full(caught, target) or caught
        handle._end(error)  # noqa: SLF001

    directory.stage_hook("writing")
    threading.Thread(target=finish, name="stratagem-save", daemon=True).start()
    _in_flight.append(handle)
    pending.at_teardown(_leave)
    return handle
