"""Collectives over a context's process group: reduce, gather, broadcast, barrier.

The same functions serve every built-in: on a world of one (no process group)
they are identities that still validate their input, so a program that is
wrong on N ranks is already wrong on one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from stratagem.arrivals import arrive
from stratagem.env import Context, check_context, host_group
from stratagem.errors import UsageError
from stratagem.fields import REDUCE_OPS, ReduceOp
from stratagem.parts import gather_objects
from stratagem.validators import is_int, refusal, require

__all__ = [
    "STALE_CONTEXT",
    "barrier",
    "broadcast",
    "check_world",
    "expect_everyone",
    "gather",
    "gather_objects",
    "group_for",
    "reduce",
]

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided by the world size afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

# Dtype codes for the metadata exchanged before a gather; index = code.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


# Dtypes some backend cannot carry (gloo has no int16), sent as a wider dtype and cast back.
# Integer arithmetic wraps the same way after the cast back, so results equal a native reduction.
_WIRE_DTYPES = {torch.int16: torch.int32}


STALE_CONTEXT = (
    "{function}: 'ctx' belongs to a world that has been torn down (its process group was "
    "destroyed, by teardown or by a later setup); pass the Context that this world's setup "
    "returned, the one launch gives your function."
)


def check_world(ctx: Context, function: str) -> Context:
    """Return ``ctx`` if its process group is one of this process's live groups.

    A Context kept from an earlier world (set up, torn down, set up again) still
    holds its old group, which can no longer reach the other ranks' current
    one. The usual case costs one identity test against the default group.

    Raises:
        UsageError: the group has been destroyed (`STALE_CONTEXT`).
    """
    group = ctx.group
    if group is None or group is dist.group.WORLD:
        return ctx
    try:
        dist.get_process_group_ranks(group)  # a group torch no longer knows: KeyError
    except (KeyError, ValueError, RuntimeError):
        raise UsageError(STALE_CONTEXT.format(function=function)) from None
    return ctx


def _to_wire(tensor: torch.Tensor) -> torch.Tensor:
    wire = _WIRE_DTYPES.get(tensor.dtype)
    return tensor.clone() if wire is None else tensor.to(wire)


def _check_tensor(tensor: object, function: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        hint = "; wrap a number with torch.tensor(value)"
        raise refusal(f"{function}: 'tensor'", "a torch.Tensor", tensor, hint=hint)
    return tensor


def _check_op(op: object) -> ReduceOp:
    if not isinstance(op, str) or op not in REDUCE_OPS:
        raise refusal("reduce: 'op'", f"one of {', '.join(map(repr, REDUCE_OPS))}", op)
    return op


def group_for(tensor: torch.Tensor, ctx: Context) -> dist.ProcessGroup | None:
    """Return the group that can carry ``tensor``: a CPU tensor goes over `host_group`.

    Under NCCL a CPU tensor cannot travel over the world's group; it takes
    the gloo group beside it, so a loss moved to the CPU can still be reduced.
    """
    return host_group(ctx) if tensor.device.type == "cpu" else ctx.group


def reduced_values(reduced: torch.Tensor, mine: Callable[[], list[Any]]) -> list[Any]:
    """Read a small all-reduced tensor as a list; ``mine()`` gives what this rank put in.

    In a simulated world (`stratagem.dry_run`: torch's fake tensors and fake
    group) a tensor holds no values to read, and a reduction leaves each rank's
    own: those are ``mine()``, asked for only then (a real step never builds them).
    """
    if type(reduced) is torch.Tensor:  # every real run: no fake-tensor module to import
        return reduced.tolist()
    from torch._subclasses.fake_tensor import is_fake

    return mine() if is_fake(reduced) else reduced.tolist()


def is_distributed(ctx: Context) -> bool:
    """Whether ``ctx`` is a world of several ranks with a process group."""
    return ctx.group is not None and ctx.world_size > 1


def reduce(tensor: torch.Tensor, op: ReduceOp, ctx: Context) -> torch.Tensor:
    """Return the reduction of ``tensor`` over all ranks as a new tensor.

    Args:
        tensor: a floating or integer tensor, the same shape on every rank.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        ctx: the joined world.

    Returns:
        A new tensor; ``tensor`` itself is never modified.

    Raises:
        UsageError: ``op`` is unknown, ``tensor`` is not a tensor, ``ctx`` is not
            a `Context`, or ``op`` is ``"mean"`` on an integer or boolean tensor
            (cast it to a floating dtype first, or reduce with ``"sum"`` and
            divide yourself), or the dtype is complex or boolean (not supported
            by every backend).

    Example:
        >>> import torch, stratagem as sg
        >>> ctx = sg.single_device("cpu").setup(sg.Env())
        >>> reduce(torch.tensor([1.0, 3.0]), "mean", ctx)
        tensor([1., 3.])
    """
    # A world of one, a floating tensor, a known op (a loss reduced for logging, every step):
    # the copy after one test; the checks and their messages otherwise.
    if (
        ctx.__class__ is Context
        and ctx.group is None
        and tensor.__class__ is torch.Tensor
        and isinstance(op, str)
        and op in _TORCH_OPS
        and tensor.is_floating_point()
    ):
        return tensor.clone()
    tensor = _check_tensor(tensor, "reduce")
    op = _check_op(op)
    check_world(check_context(ctx, "reduce"), "reduce")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise UsageError(
            f"reduce: dtype {tensor.dtype} is not supported; convert to an integer or "
            "floating dtype first (e.g. tensor.long())."
        )
    if op == "mean" and not tensor.is_floating_point():
        raise UsageError(
            f"reduce: 'mean' of a {tensor.dtype} tensor has no exact {tensor.dtype} result; "
            "cast to a floating dtype first (tensor.float()), or use 'sum' and divide."
        )
    if not is_distributed(ctx):
        return tensor.clone()
    result = _to_wire(tensor)
    dist.all_reduce(result, op=_TORCH_OPS[op], group=group_for(result, ctx))
    if op == "mean":
        result /= ctx.world_size
    return result.to(tensor.dtype)


def _all_gather(
    tensor: torch.Tensor, ctx: Context, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Return every rank's ``tensor`` (each of this one's shape and dtype), in rank order."""
    everyone = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, tensor, group=group)
    return everyone


def gather(tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Return every rank's ``tensor`` stacked along a new first dimension.

    Every rank receives the whole result (an all-gather). Shapes and dtypes are
    compared first, so a mismatch is an error on every rank instead of a hang.

    Args:
        tensor: this rank's contribution.
        ctx: the joined world.

    Returns:
        A tensor of shape ``(world_size, *tensor.shape)``; row ``r`` is rank ``r``'s.

    Raises:
        UsageError: ``tensor`` is not a tensor, ``ctx`` is not a `Context`, or
            ranks disagree on shape or dtype (the message lists each rank's
            shape and dtype).
    """
    tensor = _check_tensor(tensor, "gather")
    check_context(ctx, "gather")
    if not is_distributed(ctx):
        return tensor.unsqueeze(0).clone()
    if tensor.dtype not in _DTYPES:
        raise UsageError(f"gather: dtype {tensor.dtype} is not supported by gather.")
    # Exchange (ndim, dtype) first, then the shapes, so mismatches are caught before data moves.
    group = group_for(tensor, ctx)
    meta = torch.tensor([tensor.dim(), _DTYPES.index(tensor.dtype)], device=tensor.device)
    metas = _all_gather(meta, ctx, group)
    dims = [int(m[0]) for m in metas]
    dtypes = [_DTYPES[int(m[1])] for m in metas]
    if len(set(dims)) == 1 and tensor.dim() > 0:
        shape = torch.tensor(tensor.shape, device=tensor.device)
        shapes = [tuple(int(d) for d in s) for s in _all_gather(shape, ctx, group)]
    else:
        shapes = [tuple(tensor.shape) if d == tensor.dim() else (-1,) * d for d in dims]
    if len(set(shapes)) != 1 or len(set(dtypes)) != 1:
        ranks = enumerate(zip(shapes, dtypes, strict=True))
        shown = "; ".join(f"rank {r}: {s} {d}" for r, (s, d) in ranks)
        raise UsageError(
            "gather: every rank must pass a tensor of the same shape and dtype, but got "
            f"{shown}. Pad to a common shape first."
        )
    wire = _to_wire(tensor).contiguous()
    return torch.stack(_all_gather(wire, ctx, group)).to(tensor.dtype)


def broadcast(obj: Any, ctx: Context, *, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every rank.

    Tensors travel as tensors (placed on this rank's device); any other
    object must be picklable and travels pickled. On ``src`` a tensor is
    returned as a copy, so the result never aliases the input.

    Raises:
        UsageError: ``src`` is not a rank of this world, or ``ctx`` not a `Context`.
    """
    check_context(ctx, "broadcast")
    ok = is_int(src, 0) and src < ctx.world_size
    require(ok, "broadcast: 'src'", f"a rank in [0, {ctx.world_size})", src)
    if not is_distributed(ctx):
        return obj.clone() if isinstance(obj, torch.Tensor) else obj
    # One pickled message says what is coming: the object itself, or a tensor's shape and dtype.
    header: list[Any] = [None]
    if ctx.rank == src:
        is_tensor = isinstance(obj, torch.Tensor)
        header[0] = ("tensor", obj.shape, obj.dtype) if is_tensor else ("object", obj)
    dist.broadcast_object_list(header, src=src, group=host_group(ctx))
    if header[0][0] == "object":
        return header[0][1]
    _, shape, dtype = header[0]
    if ctx.rank == src:
        data = _to_wire(obj.detach()).to(ctx.device)
    else:
        data = torch.empty(shape, dtype=_WIRE_DTYPES.get(dtype, dtype), device=ctx.device)
    dist.broadcast(data, src=src, group=group_for(data, ctx))
    return data.to(dtype)


def expect_everyone(ctx: Context, what: str, *, series: str = "") -> None:
    """Wait until every rank has reached ``what``, or raise naming those that did not.

    The first step of every collective that users call from their own code
    (`save`, `load`, `barrier`): a call made on some ranks only fails within
    ``ctx.arrivals.timeout`` seconds instead of hanging (`stratagem.arrivals`).

    Raises:
        CollectiveCallError: some ranks did not arrive in time (`NOT_CALLED_BY_ALL`).
    """
    if ctx.arrivals is not None and is_distributed(ctx):
        arrive(ctx.arrivals, what, ctx.rank, ctx.world_size, series=series)


def barrier(ctx: Context) -> None:
    """Return once every rank has called it (immediately on a world of one).

    Raises:
        UsageError: ``ctx`` is not a `Context`.
        CollectiveCallError: some ranks did not call it within ``ctx.arrivals.timeout``.
    """
    if is_distributed(check_context(ctx, "barrier")):
        expect_everyone(ctx, "barrier")
        dist.barrier(group=host_group(ctx))
