"""Preemption: stop at a scheduler's signal, with a last checkpoint, and ask to be requeued.

A scheduler that takes the machines back first sends a signal: SIGTERM
(Kubernetes, torchrun passing on its own, `Spawn` passing on the
launcher's), or the one SLURM's ``--signal=USR1@SECONDS`` names. Inside
``with sg.on_preemption() as preemption:`` that signal only sets a flag: the
step in progress finishes, ``preemption.requested(ctx)`` tells every rank at
the same step (one small all-reduce, since the signal reaches ranks at
different moments), the loop saves, and ``preemption.exit()`` ends the
process with the code the scheduler reads as "requeue" (see `Preempted`).
See docs/launching.md ("Preemption").
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

import attrs
import torch

from stratagem import collectives
from stratagem._processes import handling
from stratagem.env import Context, check_context
from stratagem.errors import REQUEUE, Preempted, UsageError
from stratagem.validators import refusal

__all__ = ["REQUEUE", "Preempted", "Preemption", "on_preemption"]

_DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


@attrs.define(eq=False)
class Preemption:
    """What `on_preemption` hands the loop: whether a stop signal came, agreed by every rank."""

    signals: tuple[int, ...]
    received: int | None = None

    def requested(self, ctx: Context) -> bool:
        """Whether any rank received a stop signal; the same answer on every rank.

        Every rank must call it at the same step (it all-reduces one flag).

        Raises:
            UsageError: ``ctx`` is not a `Context`.
        """
        check_context(ctx, "Preemption.requested")
        if not collectives.is_distributed(ctx):
            return self.received is not None
        flag = torch.tensor([0 if self.received is None else self.received], device=ctx.device)
        signum = int(collectives.reduce(flag, "max", ctx))
        if signum and self.received is None:
            self.received = signum  # another rank's signal: exit as it would
        return signum > 0

    def exit(self) -> NoReturn:
        """End the run: raise `Preempted` for the signal received (SIGTERM if none yet)."""
        raise Preempted(self.received or signal.SIGTERM)


def _signal_numbers(signals: object) -> tuple[int, ...]:
    if isinstance(signals, (str, bytes)) or not isinstance(signals, Sequence) or not signals:
        what = "a non-empty sequence of signal names or numbers"
        hint = ", e.g. ('SIGTERM', 'SIGUSR1')"
        raise refusal("on_preemption: 'signals'", what, signals, hint=hint)
    numbers = []
    for item in signals:
        # signal.Signals(True) is SIGHUP: a bool (or a float, None) is a mistake, not a number.
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            hint = "; name one such as 'SIGTERM' or 'SIGUSR1'"
            raise refusal(
                "on_preemption: each of 'signals'", "a signal name or number", item, hint=hint
            )
        try:
            number = signal.Signals[item] if isinstance(item, str) else signal.Signals(item)
        except (KeyError, ValueError):
            raise UsageError(
                f"on_preemption: {item!r} in 'signals' is not a signal of this system; name one "
                "such as 'SIGTERM' or 'SIGUSR1'."
            ) from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise UsageError(f"on_preemption: {number.name} cannot be caught; it ends the process.")
        numbers.append(int(number))
    return tuple(numbers)


@contextmanager
def on_preemption(signals: Sequence[str | int] = _DEFAULT_SIGNALS) -> Iterator[Preemption]:
    """Inside, the ``signals`` set a flag instead of ending the process; outside, as before.

    Args:
        signals: the stop signals, by name or number (default SIGTERM and
            SIGUSR1, SLURM's usual ``--signal``).

    Yields:
        The `Preemption` whose ``requested(ctx)`` the loop asks after each step.

    Raises:
        UsageError: ``signals`` is malformed, or this is not the main thread
            (Python runs signal handlers there only).

    Example:
        >>> import os, signal, stratagem as sg
        >>> ctx = sg.single_device("cpu").setup(sg.Env())
        >>> with sg.on_preemption() as preemption:
        ...     os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends
        ...     preemption.requested(ctx)
        True
    """
    numbers = _signal_numbers(signals)
    if threading.current_thread() is not threading.main_thread():
        raise UsageError(
            "on_preemption: call it in the main thread; Python delivers signals there only."
        )
    preemption = Preemption(numbers)

    def handler(signum: int, frame: object) -> None:
        preemption.received = preemption.received or signum

    with handling(numbers, handler):
        yield preemption
