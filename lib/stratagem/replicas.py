"""Making ranks replicas of one: copy rank ``src``'s tensors, module or optimizer state to all.

The wrap fields that start every rank from rank 0's weights (``ddp()``'s
buffers, ``allreduce_grads()``, ``fsdp()``) and Horovod's
`broadcast_optimizer_state` share these, beside the collectives they are
built on. Tensors travel in fused buckets, as bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
import torch
import torch.distributed as dist

# What torch._utils._flatten_dense_tensors calls, typed: flattening in C++, no Python call per
# tensor. A bucket of one tensor flattens to a view of it, which is harmless here: every flat
# buffer is written back into its tensors anyway.
from torch._C._nn import flatten_dense_tensors as flatten
from torch._C._nn import unflatten_dense_tensors as unflatten

from stratagem.collectives import broadcast, gather, group_for, is_distributed
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.trees import leaves_in, map_leaves, map_tensors
from stratagem.validators import is_int, require

__all__ = [
    "broadcast_optimizer_state",
    "broadcast_tensors",
    "bucketed",
    "buckets",
    "check_same_layout",
    "check_writable",
    "copy_rank0",
    "flatten",
    "unflatten",
]

MB = 1024 * 1024  # MiB, as DistributedDataParallel's bucket_cap_mb
# Broadcasts happen once (wrap, a load): buckets as large as DDP's for its initial sync.
_BROADCAST_BUCKET_BYTES = 250 * MB


def buckets(
    tensors: Sequence[torch.Tensor],
    cap_bytes: float,
    *,
    order: Iterable[int] | None = None,
    first_bytes: float | None = None,
) -> list[list[int]]:
    """Group indices of ``tensors`` by device and dtype, in ``order``, into runs of ``cap_bytes``.

    The plan depends only on shapes and dtypes, so every rank makes the same
    one. A tensor larger than the cap travels alone. With ``first_bytes``, the
    first bucket of each device and dtype also closes once it holds that much.
    """
    done: list[list[int]] = []
    filling: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[int]]] = {}
    closed: set[tuple[torch.device, torch.dtype]] = set()  # those whose first bucket is done

    def close(key: tuple[torch.device, torch.dtype]) -> None:
        members, filled = filling[key]
        done.append(members.copy())
        members.clear()
        filled[0] = 0
        closed.add(key)

    for index in range(len(tensors)) if order is None else order:
        tensor = tensors[index]
        key = (tensor.device, tensor.dtype)
        members, filled = filling.setdefault(key, ([], [0]))
        if members and filled[0] + tensor.nbytes > cap_bytes:
            close(key)
        members.append(index)
        filled[0] += tensor.nbytes
        if first_bytes is not None and key not in closed and filled[0] >= first_bytes:
            close(key)
    return done + [members for members, _ in filling.values() if members]


def bucketed(
    tensors: Sequence[torch.Tensor], cap_bytes: float, collective: Callable[[torch.Tensor], None]
) -> None:
    """Run ``collective`` in place on each bucket of ``tensors``, flattened; copy it back."""
    with torch.no_grad():
        for bucket in buckets(tensors, cap_bytes):
            members = [tensors[i] for i in bucket]
            flat = flatten(members)
            collective(flat)
            torch._foreach_copy_(members, unflatten(flat, members))


def broadcast_tensors(tensors: Sequence[torch.Tensor], ctx: Context, src: int) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values, one broadcast per bucket."""

    def send(flat: torch.Tensor) -> None:
        # As bytes: a copy needs no arithmetic, and gloo lacks some dtypes (bool, int16).
        dist.broadcast(flat.view(torch.uint8), src=src, group=group_for(flat, ctx))

    # The source copies too (its own values): no branch on the rank, so the same code runs
    # where one process is every rank (torch's LocalTensorMode, the kit's laws).
    bucketed(tensors, _BROADCAST_BUCKET_BYTES, send)


def _layout(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(name, tuple(t.shape), str(t.dtype), t.requires_grad) for name, t in named]


def check_writable(module: torch.nn.Module, where: str) -> None:
    """Refuse a parameter or buffer whose elements share memory (an ``expand``-ed view).

    Copying rank 0's values into such a tensor writes one element many times;
    a collective writing into it (gloo does not check) corrupts the heap.

    Raises:
        UsageError: names the first such tensor and the fix (``.clone()``).
    """
    named = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in named:
        if any(
            step == 0 and size > 1 for step, size in zip(tensor.stride(), tensor.shape, strict=True)
        ):
            raise UsageError(
                f"{where}: {name!r} of shape {tuple(tensor.shape)} is an expanded view (stride "
                f"{tensor.stride()}), whose elements share memory, so rank 0's values cannot be "
                "copied into it; register a copy of it instead (.expand(...).clone())."
            )


def check_same_layout(module: torch.nn.Module, ctx: Context) -> None:
    """Fail on every rank, instead of hanging, if ranks hold differently shaped modules.

    Raises:
        UsageError: some rank's parameters or buffers differ in name, shape,
            dtype or ``requires_grad`` from rank 0's (raised on every rank).
    """
    check_writable(module, "wrap")  # every rank builds the same module, so every rank raises
    mine = _layout(module)
    reference = broadcast(mine, ctx, src=0)
    flag = torch.tensor(int(mine != reference), device=ctx.device)
    differing = [r for r, bad in enumerate(gather(flag, ctx).tolist()) if bad]
    if differing:
        pairs = zip([*mine, None], [*reference, None], strict=False)
        here = next((f"{a} vs rank 0's {b}" for a, b in pairs if a != b), "none")
        raise UsageError(
            f"wrap: rank(s) {differing} hold a module whose parameters and buffers differ from "
            f"rank 0's (first difference on rank {ctx.rank}: {here}, as (name, shape, dtype, "
            "requires_grad)); build the same model on every rank before wrap."
        )


def copy_rank0(module: torch.nn.Module, ctx: Context) -> None:
    """Give every rank rank 0's parameters and buffers, once the ranks' modules match.

    Ranks that built the module from different random seeds leave with
    identical weights; a world of one has nothing to copy.

    Raises:
        UsageError: the ranks' modules differ (`check_same_layout`, on every rank).
    """
    if is_distributed(ctx):
        check_same_layout(module, ctx)
        broadcast_tensors([*module.parameters(), *module.buffers()], ctx, src=0)


@attrs.frozen
class _Hole:
    """Where a tensor of the optimizer state was, in the structure that travels pickled."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, ctx: Context, *, src: int = 0
) -> None:
    """Give every rank rank ``src``'s optimizer state, e.g. after only that rank loaded it.

    Horovod's ``broadcast_optimizer_state``: the structure travels pickled, the
    tensors in bucketed broadcasts through this rank's device. A tensor rank
    ``src`` kept on the CPU (Adam's ``step``) stays on the CPU; the others land
    on this rank's device, and ``load_state_dict`` places them as the
    optimizer wants.

    Args:
        optimizer: the same optimizer class over the same parameters on every rank.
        ctx: the joined world; on a world of one nothing happens.
        src: the rank whose state wins.

    Raises:
        UsageError: ``optimizer`` is not an optimizer, ``ctx`` not a `Context`,
            or ``src`` not a rank of this world.
    """
    function = "broadcast_optimizer_state"
    is_optimizer = isinstance(optimizer, torch.optim.Optimizer)
    require(is_optimizer, f"{function}: 'optimizer'", "a torch.optim.Optimizer", optimizer)
    check_context(ctx, function)
    is_rank = is_int(src, 0) and src < ctx.world_size
    require(is_rank, f"{function}: 'src'", f"a rank in [0, {ctx.world_size})", src)
    if not is_distributed(ctx):
        return
    tensors: list[torch.Tensor] = []

    def hole(tensor: torch.Tensor) -> _Hole:
        tensors.append(tensor.detach().to(ctx.device))
        return _Hole(tuple(tensor.shape), tensor.dtype, tensor.device.type == "cpu")

    # The tensors and their holes are matched by the walk's fixed order, the same on every rank.
    skeleton = map_tensors(hole, optimizer.state_dict()) if ctx.rank == src else None
    skeleton = broadcast(skeleton, ctx, src=src)
    holes = list(leaves_in(skeleton, _Hole))
    if ctx.rank == src:
        broadcast_tensors(tensors, ctx, src)  # sends; its own state is already in place
        return
    tensors = [torch.empty(h.shape, dtype=h.dtype, device=ctx.device) for h in holes]
    broadcast_tensors(tensors, ctx, src)
    arrived = iter(t.cpu() if h.on_cpu else t for t, h in zip(tensors, holes, strict=True))
    optimizer.load_state_dict(map_leaves(lambda _: next(arrived), skeleton, _Hole))
