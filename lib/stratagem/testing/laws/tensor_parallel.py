"""Law ``tensor-parallel``: a split model trains as the whole one does, on meshes no host has.

The law simulates ``size`` ranks in this one process (torch's
``LocalTensorMode`` over a fake world, `simulated_world`): every tensor is one
value per rank, and a collective combines them as the ranks would. Ranks above
0 start from moved weights (as the data-parallel law's ranks do), the
strategy's ``wrap`` splits the module over its ``"tp"`` mesh dimension, and
every rank trains on the whole batch. After the wrap and after each step,
every rank's loss, and each parameter gathered whole, must equal one process
training the unsplit module, within the contract's tolerances.

The kit makes each tensor per rank itself: a tensor the plan does not split
would otherwise be one storage shared by all simulated ranks and updated
``size`` times per step, a factor that looks exactly like a sum taken for a
mean. FSDP2 does not run simulated, so the data-parallel sharding under the
split (the innermost ``wrap``, ``fsdp()``'s) is left out: each data-parallel
replica is then one tensor-parallel group training on the whole batch. The same
run on a real world (``world=``) gives the same values; the kit's suite checks
that on 2 and 4 gloo ranks.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypedDict, Unpack

import attrs
import torch

from stratagem.combinators.tensor_parallel import tensor_parallel
from stratagem.env import Context, Env
from stratagem.errors import UsageError, describe
from stratagem.fields import StrategyLike
from stratagem.layers import peel
from stratagem.planning.simulated_world import simulated_world
from stratagem.strategies.fsdp import fsdp
from stratagem.testing.contract import Contract
from stratagem.testing.laws._core import LawViolation, squares_mean
from stratagem.testing.laws.options import Forward, OptimizerFactory, refuse_unknown, sgd
from stratagem.testing.laws.parallel import perturbed
from stratagem.testing.laws.state import first_difference
from stratagem.testing.tolerances import law_tolerances
from stratagem.testing.world import World
from stratagem.validators import is_int, require

__all__ = ["SplitOptions", "check_tensor_parallel", "tensor_parallel_run"]

LAW = "tensor-parallel"
Trajectory = list[tuple[float, dict[str, torch.Tensor]]]
"""Per rank: after the wrap, then per step, the loss (nan for the wrap) and whole parameters."""


SplitOptions = TypedDict(  # noqa: UP013  # a type for keywords, not a class to derive from
    "SplitOptions",
    {
        "size": int,
        "forward": Forward,
        "optimizer": OptimizerFactory,
        "steps": int,
        "world": World | None,
    },
    total=False,
)
"""How `check_tensor_parallel` and `tensor_parallel_run` train the split, defaults in brackets.

``size`` simulated ranks (8), or a real ``world``'s (None); ``steps`` (3) of
``optimizer`` (`sgd`) on ``forward``'s loss (`squares_mean`).
"""


@attrs.frozen
class _Split:
    """`SplitOptions` with the defaults filled in (checked by `_prepared`)."""

    size: int = 8  # simulated ranks
    forward: Forward = squares_mean
    optimizer: OptimizerFactory = sgd
    steps: int = 3
    world: World | None = None  # a real world instead of simulated ranks

    def args(self, module: torch.nn.Module, batch: Any) -> tuple[Any, ...]:
        """`_train`'s arguments after the strategy and the context."""
        return (module, batch, self.forward, self.optimizer, self.steps)


def _as_is(module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
    """Leave out the data-parallel sharding: FSDP2 does not run on simulated tensors."""
    return module


def _without_sharding(wrap: Any) -> Any:
    """``wrap`` with its innermost layer (the data-parallel sharding) replaced by `_as_is`."""
    inner = getattr(wrap, "inner", None)
    if inner is None or not attrs.has(type(wrap)):
        return _as_is
    return attrs.evolve(wrap, inner=_without_sharding(inner))


def _split_strategy(subject: object, size: int) -> StrategyLike:
    """Return the strategy the law runs: ``subject``, or ``tensor_parallel(fsdp())`` of a plan."""
    if isinstance(subject, StrategyLike):
        strategy = subject
    elif callable(subject) or (isinstance(subject, Mapping) and subject):
        plan: Any = subject
        strategy = tensor_parallel(fsdp(device="cpu"), plan, size=size)
    else:
        raise UsageError(
            f"check_tensor_parallel: 'subject' must be a tensor_parallel(...) strategy or a "
            f"plan (module paths to ParallelStyle objects, or a function (module, tp_mesh) -> "
            f"module), got {describe(subject)}."
        )
    return attrs.evolve(strategy, wrap=_without_sharding(strategy.wrap))  # type: ignore[misc]


def _per_rank(module: torch.nn.Module) -> torch.nn.Module:
    """Give every rank its own copy of each tensor, ranks above 0 moved (`perturbed`).

    torch's ``rank_map`` calls the function for this rank on a real world and
    for every simulated rank under ``LocalTensorMode``: one code path for both.
    """
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode, rank_map

    states: dict[int, dict[str, torch.Tensor]] = {}

    def value_on(key: str, rank: int) -> torch.Tensor:
        if rank not in states:
            states[rank] = perturbed(module, rank).state_dict(keep_vars=True)
        return states[rank][key].detach()

    with maybe_disable_local_tensor_mode():
        owned = perturbed(module, 0)
    for path, holder in owned.named_modules():
        prefix = f"{path}." if path else ""
        for name, parameter in list(holder.named_parameters(recurse=False)):
            per_rank = rank_map(functools.partial(value_on, prefix + name))
            holder.register_parameter(
                name, torch.nn.Parameter(per_rank, requires_grad=parameter.requires_grad)
            )
        for name, _ in list(holder.named_buffers(recurse=False)):
            holder.register_buffer(name, rank_map(functools.partial(value_on, prefix + name)))
    return owned


def _whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter gathered whole (a collective for a split one: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.named_parameters()
    }


def _train(
    strategy: StrategyLike,
    ctx: Context,
    module: torch.nn.Module,
    batch: Any,
    forward: Forward,
    optimizer: OptimizerFactory,
    steps: int,
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Split the module as ``strategy`` does and train it (on real and simulated ranks alike)."""
    return _trained(strategy.wrap(_per_rank(module), ctx), batch, forward, optimizer, steps)


def _trained(
    model: torch.nn.Module, batch: Any, forward: Forward, optimizer: OptimizerFactory, steps: int
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Train ``model``; record the loss (nan before any step) and whole parameters per step."""
    made = optimizer(model.parameters())
    record = [(torch.tensor(math.nan), _whole(model))]
    for _ in range(steps):
        loss = forward(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        made.step()
        made.zero_grad()
        record.append((loss.detach(), _whole(model)))
    return record


def _on_rank(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s value of a simulated tensor (a plain tensor is every rank's)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(tensor, LocalTensor):
        return tensor._local_tensors[rank].clone()  # noqa: SLF001  # torch's only per-rank view
    return tensor.clone()


@contextlib.contextmanager
def _noted(what: str) -> Iterator[None]:
    try:
        yield
    except UsageError:
        raise
    except Exception as error:  # the plan's own failure on split tensors, told where it ran
        error.add_note(f"check_tensor_parallel: raised while {what}")
        raise


def _simulated(strategy: StrategyLike, size: int, args: tuple[Any, ...]) -> list[Trajectory]:
    from torch.distributed._local_tensor import LocalTensorMode

    env = Env(rank=0, world_size=size, local_world_size=size, master_port=29500)
    with simulated_world(size, caller="check_tensor_parallel"):
        ctx = strategy.setup(env)
        if ctx.device.type != "cpu":
            raise UsageError(
                f"check_tensor_parallel: the strategy trains on {ctx.device}, and the law "
                "simulates its ranks on the CPU; give it a CPU strategy (device='cpu')."
            )
        with _noted(f"training on {size} simulated ranks"), LocalTensorMode(size):
            record = _train(strategy, ctx, *args)
    return [
        [
            (float(_on_rank(loss, rank)), {k: _on_rank(v, rank) for k, v in state.items()})
            for loss, state in record
        ]
        for rank in range(size)
    ]


def _real_rank(
    strategy: StrategyLike, ctx: Context, *args: Any
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    return [(float(loss), state) for loss, state in _train(strategy, ctx, *args)]


def _check_divides(size: int, strategy: StrategyLike) -> None:
    split = getattr(peel(strategy.setup)[1], "tensor_parallel", None)  # under any layers
    if isinstance(split, int) and size % split:
        raise UsageError(
            f"check_tensor_parallel: 'size' is {size}, which the strategy's tensor-parallel "
            f"groups of {split} ranks do not divide; pass a multiple of {split}."
        )


def tensor_parallel_run(
    subject: object, *, module: torch.nn.Module, batch: Any, **options: Unpack[SplitOptions]
) -> list[Trajectory]:
    """Train ``module`` split as ``subject`` says; return each rank's losses and whole parameters.

    This is what `check_tensor_parallel` compares with one process: on
    ``size`` simulated ranks, or on ``world``'s real ranks when given (its
    size is then the world's). The arguments are `check_tensor_parallel`'s
    but ``contract``.

    Returns:
        For each rank, for the wrap and then each step: the loss (``nan`` for the
        wrap) and every parameter gathered whole, by name, on the CPU.
    """
    strategy, ranks, split = _prepared("tensor_parallel_run", subject, module, batch, options)
    return _run(strategy, ranks, split, module, batch)


def _prepared(
    law: str,
    subject: object,
    module: torch.nn.Module,
    batch: Any,
    options: SplitOptions,
    own: Sequence[str] = (),
) -> tuple[StrategyLike, int, _Split]:
    """Check the arguments; return the strategy to run, its rank count and the settings."""
    refuse_unknown(law, options, SplitOptions, own=["module", "batch", *own])
    split = attrs.evolve(_Split(), **options)
    world, forward, optimizer, steps = split.world, split.forward, split.optimizer, split.steps
    require(world is None or isinstance(world, World), "check_tensor_parallel: 'world'",
            "a World", world)  # fmt: skip
    ranks = split.size if world is None else world.world_size
    require(is_int(ranks, 2), "check_tensor_parallel: 'size'", "an int of at least 2", ranks)
    strategy = _split_strategy(subject, ranks)
    require(
        isinstance(module, torch.nn.Module) and any(True for _ in module.parameters()),
        "check_tensor_parallel: 'module'",
        "a torch.nn.Module with parameters, whose submodules the plan names",
        module,
    )
    require(callable(forward), "check_tensor_parallel: 'forward'", "a function", forward)
    require(callable(optimizer), "check_tensor_parallel: 'optimizer'", "a function", optimizer)
    require(is_int(steps, 1), "check_tensor_parallel: 'steps'", "a positive int", steps)
    if forward is squares_mean and not isinstance(batch, torch.Tensor):
        raise UsageError(
            f"check_tensor_parallel: the default forward (mean of squared outputs) takes a "
            f"tensor batch, got {describe(batch)}; pass forward=, a module-level function "
            "(module, batch) -> loss."
        )
    _check_divides(ranks, strategy)
    return strategy, ranks, split


def _run(
    strategy: StrategyLike, ranks: int, split: _Split, module: torch.nn.Module, batch: Any
) -> list[Trajectory]:
    if split.world is None:
        return _simulated(strategy, ranks, split.args(module, batch))
    return split.world.run(_real_rank, strategy, *split.args(module, batch))


def _reference(module: torch.nn.Module, batch: Any, split: _Split) -> Trajectory:
    """One process training the whole module, from rank 0's start."""
    record = _trained(perturbed(module, 0), batch, split.forward, split.optimizer, split.steps)
    return [(float(loss), state) for loss, state in record]


def _after(step: int) -> str:
    return "after the wrap" if step == 0 else f"at step {step}"


def _hint(step: int) -> str:
    if step == 0:
        return (
            "the split does not start from rank 0's weights: copy rank 0's module to every "
            "rank before splitting it (tensor_parallel's wrap does), or split with "
            "src_data_rank=0"
        )
    return (
        "a layer's partial sums reduced twice, or a bias added on every rank before the "
        "reduction, scales an output by the tensor-parallel size"
    )


def check_tensor_parallel(
    subject: object,
    *,
    module: torch.nn.Module,
    batch: Any,
    contract: Contract | None = None,
    **options: Unpack[SplitOptions],
) -> None:
    """Check that a tensor-parallel split of ``module`` trains as the whole module does.

    Args:
        subject: a ``tensor_parallel(...)`` strategy (its ``wrap`` runs, the
            data-parallel sharding under it left out), or a plan as
            ``tensor_parallel`` takes it (split over all ``size`` ranks).
        module: the model; the plan names its submodules. Not changed.
        batch: what ``forward`` takes; every rank trains on all of it.
        contract: tolerances (``rtol``, ``atol``); float32's by default.
        **options: `SplitOptions`: ``size=8``, simulated ranks (a multiple of
            the strategy's tensor-parallel size); ``forward=squares_mean``,
            ``(module, batch) -> loss`` (a module-level function to run on
            ``world``); ``optimizer=sgd``, built from the split parameters;
            ``steps=3``, optimizer steps after the wrap; ``world``, a real
            world to run on instead of simulated ranks (None).

    Raises:
        LawViolation: some rank's loss or whole parameter departs from one
            process training the unsplit module.
        UsageError: malformed arguments.
        TypeError: a keyword the law does not take.

    Example:
        >>> import torch
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> from stratagem.testing.laws import check_tensor_parallel
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
        ...                           torch.nn.Linear(32, 8))
        >>> plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        >>> check_tensor_parallel(plan, module=mlp, batch=torch.randn(4, 8), size=16)
    """
    require(
        contract is None or isinstance(contract, Contract),
        "check_tensor_parallel: 'contract'",
        "a Contract",
        contract,
    )
    law = "check_tensor_parallel"
    strategy, ranks, split = _prepared(law, subject, module, batch, options, own=["contract"])
    runs = _run(strategy, ranks, split, module, batch)
    rtol, atol = (contract or Contract()).tolerances(law_tolerances(strategy, "data-parallel-step"))
    expected = _reference(module, batch, split)
    inputs = f"{type(module).__name__} split over {ranks} ranks, {split.steps} step(s)"
    for step, (loss, state) in enumerate(expected):
        for rank, run in enumerate(runs):
            their_loss, theirs = run[step]
            if step and not math.isclose(their_loss, loss, rel_tol=rtol, abs_tol=atol):
                raise LawViolation(
                    LAW, strategy, inputs,
                    f"{_after(step)}, rank {rank}'s loss is {their_loss!r}; one process "
                    f"training the whole module has {loss!r} ({_hint(step)})",
                )  # fmt: skip
            difference = first_difference(theirs, state, rtol=rtol, atol=atol)
            if difference is not None:
                raise LawViolation(
                    LAW, strategy, inputs,
                    f"{_after(step)}, rank {rank}: "
                    f"{difference.describe('one process training the whole module')} "
                    f"({_hint(step)})",
                )  # fmt: skip
