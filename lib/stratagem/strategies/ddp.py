"""``ddp()``: DistributedDataParallel on the ranks of a world; ``ddp_spawn()`` = ``spawned(ddp())``.

``ddp()`` is ``single_device()`` with five fields substituted: the process
group's setup and teardown (`stratagem.process_group`), the DDP wrapper and its
``no_sync`` (here), and the shard that gives each rank its part of the data.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any, Unpack

import attrs
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stratagem import training
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.launching import SpawnVariant
from stratagem.process_group import WorldOptions, is_simulated, join_world, leave_process_group
from stratagem.replicas import MB, broadcast_tensors, check_writable
from stratagem.sharding import shard_loader
from stratagem.strategies.single import single_device
from stratagem.strategy import Strategy
from stratagem.validators import a_bool, positive_number

__all__ = ["DDPOptions", "WrapDDP", "ddp", "ddp_no_sync", "ddp_spawn"]

_FLAG = a_bool("ddp({name}=...)")
# DDP turns it into a byte count that its reducer holds in an int64: NaN, infinity and 2**43 MiB
# or more failed there, at wrap, with a raw TypeError on every rank. A cap above the model's
# size makes one bucket, so 1 TiB bounds it with room to spare.
MAX_BUCKET_CAP_MB = 2**20
_BUCKET_CAP = positive_number(
    "ddp({name}=...)",
    unit="MiB, finite",
    at_most=MAX_BUCKET_CAP_MB,
    optional="None",
    hint="; a cap above the model's size already makes one bucket",
)


@attrs.frozen(kw_only=True)
class DDPOptions:
    """Keyword arguments passed to ``DistributedDataParallel``, validated at construction."""

    find_unused_parameters: bool = attrs.field(default=False, validator=_FLAG)
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=_FLAG)
    static_graph: bool = attrs.field(default=False, validator=_FLAG)
    broadcast_buffers: bool = attrs.field(default=True, validator=_FLAG)
    bucket_cap_mb: float | None = attrs.field(default=None, validator=_BUCKET_CAP)


@attrs.frozen
class WrapDDP:
    """Wrap field: move the module to the device and wrap it in ``DistributedDataParallel``."""

    options: DDPOptions = DDPOptions()

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        module = training.to_device(module, ctx)
        if any(p.is_meta for p in module.parameters()):
            raise UsageError(
                f"wrap: {type(module).__name__} has parameters on the meta device, and "
                "DistributedDataParallel hooks the parameters it is given; materialise the "
                "module first (module.to_empty(device=...), then initialise it), then wrap."
            )
        if not any(p.requires_grad for p in module.parameters()):
            raise UsageError(
                f"wrap: {type(module).__name__} has no parameters that require grad, so "
                "DistributedDataParallel has nothing to synchronise; wrap a trainable module."
            )
        if ctx.group is None:
            raise UsageError(
                "wrap: ctx has no process group; pass the Context that ddp().setup returned."
            )
        check_writable(module, "wrap")  # DDP copies rank 0's parameters and buffers into them
        options = attrs.asdict(self.options)
        if not options.pop("broadcast_buffers"):  # the default (True) is not passed at all
            options["broadcast_buffers"] = False
            # DDP then skips buffers at construction too; every rank still starts from rank
            # 0's, as its parameters do (and as fsdp() and allreduce_grads() start).
            broadcast_tensors(list(module.buffers()), ctx, src=0)
        simulated = is_simulated(ctx.group)
        if simulated:
            options.update(_simulated_options(module, options))
        with warnings.catch_warnings():
            # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, which still
            # syncs at init; the old flag keeps its documented meaning on every supported torch.
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
            wrapped = DistributedDataParallel(
                module,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                process_group=ctx.group,
                **options,
            )
        if simulated:
            wrapped.register_comm_hook(ctx.group, _simulated_allreduce)
            wrapped.reducer = _FirstBuckets(wrapped.reducer)  # type: ignore[assignment]
        training.mark_inside_a_wrapper(module)  # step/update on it now would skip the sync
        return wrapped


def _simulated_options(module: torch.nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """DDP's options in a simulated world: no checks at init, its regrouped buckets from the start.

    Fake tensors hold nothing to verify or copy, so ``init_sync`` is off. DDP
    starts with one bucket and regroups after its first step, in the order
    gradients arrived, into buckets of ``bucket_cap_mb`` (the first of 1 MiB
    when the cap is DDP's default); that regrouping cannot run on fake tensors
    (`_FirstBuckets`), so the same buckets, gradients taken to arrive in
    reverse parameter order, are given at construction as per-bucket caps.
    With ``find_unused_parameters`` DDP keeps its first buckets: nothing to give.
    """
    if options["find_unused_parameters"] and not options["static_graph"]:
        return {"init_sync": False}
    cap_mb = options.get("bucket_cap_mb")
    cap = int((25.0 if cap_mb is None else cap_mb) * MB)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else cap  # type: ignore[attr-defined]  # noqa: SLF001  # DDP's own constant
    params: list[torch.Tensor] = []  # in backward's order
    params.extend(p for p in reversed(list(module.parameters())) if p.requires_grad)
    # DDP's own assignment, over the parameters in backward's order:
    arrived, _ = dist._compute_bucket_assignment_by_size(params, [first, cap])  # type: ignore[attr-defined]  # noqa: SLF001  # DDP's own assignment
    sizes = [sum(params[i].numel() * params[i].element_size() for i in b) for b in arrived]
    # Forward order, each cap exactly its bucket's bytes: DDP's assignment closes a bucket there.
    return {"init_sync": False, "bucket_cap_mb_list": [size / MB for size in reversed(sizes)]}


class _FirstBuckets:
    """DDP's reducer in a simulated world, kept on the buckets it starts with.

    After the first step DDP regroups its buckets once, in the order gradients
    arrived, and agrees on it across ranks by writing the order into a tensor,
    which a fake tensor cannot hold. The first buckets (parameters in reverse
    order, as DDP starts) are what a dry run plans; everything else is the
    reducer's own.
    """

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _simulated_allreduce(
    group: dist.ProcessGroup, bucket: Any
) -> torch.futures.Future[torch.Tensor]:
    """DDP's default hook (divide, then all-reduce) with a future that holds the bucket.

    A simulated world's group returns futures without a value, which DDP's
    reducer refuses; the all-reduce still passes torch's dispatcher, as DDP's
    own does, so a dry run counts it.
    """
    buffer = bucket.buffer().div_(group.size())
    dist.all_reduce(buffer, group=group)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


# register_comm_hook compares these with the types themselves; postponed annotations are strings.
_simulated_allreduce.__annotations__.update(
    {
        "group": dist.ProcessGroup,
        "bucket": dist.GradBucket,  # type: ignore[attr-defined]  # exported at run time
        "return": torch.futures.Future[torch.Tensor],
    }
)


def ddp_no_sync(module: torch.nn.Module, ctx: Context) -> AbstractContextManager[Any]:
    """No-sync field: the wrapper's own ``no_sync`` (under ``torch.compile`` too).

    Raises:
        UsageError: ``module`` is not the ``DistributedDataParallel`` that ``wrap`` returned.
    """
    check_context(ctx, "no_sync")
    module = training.original_module(module)  # wrap's result, compiled or not
    if not isinstance(module, DistributedDataParallel):
        raise UsageError(
            f"no_sync: 'module' must be the module wrap returned (a DistributedDataParallel), "
            f"got {type(module).__name__}."
        )
    return module.no_sync()


def ddp(
    *,
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
    broadcast_buffers: bool = True,
    bucket_cap_mb: float | None = None,
    **world: Unpack[WorldOptions],
) -> Strategy:
    """DistributedDataParallel on the ranks that torchrun or SLURM started (it runs in place).

    ``ddp()`` is `single_device` with a world: it joins a process group, wraps
    the module in ``DistributedDataParallel`` (whose ``no_sync`` it uses),
    gives each rank its share of the data, and leaves the group at teardown.
    For ranks started here, use ``spawned(ddp())`` (alias `ddp_spawn`), the
    same record with a launch field that spawns.

    Args:
        find_unused_parameters: passed to ``DistributedDataParallel``.
        gradient_as_bucket_view: passed to ``DistributedDataParallel``.
        static_graph: passed to ``DistributedDataParallel``.
        broadcast_buffers: passed to ``DistributedDataParallel``.
        bucket_cap_mb: passed to ``DistributedDataParallel`` (``None``: its default).
        **world: how the ranks join their world (`WorldOptions`: ``device``,
            ``backend``, ``timeout``, ``arrival_timeout``, ``join_timeout``),
            documented on `JoinProcessGroup`.

    Raises:
        UsageError: an option has the wrong type or value.

    Example:
        >>> import stratagem as sg
        >>> sg.ddp(device="cpu", bucket_cap_mb=8).wrap
        WrapDDP(options=DDPOptions(..., bucket_cap_mb=8))
    """
    options = DDPOptions(
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        broadcast_buffers=broadcast_buffers,
        bucket_cap_mb=bucket_cap_mb,
    )
    return attrs.evolve(
        single_device(),
        name="ddp",
        setup=join_world("ddp", world),
        wrap=WrapDDP(options),
        no_sync=ddp_no_sync,
        shard=shard_loader,
        teardown=leave_process_group,
    )


ddp_spawn = SpawnVariant(ddp)
"""``spawned(ddp(**options), start)``: `ddp` with ranks spawned on this host."""
