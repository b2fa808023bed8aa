"""``checked``: ranks agree on each collective before running it, or all raise.

Before each ``reduce``, ``gather``, ``broadcast`` and ``barrier``, every rank
hashes a `Fingerprint` of its call (field, op, shape, dtype, call site) to a
62-bit integer ``d`` and all-reduces ``[d, -d]`` with MAX: one collective of
two int64 at any world size, after which every rank knows the largest and
the smallest digest, equal exactly when all ranks agree. Ranks that called
different collectives meet in that all-reduce too (it comes first in each of
them), so a mismatch that would hang or return garbage is found instead.
Only then are the full fingerprints exchanged, and every rank raises the
same error.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import attrs
import torch
import torch.distributed as dist

from stratagem.collectives import expect_everyone, gather_objects, is_distributed
from stratagem.combinators._base import check_once, check_strategy
from stratagem.env import Context, check_context, host_group
from stratagem.errors import CollectiveMismatchError
from stratagem.fields import BarrierFn, BroadcastFn, GatherFn, ReduceFn, ReduceOp
from stratagem.strategy import Strategy
from stratagem.validators import require

__all__ = [
    "CheckedBarrier",
    "CheckedBroadcast",
    "CheckedGather",
    "CheckedReduce",
    "CollectiveMismatchError",
    "Fingerprint",
    "checked",
]

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # combinators: not call sites


@attrs.frozen
class Fingerprint:
    """What one rank is about to do: compared across ranks before a collective.

    Attributes:
        field: ``"reduce"``, ``"gather"``, ``"broadcast"`` or ``"barrier"``.
        op: the reduce op, ``"src=N"`` for a broadcast, ``""`` otherwise.
        shape: the tensor's shape (``None`` without one: barrier, broadcast).
        dtype: the tensor's dtype, as a string (``None`` without one).
        site: the caller, ``file.py:line (function)``.
    """

    field: str
    op: str
    shape: tuple[int, ...] | None
    dtype: str | None
    site: str

    def digest(self, *, sites: bool) -> int:
        """Return a stable hash in ``[0, 2**62)``, the same in every process, with the site or not.

        Below 2**62, so that its negation is an int64 too.
        """
        key = (self.field, self.op, self.shape, self.dtype, self.site if sites else None)
        raw = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        return int.from_bytes(raw, "little") >> 2

    def __str__(self) -> str:
        arguments = [f"op={self.op!r}"] if self.op else []
        if self.shape is not None:
            arguments.append(f"shape={self.shape}")
        if self.dtype is not None:
            arguments.append(f"dtype={self.dtype}")
        return f"{self.field}({', '.join(arguments)}) at {self.site}"


def _call_site() -> str:
    frame = sys._getframe(2)  # noqa: SLF001  # the wrapper's caller; cheap, unlike inspect.stack
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back  # called through another combinator (traced): look past it
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})"


def _mismatch(fingerprints: list[Fingerprint]) -> CollectiveMismatchError:
    groups: dict[Fingerprint, list[int]] = {}
    for rank, fingerprint in enumerate(fingerprints):
        groups.setdefault(fingerprint, []).append(rank)
    reference = fingerprints[0]
    differing = [r for r, f in enumerate(fingerprints) if f != reference]
    calls = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {fingerprint}"
        for fingerprint, ranks in groups.items()
    )
    error = CollectiveMismatchError(
        f"checked: rank(s) {differing} disagree with rank 0 on the next collective: {calls}. "
        "Every rank must call the same collectives in the same order, with the same op, "
        "shape and dtype; fix the call that differs (or pass compare_sites=False to "
        "checked if ranks deliberately call from different lines)."
    )
    error.fingerprints = tuple(fingerprints)
    return error


def _agree(fingerprint: Fingerprint, ctx: Context, sites: bool) -> None:
    """Raise `CollectiveMismatchError` on every rank unless all ranks hold equal fingerprints.

    First every rank signs in (one series for all four collectives, so ranks
    calling different ones still meet): a collective called by some ranks only
    raises `CollectiveCallError` within ``ctx.arrivals.timeout`` instead of hanging.
    """
    expect_everyone(ctx, fingerprint.field, series="checked")
    digest = fingerprint.digest(sites=sites)
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)  # on the CPU: a host value
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=host_group(ctx))
    largest, negated_smallest = extremes.tolist()
    if largest == -negated_smallest:
        return
    # Every rank saw the same digests, so every rank takes this path: no one is left waiting.
    raise _mismatch(gather_objects(fingerprint, ctx))


def _described(tensor: object) -> tuple[tuple[int, ...] | None, str | None]:
    if isinstance(tensor, torch.Tensor):
        return tuple(tensor.shape), str(tensor.dtype)
    return None, type(tensor).__name__  # the inner collective reports what is wrong with it


@attrs.frozen
class CheckedReduce:
    """Reduce: agree on (op, shape, dtype, site), then the inner reduce."""

    inner: ReduceFn
    compare_sites: bool = True

    def __call__(self, tensor: torch.Tensor, op: ReduceOp, ctx: Context) -> torch.Tensor:
        if ctx.__class__ is Context and ctx.group is None:  # one rank agrees with itself
            return self.inner(tensor, op, ctx)
        if is_distributed(check_context(ctx, "reduce")):
            fingerprint = Fingerprint("reduce", str(op), *_described(tensor), _call_site())
            _agree(fingerprint, ctx, self.compare_sites)
        return self.inner(tensor, op, ctx)


@attrs.frozen
class CheckedGather:
    """Gather: agree on (shape, dtype, site), then the inner gather."""

    inner: GatherFn
    compare_sites: bool = True

    def __call__(self, tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
        if is_distributed(check_context(ctx, "gather")):
            fingerprint = Fingerprint("gather", "", *_described(tensor), _call_site())
            _agree(fingerprint, ctx, self.compare_sites)
        return self.inner(tensor, ctx)


@attrs.frozen
class CheckedBroadcast:
    """Broadcast: agree on (src, site), then the inner broadcast.

    Only the source's object matters (the others may pass ``None``), so its
    shape and dtype are not compared.
    """

    inner: BroadcastFn
    compare_sites: bool = True

    def __call__(self, obj: Any, ctx: Context, *, src: int = 0) -> Any:
        if is_distributed(check_context(ctx, "broadcast")):
            fingerprint = Fingerprint("broadcast", f"src={src}", None, None, _call_site())
            _agree(fingerprint, ctx, self.compare_sites)
        return self.inner(obj, ctx, src=src)


@attrs.frozen
class CheckedBarrier:
    """Barrier: agree on the site, then the inner barrier."""

    inner: BarrierFn
    compare_sites: bool = True

    def __call__(self, ctx: Context) -> None:
        if is_distributed(check_context(ctx, "barrier")):
            _agree(Fingerprint("barrier", "", None, None, _call_site()), ctx, self.compare_sites)
        self.inner(ctx)


def checked(strategy: Strategy, *, compare_sites: bool = True) -> Strategy:
    """Check before each collective that every rank is calling the same one; raise if not.

    Ranks compare a fingerprint of the call (field, op, shape, dtype, and the
    caller's ``file:line``) as a hash: one extra all-reduce of two int64 per
    collective, nothing on a world of one. When ranks disagree (different
    shapes or ops, a ``barrier`` on one rank and a ``reduce`` on another, calls
    from different lines), every rank raises `CollectiveMismatchError` naming
    the ranks and their fingerprints, instead of hanging or returning garbage.
    Collectives that do not go through these fields (DDP's, FSDP's) are not checked.
    Before the comparison every rank signs in at the world's store, so a
    collective that some ranks never call raises `CollectiveCallError` within
    ``ctx.arrivals.timeout`` seconds, naming them (a few store round trips per
    collective; see `stratagem.arrivals`).

    Fields touched: ``reduce``, ``gather``, ``broadcast``, ``barrier``.

    Args:
        strategy: the strategy whose collectives to check.
        compare_sites: also require the same call site on every rank; turn it
            off for code that calls one collective from different lines on
            different ranks on purpose.

    Returns:
        The strategy with checked collectives.

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, or ``compare_sites`` is not a bool.
        CombinatorError: the strategy is already checked.
    """
    check_strategy(strategy, "checked")
    require(
        isinstance(compare_sites, bool), "checked: 'compare_sites'", "True or False", compare_sites
    )
    check_once(strategy, CheckedReduce, "checked", "is already checked", "apply checked once")
    return attrs.evolve(
        strategy,
        name=f"{strategy.name}+checked",
        reduce=CheckedReduce(strategy.reduce, compare_sites),
        gather=CheckedGather(strategy.gather, compare_sites),
        broadcast=CheckedBroadcast(strategy.broadcast, compare_sites),
        barrier=CheckedBarrier(strategy.barrier, compare_sites),
    )
