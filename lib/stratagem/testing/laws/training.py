"""Laws of the training fields: wrap, step's autocast, no_sync, and the record's purity.

The laws that compare training with a reference (``data-parallel-step``,
``accumulation``) are in `stratagem.testing.laws.parallel`.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable
from typing import Any

import torch

from stratagem.checkpoint import unwrap
from stratagem.strategy import StrategyLike
from stratagem.testing.laws._core import (
    LawViolation,
    first_mismatch,
    fresh_copy,
    full_parameters,
    max_difference,
    on_device,
    own_share,
    run_on,
    squares_mean,
    summarize,
    within,
)
from stratagem.testing.tolerances import law_tolerances
from stratagem.testing.world import World

__all__ = [
    "check_no_sync",
    "check_purity",
    "check_step_autocast",
    "check_wrap",
]

Forward = Callable[[torch.nn.Module, Any], torch.Tensor]


def _train_rank(
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: torch.Tensor,
    steps: int,
    lr: float,
    forward: Forward,
    micro_batches: int,
) -> list[torch.Tensor]:
    model = strategy.wrap(fresh_copy(module), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    mine = own_share(batch, ctx)
    pieces = mine.chunk(micro_batches)
    for _ in range(steps):
        for index, piece in enumerate(pieces):
            last = index == len(pieces) - 1  # only the last micro-batch synchronises
            with contextlib.nullcontext() if last else strategy.no_sync(model, ctx):
                loss = strategy.step(model, piece, ctx, forward=forward)
                strategy.backward(loss / len(pieces), model, ctx)
        strategy.update(optimizer, model, ctx)
    return full_parameters(model)


def _local_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = []
    for parameter in unwrap(model).parameters():
        grad = parameter.grad
        if grad is None:
            continue
        local = getattr(grad, "to_local", None)  # sharded gradients: this rank's piece
        grads.append((local() if callable(local) else grad).detach().clone())
    return grads


def _no_sync_rank(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, batch: torch.Tensor, forward: Forward
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = strategy.wrap(fresh_copy(module), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = own_share(batch, ctx)
    with strategy.no_sync(model, ctx):
        strategy.backward(strategy.step(model, mine, ctx, forward=forward), model, ctx)
        inside = _local_gradients(model)
    strategy.backward(strategy.step(model, mine, ctx, forward=forward), model, ctx)
    strategy.update(optimizer, model, ctx)
    return inside, full_parameters(model)


def check_no_sync(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: torch.Tensor,
    *,
    world: World | None = None,
    world_size: int = 2,
    forward: Forward = squares_mean,
) -> None:
    """Law ``no-sync``: inside ``no_sync`` gradients stay local; after the next update ranks agree.

    The ranks' shares of ``batch`` must differ, so that local gradients differ.

    Raises:
        LawViolation: gradients were already equal across ranks inside ``no_sync``
            (it synchronised), or parameters differ across ranks after the update.
    """
    size = world.world_size if world is not None else world_size
    results = run_on(world, size, _no_sync_rank, strategy, module, batch, forward)
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    inside = [grads for grads, _ in results]
    # Gradients may be invisible inside no_sync (FSDP keeps them unsharded until the next
    # synchronising backward); only visible ones can show that nothing was synchronised.
    visible = bool(inside[0])
    if size > 1 and visible and all(first_mismatch(inside[0], g, 0.0) is None for g in inside[1:]):
        raise LawViolation(
            "no-sync",
            strategy,
            inputs,
            "gradients were identical on every rank inside no_sync: they were synchronised",
        )
    after = [parameters for _, parameters in results]
    for rank in range(1, size):
        mismatch = first_mismatch(after[rank], after[0], 0.0)
        if mismatch is not None:
            raise LawViolation(
                "no-sync",
                strategy,
                inputs,
                f"after the synchronising step and update, rank {rank}'s parameter {mismatch[0]} "
                f"differs from rank 0's by {mismatch[1]:g}",
            )


def _purity_rank(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, batch: torch.Tensor, forward: Forward
) -> tuple[bytes, bytes, list[torch.Tensor]]:
    before = pickle.dumps(strategy)
    trained = _train_rank(strategy, ctx, module, batch, 1, 0.1, forward, 1)
    return before, pickle.dumps(strategy), trained


def check_purity(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: torch.Tensor,
    *,
    world: World | None = None,
    world_size: int = 2,
    forward: Forward = squares_mean,
) -> None:
    """Law ``purity``: use does not change a strategy; the same inputs give the same outputs.

    Raises:
        LawViolation: the record pickles differently after use (a field holds state
            that training changed), or two identical runs ended with different parameters.
    """
    size = world.world_size if world is not None else world_size
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    # Two runs, each with its own per-run state (a World makes ctx.extras afresh for every
    # run; without a World, each run is a world of its own).
    first_run = run_on(world, size, _purity_rank, strategy, module, batch, forward)
    second_run = run_on(world, size, _purity_rank, strategy, module, batch, forward)
    results = [(*a, b[2]) for a, b in zip(first_run, second_run, strict=True)]
    for rank, (before, after, first, second) in enumerate(results):
        if before != after:
            raise LawViolation(
                "purity", strategy, inputs, f"rank {rank}: the record changed while it was used"
            )
        mismatch = first_mismatch(first, second, 0.0)
        if mismatch is not None:
            raise LawViolation(
                "purity",
                strategy,
                inputs,
                f"rank {rank}: two identical runs differ in parameter {mismatch[0]} by "
                f"{mismatch[1]:g}",
            )


def _wrap_rank(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, batch: torch.Tensor
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    # The plain module runs where the strategy trains, on the same data: a GPU strategy is
    # compared with the GPU's float32 arithmetic, not the CPU's.
    plain = fresh_copy(module).to(ctx.device)
    wrapped = strategy.wrap(fresh_copy(module), ctx)
    data = on_device(batch, ctx)
    with torch.no_grad():
        ours = strategy.step(wrapped, data, ctx)
        theirs = plain(data)
    keys = list(unwrap(wrapped).state_dict().keys())
    return keys, torch.as_tensor(ours).float(), theirs.float()


def check_wrap(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: torch.Tensor,
    *,
    world: World | None = None,
    world_size: int = 2,
    tolerance: float | None = None,
    rtol: float | None = None,
) -> None:
    """Law ``wrap-preserves``: the wrapped module computes what the plain one does, same keys.

    Outputs agree when ``|ours - plain| <= tolerance + rtol * |plain|`` elementwise.
    Omitted, both are derived from the precision the strategy computes in
    (`stratagem.testing.tolerances`): ``1e-5`` and 0 in float32, two units of
    bfloat16's or float16's epsilon under a precision that rounds the outputs to it.

    Raises:
        LawViolation: outputs differ beyond the tolerance or state-dict keys changed.
    """
    derived_rtol, derived_atol = law_tolerances(strategy, "wrap-preserves")
    atol = derived_atol if tolerance is None else tolerance
    rtol = derived_rtol if rtol is None else rtol
    size = world.world_size if world is not None else world_size
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    expected_keys = list(module.state_dict().keys())
    for rank, (keys, ours, theirs) in enumerate(
        run_on(world, size, _wrap_rank, strategy, module, batch)
    ):
        if keys != expected_keys:
            raise LawViolation(
                "wrap-preserves",
                strategy,
                inputs,
                f"rank {rank}: state-dict keys {keys} differ from the plain module's "
                f"{expected_keys}",
            )
        if not within(ours, theirs, rtol=rtol, atol=atol):
            raise LawViolation(
                "wrap-preserves",
                strategy,
                inputs,
                f"rank {rank}: step through the wrapped module differs from the plain module "
                f"by {max_difference(ours, theirs):g} (rtol {rtol:g}, atol {atol:g})",
            )


def _autocast_rank(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, batch: torch.Tensor
) -> tuple[bool, str, str]:
    model = strategy.wrap(fresh_copy(module), ctx)
    seen: dict[str, Any] = {}

    def forward(inner: torch.nn.Module, data: torch.Tensor) -> torch.Tensor:
        device = data.device.type
        seen["enabled"] = torch.is_autocast_enabled(device)
        seen["dtype"] = str(torch.get_autocast_dtype(device))
        output: torch.Tensor = inner(data)
        return output

    output = strategy.step(model, own_share(batch, ctx), ctx, forward=forward)
    return bool(seen["enabled"]), seen["dtype"], str(output.dtype)


def check_step_autocast(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: torch.Tensor,
    dtype: torch.dtype,
    *,
    world: World | None = None,
    world_size: int = 2,
) -> None:
    """Law ``step-autocast``: a mixed-precision strategy runs the user's forward under autocast.

    Raises:
        LawViolation: the forward ran without autocast, with another dtype, or
            produced outputs of another dtype.
    """
    size = world.world_size if world is not None else world_size
    inputs = f"module={summarize(module)}, batch={summarize(batch)}, dtype={dtype}"
    for rank, (enabled, seen, output) in enumerate(
        run_on(world, size, _autocast_rank, strategy, module, batch)
    ):
        if not enabled or seen != str(dtype) or output != str(dtype):
            raise LawViolation(
                "step-autocast",
                strategy,
                inputs,
                f"rank {rank}: forward ran with autocast {'on' if enabled else 'off'} ({seen}) "
                f"and returned {output}; a step that skips the precision's autocast gives this",
            )
