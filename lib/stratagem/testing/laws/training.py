"""Laws of the training fields: wrap, step's autocast, no_sync, and the record's purity.

The laws that compare training with a reference (``data-parallel-step``,
``accumulation``) are in `stratagem.testing.laws.parallel`.
"""

from __future__ import annotations

import pickle
from typing import Any, Unpack

import attrs
import torch

from stratagem.checkpoint import unwrap
from stratagem.strategy import StrategyLike
from stratagem.testing.laws._core import (
    LawViolation,
    first_mismatch,
    fresh_copy,
    full_parameters,
    holds_part,
    keyed_parameters,
    max_difference,
    on_device,
    own_share,
    run_on,
    share,
    summarize,
    within,
)
from stratagem.testing.laws.options import Forward, LossOptions, RunOptions, settings
from stratagem.testing.laws.parallel import train_step
from stratagem.testing.tolerances import law_tolerances
from stratagem.trees import tensors_in

__all__ = [
    "check_no_sync",
    "check_purity",
    "check_step_autocast",
    "check_wrap",
]


def _train_rank(
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: Any,
    steps: int,
    lr: float,
    forward: Forward,
    micro_batches: int,
) -> list[torch.Tensor]:
    model = strategy.wrap(fresh_copy(module), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    mine = own_share(batch, ctx)
    pieces = [share(mine, micro_batches, i) for i in range(micro_batches)]
    for _ in range(steps):
        train_step(strategy, ctx, model, pieces, forward)  # only the last piece synchronises
        strategy.update(optimizer, model, ctx)
    return full_parameters(model)


def _local_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, parameter in unwrap(model).named_parameters():
        grad = parameter.grad
        if grad is None:
            continue
        # A sharded gradient is visible only once reduce-scattered (FSDP2 keeps an unsynced
        # one to itself): whole, it shows whether the ranks' gradients were synchronised.
        whole = getattr(grad, "full_tensor", None)
        grads[name] = (whole() if callable(whole) else grad).detach().clone()
    return grads


def _no_sync_rank(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, batch: Any, forward: Forward
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = strategy.wrap(fresh_copy(module), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = own_share(batch, ctx)
    with strategy.no_sync(model, ctx):
        strategy.backward(strategy.step(model, mine, ctx, forward=forward), model, ctx)
        inside = _local_gradients(model)
    strategy.backward(strategy.step(model, mine, ctx, forward=forward), model, ctx)
    strategy.update(optimizer, model, ctx)
    return inside, keyed_parameters(model)


def _first_keyed_mismatch(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]
) -> tuple[str, float] | None:
    """Return the first key both hold whose values differ (pipeline stages hold different keys)."""
    for key, value in ours.items():
        if key in theirs:
            difference = max_difference(value, theirs[key])
            if not difference <= 0.0:
                return key, difference
    return None


def check_no_sync(
    strategy: StrategyLike, module: torch.nn.Module, batch: Any, **options: Unpack[LossOptions]
) -> None:
    """Law ``no-sync``: inside ``no_sync`` gradients stay local; after the next update ranks agree.

    The ranks' shares of ``batch`` must differ, so that local gradients differ.
    ``**options`` (`LossOptions`): ``world``, ``world_size=2``, ``forward=squares_mean``.

    Raises:
        LawViolation: gradients were already equal across ranks inside ``no_sync``
            (it synchronised), or parameters differ across ranks after the update.
        TypeError: a keyword the law does not take.
    """
    given = settings("check_no_sync", options, LossOptions)
    size = given.ranks
    results = run_on(given.world, size, _no_sync_rank, strategy, module, batch, given.forward)
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    inside = [grads for grads, _ in results]
    # Gradients may be invisible inside no_sync (FSDP keeps them unsharded until the next
    # synchronising backward); only visible ones can show that nothing was synchronised.
    # Ranks compare the parameters both hold: a pipeline's stages hold different ones.
    sharing = [g for g in inside[1:] if set(g) & set(inside[0])]
    if sharing and all(_first_keyed_mismatch(inside[0], g) is None for g in sharing):
        raise LawViolation(
            "no-sync",
            strategy,
            inputs,
            "gradients were identical on every rank inside no_sync: they were synchronised",
        )
    after = [parameters for _, parameters in results]
    for rank in range(1, size):
        found = _first_keyed_mismatch(after[rank], after[0])
        if found is not None:
            raise LawViolation(
                "no-sync",
                strategy,
                inputs,
                f"after the synchronising step and update, rank {rank}'s parameter {found[0]} "
                f"differs from rank 0's by {found[1]:g}",
            )


def _purity_rank(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, batch: Any, forward: Forward
) -> tuple[bytes, bytes, list[torch.Tensor]]:
    before = pickle.dumps(strategy)
    trained = _train_rank(strategy, ctx, module, batch, 1, 0.1, forward, 1)
    return before, pickle.dumps(strategy), trained


def check_purity(
    strategy: StrategyLike, module: torch.nn.Module, batch: Any, **options: Unpack[LossOptions]
) -> None:
    """Law ``purity``: use does not change a strategy; the same inputs give the same outputs.

    Each rank trains one update, twice from the same start, pickling the record
    before and after. ``**options`` (`LossOptions`): ``world``,
    ``world_size=2``, ``forward=squares_mean``.

    Raises:
        LawViolation: the record pickles differently after use (a field holds state
            that training changed), or two identical runs ended with different parameters.
        TypeError: a keyword the law does not take.
    """
    given = settings("check_purity", options, LossOptions)
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    # Two runs, each with its own per-run state (a World makes ctx.extras afresh for every
    # run; without a World, each run is a world of its own).
    args = (given.world, given.ranks, _purity_rank, strategy, module, batch, given.forward)
    first_run, second_run = run_on(*args), run_on(*args)
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
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: Any,
    forward: Forward | None = None,
) -> tuple[list[str], torch.Tensor, torch.Tensor, bool, int]:
    # The plain module runs where the strategy trains, on the same data: a GPU strategy is
    # compared with the GPU's float32 arithmetic, not the CPU's.
    plain = fresh_copy(module).to(ctx.device)
    wrapped = strategy.wrap(fresh_copy(module), ctx)
    data = on_device(batch, ctx)
    if forward is None:
        with torch.no_grad():
            ours = strategy.step(wrapped, data, ctx)
            theirs = plain(data)
    else:  # the loss: a step that also backpropagates (a pipeline's) needs gradients on
        ours = strategy.step(wrapped, data, ctx, forward=forward).detach()
        theirs = forward(plain, data).detach()
    keys = list(unwrap(wrapped).state_dict().keys())
    part = holds_part(ctx)
    return keys, torch.as_tensor(ours).float(), theirs.float(), part, ctx.data_parallel[0]


def check_wrap(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    *,
    tolerance: float | None = None,
    rtol: float | None = None,
    forward: Forward | None = None,
    **options: Unpack[RunOptions],
) -> None:
    """Law ``wrap-preserves``: the wrapped module computes what the plain one does, same keys.

    With ``forward`` (``(module, batch) -> loss``), ``step`` with it must return
    the loss ``forward`` gives on the plain module (an ``(inputs, targets)``
    batch, or a pipeline, whose step returns the loss). A pipeline's stage holds
    the keys of its stages, in the plain module's order; together the ranks of
    one pipeline hold every key once.

    Outputs agree when ``|ours - plain| <= tolerance + rtol * |plain|`` elementwise.
    Omitted, both are derived from the precision the strategy computes in
    (`stratagem.testing.tolerances`): ``1e-5`` and 0 in float32, two units of
    bfloat16's or float16's epsilon under a precision that rounds the outputs to it.
    ``**options`` (`RunOptions`): ``world``, ``world_size=2``.

    Raises:
        LawViolation: outputs differ beyond the tolerance or state-dict keys changed.
        TypeError: a keyword the law does not take.
    """
    own = ["tolerance", "rtol", "forward"]
    given = settings("check_wrap", options, RunOptions, own=own)
    derived_rtol, derived_atol = law_tolerances(strategy, "wrap-preserves")
    atol = derived_atol if tolerance is None else tolerance
    rtol = derived_rtol if rtol is None else rtol
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    expected_keys = list(module.state_dict().keys())
    results = run_on(given.world, given.ranks, _wrap_rank, strategy, module, batch, forward)
    _check_stage_keys(strategy, inputs, expected_keys, results)
    for rank, (keys, ours, theirs, part, _) in enumerate(results):
        if not part and keys != expected_keys:
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


def _check_stage_keys(
    strategy: StrategyLike, inputs: str, expected: list[str], results: list[Any]
) -> None:
    """Each pipeline stage's keys in the plain module's order; each pipeline's cover it once."""
    groups: dict[int, list[int]] = {}
    for rank, (keys, _, _, part, index) in enumerate(results):
        if not part:
            continue
        groups.setdefault(index, []).append(rank)
        if keys != [k for k in expected if k in keys] or not set(keys) <= set(expected):
            raise LawViolation(
                "wrap-preserves",
                strategy,
                inputs,
                f"rank {rank}: its stage's state-dict keys {keys} are not keys of the plain "
                f"module {expected} in its order",
            )
    for index, ranks in groups.items():
        held = sorted(k for rank in ranks for k in results[rank][0])
        if held != sorted(expected):
            lost = [k for k in expected if k not in held]
            raise LawViolation(
                "wrap-preserves",
                strategy,
                inputs,
                f"pipeline {index} (ranks {ranks}): its stages hold {held}, the plain module "
                f"{sorted(expected)}"
                + (f"; no stage holds {lost}" if lost else "")
                + " (a stage list that drops or repeats a module gives this)",
            )


@attrs.frozen
class _Recording:
    """The forward ``step`` is given, recording the autocast state it runs under."""

    seen: dict[str, Any]
    forward: Forward | None

    def __call__(self, inner: torch.nn.Module, data: Any) -> torch.Tensor:
        device = next(iter(tensors_in(data))).device.type
        self.seen["enabled"] = torch.is_autocast_enabled(device)
        self.seen["dtype"] = str(torch.get_autocast_dtype(device))
        if self.forward is None:
            output: torch.Tensor = inner(data)
            self.seen["output"] = str(output.dtype)
            return output
        loss = self.forward(inner, data)  # a loss's dtype is the user's: not checked
        self.seen["output"] = self.seen["dtype"]
        return loss


def _autocast_rank(
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: Any,
    forward: Forward | None = None,
) -> tuple[bool, str, str]:
    model = strategy.wrap(fresh_copy(module), ctx)
    seen: dict[str, Any] = {}
    strategy.step(model, own_share(batch, ctx), ctx, forward=_Recording(seen, forward))
    return bool(seen["enabled"]), seen["dtype"], seen["output"]


def check_step_autocast(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    dtype: torch.dtype,
    *,
    forward: Forward | None = None,
    **options: Unpack[RunOptions],
) -> None:
    """Law ``step-autocast``: a mixed-precision strategy runs the user's forward under autocast.

    With ``forward`` (``(module, batch) -> loss``, for an ``(inputs, targets)``
    batch) the autocast state is read inside it; the loss's dtype is not checked.
    ``**options`` (`RunOptions`): ``world``, ``world_size=2``.

    Raises:
        LawViolation: the forward ran without autocast, with another dtype, or
            produced outputs of another dtype.
        TypeError: a keyword the law does not take.
    """
    given = settings("check_step_autocast", options, RunOptions, own=["forward"])
    inputs = f"module={summarize(module)}, batch={summarize(batch)}, dtype={dtype}"
    for rank, (enabled, seen, output) in enumerate(
        run_on(given.world, given.ranks, _autocast_rank, strategy, module, batch, forward)
    ):
        if not enabled or seen != str(dtype) or output != str(dtype):
            raise LawViolation(
                "step-autocast",
                strategy,
                inputs,
                f"rank {rank}: forward ran with autocast {'on' if enabled else 'off'} ({seen}) "
                f"and returned {output}; a step that skips the precision's autocast gives this",
            )
