"""Exceptions raised by stratagem.

Every error is a :class:`StratagemError` and also the builtin it resembles, so
``except TypeError`` or ``except ValueError`` in user code keeps working.
`Preempted` is not an error: it ends a run on purpose, as ``SystemExit`` does.
"""

from __future__ import annotations

import functools
import os
import signal
from typing import Any

__all__ = [
    "REQUEUE",
    "CheckpointError",
    "CollectiveCallError",
    "CollectiveMismatchError",
    "CombinatorError",
    "DryRunError",
    "EnvError",
    "LaunchError",
    "Preempted",
    "RankError",
    "StratagemError",
    "StrategyFieldError",
    "UsageError",
]


class StratagemError(Exception):
    """Base class of every error stratagem raises on purpose."""


class StrategyFieldError(StratagemError, TypeError):
    """A `Strategy` field is not a function that accepts its documented arguments."""


class EnvError(StratagemError, ValueError):
    """The environment (torchrun, SLURM, ...) is malformed or contradictory."""


class UsageError(StratagemError, ValueError):
    """An argument has a value the called function cannot work with."""


class CombinatorError(StratagemError, ValueError):
    """A combinator was applied twice, or in an order that cannot work."""


class CheckpointError(StratagemError, ValueError):
    """A checkpoint is incomplete, tampered with, or does not match what is loaded into it."""


class CollectiveCallError(StratagemError, RuntimeError):
    """Some ranks did not call a collective that this rank called (`NOT_CALLED_BY_ALL`)."""


class CollectiveMismatchError(StratagemError, RuntimeError):
    """Ranks called different collectives, or the same one with different arguments.

    Raised on every rank by a `checked` strategy. ``fingerprints`` holds each
    rank's `stratagem.combinators.checked.Fingerprint`, in rank order.
    """

    fingerprints: tuple[Any, ...] = ()


class DryRunError(StratagemError, RuntimeError):
    """A dry run could not simulate a strategy: a field or the model failed on fake tensors."""


class LaunchError(StratagemError, RuntimeError):
    """Processes could not be started, or the world they describe is wrong."""


class RankError(StratagemError, RuntimeError):
    """A rank of a launched world raised or died.

    Attributes:
        rank: the global rank that failed first.
        exc_type: the qualified name of the original exception type, or ``None``
            when the process died without raising (killed, crashed).
        message: the original exception's message, or a description of the exit.
        remote_traceback: the traceback formatted in the failing process.
        exitcode: the process exit code (negative: killed by that signal), when
            the process died without raising.
    """

    def __init__(
        self,
        rank: int,
        *,
        exc_type: str | None,
        message: str,
        remote_traceback: str = "",
        exitcode: int | None = None,
    ) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        what = f"{exc_type}: {message}" if exc_type else message
        text = f"rank {rank} failed: {what}"
        if remote_traceback:
            text += f"\n\nTraceback from rank {rank}:\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields need an explicit recipe to survive pickling.
        fields = ("exc_type", "message", "remote_traceback", "exitcode")
        rebuild = functools.partial(RankError, **{name: getattr(self, name) for name in fields})
        return (rebuild, (self.rank,))


def describe(value: object) -> str:
    """Return ``repr(value)`` with its type, as error messages show a bad value."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return f"{text}, {article} {kind}"


def error_line(error: BaseException) -> str:
    """Return ``error`` in one line, to quote in another message: its type and first line."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}"


def with_submodules(module: Any) -> str:
    """Return ``module``'s type with its first submodule paths, for a message about a bad path."""
    names = [name for name, _ in module.named_modules() if name]
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f"{type(module).__name__} (its submodules: {shown})"


REQUEUE = 75
"""Exit code of a preempted run under SLURM (``EX_TEMPFAIL``: "try again"); the sbatch recipe
in docs/launching.md requeues the job when ``srun`` returns it."""


class Preempted(SystemExit):
    """Ends a run that a scheduler preempted, after its last checkpoint.

    Its exit code is `REQUEUE` (75) where SLURM runs the job (``SLURM_JOB_ID``
    is set), and otherwise ``128 + signal`` (143 for SIGTERM), the code of a
    process the signal ended, which is what other supervisors expect. Uncaught,
    it ends the process with that code and no traceback, as ``SystemExit`` does.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        super().__init__(REQUEUE if "SLURM_JOB_ID" in os.environ else 128 + signum)

    def __str__(self) -> str:
        return f"preempted by {signal.Signals(self.signum).name}; exiting with code {self.code}"
