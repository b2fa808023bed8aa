"""Laws ``data-parallel-step`` and ``accumulation``: N ranks train as the derived reference does.

Each rank starts from its own module (rank 0's is the given one; the others
are perturbed, unless the contract says the caller synchronises
initialisation), takes its contiguous share of every batch, and runs the
user's loop for several steps: ``step``, ``backward`` and ``update`` per
micro-batch (as many as ``accumulate`` asks for). The reference is the same
stack without its distribution (`stratagem.testing.reference.undistributed`,
or the caller's ``reference=``) in this process, fed the whole batch; its
forward runs each rank's share separately, so batch statistics are per
share, as on the ranks, and each share has its own copy of the buffers,
broadcast from the first share before each forward that follows a
synchronising one (as DistributedDataParallel does) or kept apart, as the
strategy does (`Contract.buffers`). After wrap and after every step the whole
state of every rank (parameters, buffers, optimizer state, by key) must equal
the reference's within the contract's tolerances.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import attrs
import torch

from stratagem.checkpoint import unwrap
from stratagem.combinators.accumulation import AccumulationState
from stratagem.env import Env
from stratagem.errors import UsageError, describe
from stratagem.fields import BackwardInStep
from stratagem.layers import peel
from stratagem.optimizer_hooks import OptimizerHook
from stratagem.strategy import StrategyLike
from stratagem.testing.contract import Contract
from stratagem.testing.laws._core import (
    LawViolation,
    holds_part,
    own_share,
    run_on,
    share,
    squares_mean,
    summarize,
)
from stratagem.testing.laws.options import (
    Forward,
    LawSettings,
    OptimizerFactory,
    ReferenceOptions,
    adamw,
    settings,
    sgd,
    sgd_momentum,
)
from stratagem.testing.laws.state import first_difference, hint, snapshot
from stratagem.testing.reference import buffers_rule, undistributed
from stratagem.testing.tolerances import law_outliers, law_tolerances
from stratagem.trees import map_tensors, tensors_in
from stratagem.validators import is_int, require

__all__ = [
    "adamw",
    "check_accumulation",
    "check_data_parallel_step",
    "sgd",
    "sgd_momentum",
]

Snapshots = list[dict[str, torch.Tensor]]


# --- batches -------------------------------------------------------------------------------


def _length(batch: Any) -> int:
    lengths = {t.shape[0] if t.dim() else -1 for t in tensors_in(batch)}
    if len(lengths) != 1 or -1 in lengths:
        raise UsageError(
            f"laws: 'batch' must hold tensors that share their first dimension, the samples "
            f"(got {summarize(batch) if isinstance(batch, torch.Tensor) else describe(batch)}); "
            "pass a tensor, an (inputs, targets) tuple or a dict of tensors."
        )
    return lengths.pop()


def _joined(pieces: Sequence[Any]) -> Any:
    """Concatenate batches of one structure along the first dimension, tensor by tensor."""
    leaves = [list(tensors_in(piece)) for piece in pieces]
    joined = iter([torch.cat(column) for column in zip(*leaves, strict=True)])
    return map_tensors(lambda _: next(joined), pieces[0])


def _check_inputs(module: object, batch: Any, world_size: int, forward: Forward) -> None:
    if not isinstance(module, torch.nn.Module) or not any(
        p.requires_grad for p in module.parameters()
    ):
        raise UsageError(
            f"laws: 'module' must be a torch.nn.Module with trainable parameters (got "
            f"{describe(module)}); the training laws compare what training changes."
        )
    if forward is squares_mean and not isinstance(batch, torch.Tensor):
        raise UsageError(
            f"laws: the default forward (mean of squared outputs) takes a tensor batch, got "
            f"{describe(batch)}; pass forward=, a module-level function (module, batch) -> loss "
            "that returns a mean over samples."
        )
    length = _length(batch)
    if length % world_size:
        raise UsageError(
            f"laws: the batch has {length} samples, which {world_size} ranks cannot share "
            f"equally; give a batch whose length is a multiple of {world_size}."
        )


# --- the ranks -----------------------------------------------------------------------------


def perturbed(module: torch.nn.Module, rank: int) -> torch.nn.Module:
    """Return a copy of ``module``; for ``rank > 0`` every float tensor of its state is moved.

    Rank 0 keeps the given weights: a wrap that broadcasts rank 0's gives every
    rank the reference's start, one that does not leaves the others elsewhere.
    """
    copied = copy.deepcopy(module)
    if rank > 0:
        generator = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for parameter in copied.parameters():
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.add_(0.1 * noise.to(parameter.dtype))
            for buffer in copied.buffers():
                if buffer.is_floating_point():
                    buffer.add_(0.25 * rank)  # keeps a variance positive
    return copied


@attrs.frozen
class _Plan:
    steps: int
    micro: int | None  # None: as many as accumulate asks for (1 without it)
    manual: bool  # the accumulation law: no_sync by hand, one update per step
    synced_init: bool


def _micro_batches(ctx_extras: Any, plan: _Plan) -> int:
    if plan.micro is not None:
        return plan.micro
    state = ctx_extras.get("accumulation")
    return state.every if isinstance(state, AccumulationState) else 1


@attrs.frozen
class Divided:
    """``forward``'s loss divided by ``parts``: a micro-batch's share, computed inside the step.

    A strategy whose ``step`` runs the backward too (a pipeline's schedule) takes
    no loss but the one ``step`` returned, so the division happens in the forward.
    """

    forward: Forward
    parts: int

    def __call__(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        return self.forward(module, batch) / self.parts


def backward_in_step(strategy: StrategyLike) -> bool:
    """Whether ``strategy``'s ``step`` already runs the backward (`BackwardInStep`: pipelines)."""
    return isinstance(peel(strategy.backward)[1], BackwardInStep)


def train_step(
    strategy: StrategyLike,
    ctx: Any,
    model: torch.nn.Module,
    pieces: Sequence[Any],
    forward: Forward,
) -> torch.Tensor:
    """Step and backpropagate ``pieces``, each ``loss / k`` (no_sync on all but the last).

    Returns the last piece's loss. A strategy whose ``step`` runs the backward
    gets the division inside its forward (`Divided`).
    """
    k = len(pieces)
    in_step = backward_in_step(strategy)
    loss = torch.zeros(())
    for index, piece in enumerate(pieces):
        last = index == k - 1
        with contextlib.nullcontext() if last else strategy.no_sync(model, ctx):
            if in_step or k == 1:
                divided = Divided(forward, k) if k > 1 else forward
                loss = strategy.step(model, piece, ctx, forward=divided)
                strategy.backward(loss, model, ctx)
            else:
                loss = strategy.step(model, piece, ctx, forward=forward)
                strategy.backward(loss / k, model, ctx)
    return loss


def _train(
    strategy: StrategyLike,
    ctx: Any,
    model: torch.nn.Module,
    optimizer: Any,
    pieces: list[Any],
    plan: _Plan,
    forward: Forward,
) -> None:
    """One optimizer step of the user's loop, over ``pieces`` (this step's micro-batches)."""
    if plan.manual:
        train_step(strategy, ctx, model, pieces, forward)
        strategy.update(optimizer, model, ctx)
        return
    for piece in pieces:
        loss = strategy.step(model, piece, ctx, forward=forward)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)


def _rank_run(
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: Any,
    plan: _Plan,
    make_optimizer: OptimizerFactory,
    forward: Forward,
) -> tuple[int, int | None, tuple[int, int], Snapshots, list[int], bool]:
    start = perturbed(module, 0 if plan.synced_init else ctx.rank)
    model = strategy.wrap(start, ctx)
    optimizer = make_optimizer(model.parameters())
    micro = _micro_batches(ctx.extras, plan)
    mine = own_share(batch, ctx)
    pieces = [share(mine, micro, i) for i in range(micro)]
    snapshots = [_packed(snapshot(model, optimizer))]
    skipped = [_skipped(ctx)]
    for _ in range(plan.steps):
        _train(strategy, ctx, model, optimizer, pieces, plan, forward)
        snapshots.append(_packed(snapshot(model, optimizer)))
        skipped.append(_skipped(ctx))
    window = ctx.extras.get("accumulation")  # what accumulate resolved for this world
    every = window.every if isinstance(window, AccumulationState) else None
    return micro, every, tuple(ctx.data_parallel), snapshots, skipped, holds_part(ctx)


def _skipped(ctx: Any) -> int:
    """Optimizer steps the precision skipped so far (a non-finite gradient under loss scaling)."""
    return int(getattr(ctx.extras.get("precision"), "skipped", 0))


def _packed(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    # NumPy arrays pickle several times faster than tensors: this is most of a law's traffic.
    return {
        k: v if v.dtype in (torch.bfloat16, torch.bool) else v.numpy() for k, v in state.items()
    }


def _unpacked(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in state.items()}


# --- the reference ---------------------------------------------------------------------------


@attrs.define
class _Shares:
    """The reference's forward: each rank's share separately, each with its own buffers."""

    forward: Forward
    world_size: int
    buffers: list[dict[str, torch.Tensor]]
    # DistributedDataParallel broadcasts rank 0's buffers before a forward that follows a
    # synchronising one (and before the first): one whose micro-batch is the last of the
    # law's step (``law_window``) and of accumulate's window (``window``).
    broadcasting: bool = False
    law_window: int = 1
    window: int = 1
    forwards: int = 0

    def _synchronised(self, forward: int) -> bool:
        return (forward + 1) % self.law_window == 0 and (forward + 1) % self.window == 0

    def __call__(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        if self.broadcasting and (self.forwards == 0 or self._synchronised(self.forwards - 1)):
            self.buffers = [{k: v.clone() for k, v in self.buffers[0].items()}] * self.world_size
        self.forwards += 1
        plain = unwrap(module)
        losses = []
        for rank in range(self.world_size):
            # Each share gets buffer tensors of its own: a forward saves its running
            # statistics for backward, so they must not be overwritten in place.
            for key, value in self.buffers[rank].items():
                owner, _, name = key.rpartition(".")
                plain.get_submodule(owner)._buffers[name] = value.clone()  # noqa: SLF001
            # Under autocast each share casts the weights anew, as each rank does: a cast
            # shared by the shares would sum their gradients in the low precision.
            torch.clear_autocast_cache()
            losses.append(self.forward(module, share(batch, self.world_size, rank)))
            self.buffers[rank] = {k: b.detach().clone() for k, b in plain.named_buffers()}
        # The sum, not the mean: each share's graph gets the gradient a rank's gets (under
        # loss scaling, the same scale), and `_averaging` divides the parameters' gradients.
        return torch.stack([loss.float() for loss in losses]).sum()


def _averaging(model: torch.nn.Module, world_size: int) -> None:
    """Divide every parameter's gradient by ``world_size`` as it arrives: the ranks' average."""
    if world_size > 1:
        for parameter in unwrap(model).parameters():
            if parameter.requires_grad:
                parameter.register_hook(lambda grad: grad / world_size)  # type: ignore[no-untyped-call]


def _per_rank_view(
    model: torch.nn.Module, optimizer: Any, buffers: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    state = snapshot(model, optimizer)
    persistent = set(unwrap(model).state_dict())
    for key, value in buffers.items():
        if key in persistent:
            state[f"model.{key}"] = value.detach().cpu().clone()
    return state


def _reference_run(
    reference: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    world_size: int,
    micro: int,
    every: int | None,
    plan: _Plan,
    rule: str,
    make_optimizer: OptimizerFactory,
    forward: Forward,
    skips: frozenset[int] = frozenset(),
) -> list[Snapshots]:
    """Train the reference on whole micro-batches; return each rank's expected snapshots."""
    ctx = reference.setup(Env())
    try:
        model = reference.wrap(copy.deepcopy(module), ctx)
        _averaging(model, world_size)
        optimizer = make_optimizer(model.parameters())
        named = dict(unwrap(model).named_buffers())
        shares_ = _Shares(
            forward,
            world_size,
            [{k: b.detach().clone() for k, b in named.items()}] * world_size,
            broadcasting=rule == "broadcast",
            law_window=micro if plan.manual else 1,
            window=every or 1,
        )
        per_rank = [share(batch, world_size, r) for r in range(world_size)]
        pieces = [_joined([share(p, micro, i) for p in per_rank]) for i in range(micro)]
        expected: list[Snapshots] = [[] for _ in range(world_size)]
        for step in range(plan.steps + 1):
            if step:
                stepping = _skipping(optimizer) if step in skips else optimizer
                _train(reference, ctx, model, stepping, pieces, plan, shares_)
                if rule == "averaged":  # every update synchronises: the shares' mean
                    shares_.buffers = [_mean_buffers(shares_.buffers)] * world_size
            for rank in range(world_size):
                expected[rank].append(_per_rank_view(model, optimizer, shares_.buffers[rank]))
        return expected
    finally:
        reference.teardown(ctx)


def _local_reference_run(
    reference: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    world_size: int,
    micro: int,
    plan: _Plan,
    sync_every: int,
    make_optimizer: OptimizerFactory,
    forward: Forward,
    skips: frozenset[int] = frozenset(),
    buffers: bool = False,
) -> list[Snapshots]:
    """Local SGD's reference: a replica per rank on its own share, parameters averaged every k.

    With ``buffers``, each replica's floating-point buffers are averaged with the parameters.
    """
    contexts = [reference.setup(Env()) for _ in range(world_size)]
    try:
        models = [reference.wrap(copy.deepcopy(module), ctx) for ctx in contexts]
        optimizers = [make_optimizer(m.parameters()) for m in models]
        shares_ = [share(batch, world_size, r) for r in range(world_size)]
        expected: list[Snapshots] = [
            [snapshot(m, o)] for m, o in zip(models, optimizers, strict=True)
        ]
        for step in range(1, plan.steps + 1):
            for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
                pieces = [share(shares_[rank], micro, i) for i in range(micro)]
                stepping = _skipping(optimizer) if step in skips else optimizer
                _train(reference, contexts[rank], model, stepping, pieces, plan, forward)
            if step % sync_every == 0:
                _average([unwrap(m) for m in models], buffers=buffers)
            for rank in range(world_size):
                expected[rank].append(snapshot(models[rank], optimizers[rank]))
        return expected
    finally:
        for ctx in contexts:
            reference.teardown(ctx)


def _no_step(step: Callable[[], Any]) -> None:
    """Skip the optimizer's step, as loss scaling does after a non-finite gradient."""


def _skipping(optimizer: Any) -> OptimizerHook:
    """Return ``optimizer`` with its step skipped: the reference skips what the ranks skipped."""
    return OptimizerHook(optimizer, _no_step)


def _agreed_skips(
    law: str, strategy: StrategyLike, inputs: str, counts: list[list[int]]
) -> frozenset[int]:
    """Return the updates every rank's precision skipped; the ranks must agree on them.

    Under loss scaling (``"16-mixed"``) a non-finite gradient skips the update,
    and the reference skips it too. A step skipped on some ranks only leaves
    the ranks' shares of the model at different steps.
    """
    skipped = [
        {step for step in range(1, len(mine)) if mine[step] > mine[step - 1]} for mine in counts
    ]
    for rank, steps in enumerate(skipped):
        if steps != skipped[0]:
            raise LawViolation(
                law,
                strategy,
                inputs,
                f"rank 0 skipped updates {sorted(skipped[0])} and rank {rank} "
                f"{sorted(steps)} (a non-finite gradient under loss scaling): the ranks must "
                "agree on skipping a step; an overflow check over this rank's gradient shard "
                "alone, not agreed with the others, gives this",
            )
    return frozenset(skipped[0])


def _average(models: list[torch.nn.Module], *, buffers: bool = False) -> None:
    groups: list[list[torch.Tensor]] = [list(m.parameters()) for m in models]
    if buffers:  # BatchNorm's statistics; a count (num_batches_tracked) is the same everywhere
        groups = [[*g, *(b for b in m.buffers() if b.is_floating_point())]
                  for g, m in zip(groups, models, strict=True)]  # fmt: skip
    with torch.no_grad():
        for tensors in zip(*groups, strict=True):
            mean = torch.stack([t.detach() for t in tensors]).mean(dim=0)
            for tensor in tensors:
                tensor.copy_(mean)


def _mean_buffers(buffers: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Average the shares' floating-point buffers key by key (others: the first share's)."""
    return {
        key: torch.stack([b[key] for b in buffers]).mean(dim=0) if value.is_floating_point()
        else value.clone()
        for key, value in buffers[0].items()
    }  # fmt: skip


# --- the laws --------------------------------------------------------------------------------


def _reference_for(
    strategy: StrategyLike, reference: StrategyLike | None, every: int | None
) -> StrategyLike:
    return reference if reference is not None else undistributed(strategy, every=every)


def _judge(
    law: str,
    strategy: StrategyLike,
    inputs: str,
    results: list[Snapshots],
    expected: list[Snapshots],
    contract: Contract,
    hint_for_law: str,
    parts: list[tuple[bool, int]] | None = None,
) -> None:
    rtol, atol = contract.tolerances(law_tolerances(strategy, law))
    outliers = 0.0 if contract.exact else law_outliers(strategy, law)  # exact means every element
    world_size = len(results)
    steps = len(expected[0])
    sharded = contract.optimizer_state == "sharded"
    # (holds a part, data-parallel index) of every rank: a pipeline's stage holds the keys of
    # its stages only; together, the ranks of one pipeline must hold every key.
    parts = parts if parts is not None else [(False, 0)] * world_size
    for step in range(steps):
        when = "after wrap" if step == 0 else f"after update {step}"
        lost = _uncovered(results, expected, step) if sharded else None
        if lost is None and any(part for part, _ in parts):
            lost = _misheld(results, expected, step, parts)
        if lost is not None:
            raise LawViolation(law, strategy, inputs, f"{when}: {lost}")
        for rank in range(world_size):
            keys = None
            if sharded:  # this rank's slots, and the module's state whole
                keys = tuple(
                    k for k in expected[rank][step]
                    if not k.startswith("optimizer.") or k in results[rank][step]
                )  # fmt: skip
            if parts[rank][0]:  # this stage's keys; _misheld saw that none is lost
                keys = tuple(k for k in keys or expected[rank][step] if k in results[rank][step])
            difference = first_difference(
                results[rank][step], expected[rank][step], rtol=rtol, atol=atol, keys=keys,
                outliers=outliers,
            )  # fmt: skip
            if difference is None:
                continue
            agree = all(
                first_difference(
                    results[r][step], results[0][step], rtol=rtol, atol=atol,
                    keys=(difference.key,),
                ) is None
                or first_difference(
                    expected[r][step], expected[0][step], rtol=rtol, atol=atol,
                    keys=(difference.key,),
                ) is not None
                for r in range(world_size)
            )  # fmt: skip
            cause = hint(difference, expected[0][0], agree, world_size)
            error = LawViolation(
                law,
                strategy,
                inputs,
                f"{when}, rank {rank}: {difference.describe()} against the reference "
                f"(rtol {rtol:g}, atol {atol:g}); {cause}. {hint_for_law}",
            )
            error.step, error.rank, error.key = step, rank, difference.key  # type: ignore[attr-defined]
            raise error


def _uncovered(results: list[Snapshots], expected: list[Snapshots], step: int) -> str | None:
    """Under sharded optimizer state: the reference's slots that no rank holds, described."""
    held = {k for states in results for k in states[step] if k.startswith("optimizer.")}
    lost = [k for k in expected[0][step] if k.startswith("optimizer.") and k not in held]
    if not lost:
        return None
    return (
        f"no rank holds the optimizer state {lost[:3]} (sharded optimizer state must cover "
        "every parameter: a parameter with no owner gives this)"
    )


def _misheld(
    results: list[Snapshots], expected: list[Snapshots], step: int, parts: list[tuple[bool, int]]
) -> str | None:
    """Under a pipeline: a pipeline whose ranks do not hold every key of the reference once."""
    for group in sorted({index for _, index in parts}):
        ranks = [rank for rank, (_, index) in enumerate(parts) if index == group]
        held = [k for rank in ranks for k in results[rank][step]]
        lost = [k for k in expected[ranks[0]][step] if k not in held]
        twice = sorted({k for k in held if held.count(k) > 1})
        extra = sorted({k for k in held if k not in expected[ranks[0]][step]})
        if lost or twice or extra:
            found = (
                f"no rank holds {lost[:3]}" if lost
                else f"{twice[:3]} are held by several stages" if twice
                else f"{extra[:3]} are not in the reference"
            )  # fmt: skip
            return (
                f"among ranks {ranks} (one pipeline), {found}: together a pipeline's stages "
                "must hold each key of the module once (a stage list that drops or repeats a "
                "module gives this)"
            )
    return None


def _check(
    law: str,
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    given: LawSettings,
    *,
    plan: _Plan,
    contract: Contract,
    hint_for_law: str,
    adjust_reference: Callable[[StrategyLike], StrategyLike] | None = None,
    needs_an_update: bool = False,
) -> None:
    size, optimizer, forward = given.ranks, given.optimizer, given.forward
    _check_inputs(module, batch, size, forward)
    runs = run_on(given.world, size, _rank_run, strategy, module, batch, plan, optimizer, forward)
    micro, every = runs[0][0], runs[0][1]
    inputs = (
        f"module={summarize(module)}, batch={summarize(batch)}, steps={plan.steps}, "
        f"micro-batches={micro}, optimizer={getattr(optimizer, '__name__', optimizer)}"
    )
    skips = _agreed_skips(law, strategy, inputs, [run[4] for run in runs])
    if needs_an_update and len(skips) == plan.steps:
        raise LawViolation(
            law,
            strategy,
            inputs,
            f"loss scaling skipped every update ({sorted(skips)}): the gradients were never "
            "finite (a loss scaled twice, or gradients that overflow at any scale, gives this)",
        )
    # Under tensor parallelism the ranks of a group share one part of the batch: the reference
    # trains `parts` shares, and each rank is compared with its group's.
    parts = runs[0][2][1]
    if _length(batch) % (parts * micro):
        raise UsageError(
            f"laws: each rank's share of {_length(batch) // parts} samples does not split into "
            f"{micro} equal micro-batches; give a batch whose length is a multiple of "
            f"{parts * micro}."
        )
    derived = _reference_for(strategy, given.reference, every)
    if adjust_reference is not None:
        derived = adjust_reference(derived)
    if contract.per_rank_optimizer:
        expected = _local_reference_run(
            derived, module, batch, parts, micro, plan, contract.sync_every, optimizer, forward,
            skips, buffers=contract.buffers == "averaged",
        )  # fmt: skip
    else:
        rule = buffers_rule(strategy, contract)
        expected = _reference_run(
            derived, module, batch, parts, micro, every, plan, rule, optimizer, forward, skips
        )
    expected = [expected[run[2][0]] for run in runs]
    inputs += f", reference={getattr(derived, 'name', derived)!r}"
    if skips:
        inputs += f", updates skipped by loss scaling on every rank={sorted(skips)}"
    results = [[_unpacked(state) for state in run[3]] for run in runs]
    parts = [(run[5], run[2][0]) for run in runs]
    _judge(law, strategy, inputs, results, expected, contract, hint_for_law, parts)


def check_data_parallel_step(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    *,
    tolerance: float | None = None,
    **options: Unpack[ReferenceOptions],
) -> None:
    """Law ``data-parallel-step``: N ranks train as the same stack on one process does.

    See the module's docstring for the reference and what is compared.

    Args:
        strategy: the strategy under test (fields picklable: module-level or attrs callables).
        module: the module to train; rank 0 starts from it, the others from
            perturbed copies (``contract.synced_init`` starts all from it).
        batch: a tensor, an ``(inputs, targets)`` tuple or a dict of tensors;
            its length a multiple of the world size (times the micro-batches).
        tolerance: an absolute tolerance, for callers of the first edition
            (the same as ``contract=Contract(atol=tolerance)``; for exact
            comparison, ``Contract(exact=True)``).
        **options: `ReferenceOptions` (`stratagem.testing.laws.options`):
            ``world`` (None: a `World` of ``world_size=2`` ranks is started),
            ``steps=3`` (at least ``contract.sync_every + 1``),
            ``optimizer=sgd_momentum``, ``forward=squares_mean``,
            ``contract`` (``Contract()``), ``reference`` (derived from
            ``strategy`` when it is built from stratagem's parts).

    Raises:
        LawViolation: a rank's state differs from the reference's, naming the
            first step, the rank, the key, the differences and a likely cause.
        UsageError: the inputs cannot test the law (a batch the ranks cannot
            share, a module without parameters).
        TypeError: a keyword the law does not take.
    """
    given = settings("check_data_parallel_step", options, ReferenceOptions, own=["tolerance"])
    terms = given.terms(tolerance)
    # At least one synchronisation of a strategy that synchronises every k updates.
    count = max(given.steps, terms.sync_every + 1)
    _check(
        "data-parallel-step", strategy, module, batch, given,
        plan=_Plan(count, None, manual=False, synced_init=terms.synced_init), contract=terms,
        hint_for_law="A wrap or update that skips synchronisation, or a reduce that sums "
        "where it should average, breaks this law.",
    )  # fmt: skip


_ACCUMULATION = LawSettings(steps=2)


def check_accumulation(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    *,
    micro_batches: int = 2,
    tolerance: float | None = None,
    **options: Unpack[ReferenceOptions],
) -> None:
    """Law ``accumulation``: k micro-batches by hand under ``no_sync``, then one update.

    Each rank splits its share into ``micro_batches`` pieces, backpropagates
    ``loss / k`` for each (inside the strategy's ``no_sync`` but the last) and
    updates once per step; the reference does the same on whole micro-batches.
    ``tolerance`` is `check_data_parallel_step`'s, and so are ``**options``
    (`ReferenceOptions`) but for ``steps``: ``world``, ``world_size=2``,
    ``steps=2``, ``optimizer=sgd_momentum``, ``forward=squares_mean``,
    ``contract``, ``reference``.

    Raises:
        LawViolation: a rank's state differs from the reference's.
        UsageError: as `check_data_parallel_step`.
        TypeError: a keyword the law does not take.
    """
    own = ["micro_batches", "tolerance"]
    given = settings(
        "check_accumulation", options, ReferenceOptions, own=own, defaults=_ACCUMULATION
    )
    label = "check_accumulation: 'micro_batches'"
    require(is_int(micro_batches, 1), label, "a positive int", micro_batches)
    terms = given.terms(tolerance)
    _check(
        "accumulation", strategy, module, batch, given,
        plan=_Plan(given.steps, micro_batches, manual=True, synced_init=terms.synced_init),
        contract=terms,
        hint_for_law="A no_sync that drops the accumulated gradients, or a last micro-batch "
        "that does not synchronise, breaks this law.",
    )  # fmt: skip
