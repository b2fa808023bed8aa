"""``expert_parallel``: split a mixture of experts over an ``"ep"`` mesh dimension.

``expert_parallel(fsdp(), experts=every_module_of(Experts), size=2)`` splits
each shard group of the mesh into ``("shard", n / size)`` and ``("ep",
size)``. The ranks of an ``"ep"`` group are data-parallel ranks (they take
different batches, as torchtitan borrows them from ``dp_shard``); what they
split is the experts. Each module the policy picks keeps ``1 / size`` of its
experts: every parameter of it has the experts along dimension 0 and becomes
a DTensor sharded there over ``"ep"`` (rank ``r`` of the group holds experts
``r * E / size`` to ``(r + 1) * E / size - 1``). Around its forward, tokens
travel by all-to-all to the rank holding their expert and back.

The module's contract, torchtitan's grouped experts':
``forward(tokens, counts)`` with ``tokens`` of shape ``(N, ...)`` sorted by
expert and ``counts[i]`` the number of them routed to expert ``i`` (an
integer tensor of the experts' count), returning one row per token in the
same order. Under expert parallelism it receives the tokens of its own
experts only (from every rank of the group) and ``counts`` for those, and
its parameters are DTensors: read them with ``.to_local()``.

Gradients: a rank's experts see the tokens of every rank of its group, so
their gradients sum over ``"ep"``. The backward divides the gradient of the
experts' output by the group's size (and multiplies the tokens' gradient back),
and FSDP averages the experts over ``"shard"``: together, the average over the
whole data-parallel world, which the other parameters get from FSDP over
``shard`` and ``ep`` together (`Context.data_mesh`). (FSDP's own gradient
divide factor would do it with ``PREMUL_SUM``, which gloo does not have.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from stratagem.combinators._base import (
    CombinatorError,
    check_strategy,
    mesh_under,
    outermost_picks,
    waited,
    with_mesh,
)
from stratagem.env import Context
from stratagem.errors import UsageError, describe
from stratagem.fields import WrapFn
from stratagem.meshes import mesh_with
from stratagem.precisions import precision_of
from stratagem.replicas import copy_rank0
from stratagem.strategy import Strategy
from stratagem.validators import is_int, require

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertParallelWrap", "expert_parallel", "expert_slice"]

NOT_ON_A_MESH = (
    "expert_parallel: {name!r} does not build a device mesh (its setup is {setup}); expert "
    "parallelism splits the shard dimension of fsdp()'s mesh (JoinMesh): "
    "expert_parallel(sg.fsdp(), experts=sg.every_module_of(Experts), size=2)."
)


def expert_slice(experts: int, rank: int, size: int) -> tuple[int, int]:
    """Return ``(start, stop)``: the experts rank ``rank`` of an ``"ep"`` group of ``size`` holds.

    Example:
        >>> expert_slice(8, 1, 4)
        (2, 4)
    """
    share = experts // size
    return rank * share, (rank + 1) * share


@attrs.define
class _Route:
    """How one forward's tokens travelled: what ``combine`` needs to send them back."""

    order: torch.Tensor  # received rows (by source, then expert) in expert order
    sent: list[int]  # rows sent to each rank of the group
    received: list[int]  # rows received from each


@attrs.define
class _Dispatch:
    """Forward hooks of one experts module: tokens out to their experts' ranks, and back."""

    group: Any
    size: int
    experts: int
    routes: list[_Route] = attrs.field(factory=list)  # a stack: recomputation nests forwards

    def before(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        from torch.distributed import _functional_collectives as funcol

        tokens, counts = self._checked(module, args)
        local = self.experts // self.size
        counts = counts.to(torch.int64)
        splits = [local] * self.size
        # Every rank learns how many of each source's tokens go to each of its experts.
        incoming = waited(funcol.all_to_all_single(counts, splits, splits, self.group))
        by_source = incoming.view(self.size, local).cpu()
        sent = counts.view(self.size, local).sum(1).tolist()
        received = by_source.sum(1).tolist()
        arrived = waited(
            funcol.all_to_all_single_autograd(tokens.contiguous(), received, sent, self.group)
        )
        order = _expert_major(by_source).to(arrived.device)
        self.routes.append(_Route(order, sent, received))
        given = arrived.index_select(0, order)
        if given.requires_grad:  # undo, for the tokens, the division `after` adds for the experts
            given.register_hook(lambda grad: grad * self.size)  # type: ignore[no-untyped-call]
        return (given, by_source.sum(0).to(counts.device))

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        from torch.distributed import _functional_collectives as funcol

        route = self.routes.pop()
        if not isinstance(output, torch.Tensor) or output.size(0) != route.order.numel():
            raise UsageError(
                f"step: the experts module {type(module).__name__} must return one row per "
                f"token it was given ({route.order.numel()}), in their order; it returned "
                f"{describe(output)}."
            )
        if output.requires_grad:
            # The experts' gradients sum over the tokens of every rank of the group: divided by
            # the group's size here, FSDP's average over "shard" makes them the whole data world's
            # average (FSDP's own divide factor needs PREMUL_SUM, which gloo lacks).
            output.register_hook(lambda grad: grad / self.size)  # type: ignore[no-untyped-call]
        by_source = torch.empty_like(output).index_copy(0, route.order, output)
        back = funcol.all_to_all_single_autograd(
            by_source.contiguous(), route.sent, route.received, self.group
        )
        return waited(back)

    def _checked(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, Any]:
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else describe(a) for a in args]
        fits = len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args)
        if fits:
            tokens, counts = args
            fits = counts.dim() == 1 and not counts.is_floating_point() and tokens.dim() >= 1
        if not fits or counts.numel() != self.experts:
            raise UsageError(
                f"step: expert_parallel calls the experts module {type(module).__name__} as "
                f"forward(tokens, counts), tokens sorted by expert and counts an integer "
                f"tensor of its {self.experts} experts' token counts; it was called with "
                f"{shapes}. Route the tokens in the enclosing module and pass them positionally."
            )
        if int(counts.sum()) != tokens.size(0):
            raise UsageError(
                f"step: the experts module {type(module).__name__} got {tokens.size(0)} tokens "
                f"but counts summing to {int(counts.sum())}; counts[i] must be the number of "
                "tokens routed to expert i."
            )
        return tokens, counts


def _expert_major(by_source: torch.Tensor) -> torch.Tensor:
    """Return the indices that put rows received by (source, expert) in (expert, source) order."""
    sources, local = by_source.shape
    expert_of_row = torch.arange(local).repeat(sources).repeat_interleave(by_source.flatten())
    return torch.argsort(expert_of_row, stable=True)


def _split_experts(module: torch.nn.Module, ep: DeviceMesh) -> int:
    """Replace each parameter of ``module`` with this rank's experts, a DTensor on ``"ep"``."""
    from torch.distributed.tensor import DTensor, Shard

    params = list(module.named_parameters(recurse=False))
    counts = {p.size(0) if p.dim() else None for _, p in params}
    if not params or len(counts) != 1 or None in counts:
        shapes = {name: tuple(p.shape) for name, p in params}
        raise UsageError(
            f"wrap: expert_parallel splits the parameters of {type(module).__name__} along "
            f"dimension 0, its experts, which needs parameters of its own all with one "
            f"leading size (got {shapes}); stack the experts' weights (E, ...) in the module "
            "the experts policy picks."
        )
    experts, size = counts.pop(), ep.size()
    assert experts is not None
    if experts % size:
        raise UsageError(
            f"wrap: expert_parallel(size={size}) cannot split the {experts} experts of "
            f"{type(module).__name__} evenly; use a size that divides {experts}."
        )
    start, stop = expert_slice(experts, ep.get_local_rank(), size)
    for name, param in params:
        mine = param.detach()[start:stop].clone()
        sharded = DTensor.from_local(
            mine, ep, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
        )
        setattr(module, name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
    return experts


@attrs.frozen
class ExpertParallelWrap:
    """Wrap field: copy rank 0's module, split the picked experts over ``"ep"``, then ``inner``.

    Each picked module gets the all-to-all hooks, and is sharded by FSDP over
    ``"shard"`` (its experts' own group, with the run's precision policy),
    before ``inner`` shards the rest over ``shard`` and ``ep`` together.
    """

    inner: WrapFn
    experts: Callable[[torch.nn.Module], bool]  # fsdp()'s shard_when policies serve
    in_reference: ClassVar[bool] = False  # it distributes: the reference runs every expert

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        require(isinstance(module, torch.nn.Module), "wrap: 'module'", "a torch.nn.Module", module)
        mesh, names = mesh_with(ctx, "ep", "wrap", "expert_parallel")
        picked = outermost_picks(module, self.experts, "expert_parallel's experts policy")
        if not picked:
            raise UsageError(
                f"wrap: expert_parallel's experts policy {self.experts!r} picks no submodule of "
                f"{type(module).__name__}; pick the module that holds the stacked experts."
            )
        copy_rank0(module, ctx)  # every group splits the same experts
        ep = mesh[names.ep]
        state = precision_of(ctx)
        # The run's precision's policy; without one, fully_shard's own default.
        policy = (None if state is None else state.fsdp_policy()) or MixedPrecisionPolicy()
        for experts_module in picked:
            count = _split_experts(experts_module, ep)
            fully_shard(experts_module, mesh=mesh[names.shard], mp_policy=policy)
            # After FSDP's hooks: FSDP sees the experts' own output, not the tokens sent back.
            dispatch = _Dispatch(ep.get_group(), ep.size(), count)
            experts_module.register_forward_pre_hook(dispatch.before)
            experts_module.register_forward_hook(dispatch.after)
        return self.inner(module, ctx)


def expert_parallel(
    strategy: Strategy, *, experts: Callable[[torch.nn.Module], bool], size: int = 2
) -> Strategy:
    """Split the experts of the modules ``experts`` picks over ``size`` data-parallel ranks.

    Fields touched: ``setup`` (the shard dimension of the mesh splits into
    ``"shard"`` and ``"ep"``; `Context.data_mesh` flattens them again) and
    ``wrap`` (`ExpertParallelWrap`). Composes with the other combinators in
    any order; not yet with ``hsdp()`` or `context_parallel`.

    Args:
        strategy: an ``fsdp()`` strategy, its ``wrap`` possibly substituted.
        experts: which modules hold the stacked experts (``module -> bool``,
            e.g. ``sg.every_module_of(Experts)``); see the module docstring for
            their contract.
        size: ranks per expert-parallel group; must divide the shard group and
            each picked module's number of experts.

    Raises:
        UsageError: an argument is malformed.
        CombinatorError: ``strategy``'s setup (under the layers of other
            combinators) builds no mesh, is hybrid or context parallel, or it
            is already expert parallel.
    """
    check_strategy(strategy, "expert_parallel")
    require(callable(experts), "expert_parallel: 'experts'", "a function module -> bool", experts)
    require(is_int(size, 2), "expert_parallel: 'size'", "an int of at least 2", size)
    under = mesh_under(strategy, "expert_parallel", ExpertParallelWrap, NOT_ON_A_MESH)
    joins = under[1]
    hybrid = joins.replicate is not None or joins.shard_size != "world"
    if hybrid or joins.context_parallel > 1:
        beside = "hybrid sharding (hsdp)" if hybrid else "context_parallel"
        raise CombinatorError(
            f"expert_parallel: {strategy.name!r} uses {beside}; experts are not split yet "
            f"beside {beside}: use expert_parallel(sg.fsdp(), experts=...), with other "
            "combinators in any order."
        )
    wrap = ExpertParallelWrap(strategy.wrap, experts)
    return with_mesh(strategy, under, f"ep{size}", {"expert_parallel": size}, wrap=wrap)
