"""Law ``precision-close-to-float32``: a precision stack trains as float32 does, but for rounding.

``data-parallel-step`` compares the ranks with the same stack on one process:
a precision bug in a layer both share (an update that never unscales the
gradients of ``"16-mixed"``, a backward that never scales them) is the same on
both sides, and passes. This law compares the ranks with the stack's float32
self instead (`stratagem.testing.tolerances.without_precision` of the derived
reference), within what the precision's rounding allows
(`stratagem.testing.tolerances.law_tolerances`): a step 65536 times too large
or too small is far outside it.
"""

from __future__ import annotations

from typing import Any, Unpack

import torch

from stratagem.checkpoint.entries import unwrap
from stratagem.errors import UsageError
from stratagem.optimizer_hooks import root_optimizer
from stratagem.strategy import StrategyLike
from stratagem.testing.laws._core import LawViolation, fresh_copy, own_share, run_on, summarize
from stratagem.testing.laws.options import (
    Forward,
    LossOptions,
    ReferenceOptions,
    settings,
    sgd_momentum,
)
from stratagem.testing.laws.parallel import _check, _Plan
from stratagem.testing.tolerances import compute_dtype, without_precision

__all__ = ["check_master_weights", "check_precision"]


def check_precision(
    strategy: StrategyLike, module: torch.nn.Module, batch: Any, **options: Unpack[ReferenceOptions]
) -> None:
    """Law ``precision-close-to-float32``: N ranks in a precision train as one float32 process.

    The reference is ``reference`` (else the derived one,
    `stratagem.testing.reference.undistributed`) with every layer of
    ``with_precision`` taken off; each rank's whole state after wrap and after
    each of ``steps`` updates must be within the precision's tolerance of it
    (a contract's ``rtol`` / ``atol`` override it).
    Use an optimizer whose step follows the gradient's size (SGD, the
    default): Adam's divides it out, and would hide a missing unscale.
    Updates that loss scaling skips on every rank are skipped by the
    reference too, but at least one of the ``steps`` must be taken.

    ``**options`` are `check_data_parallel_step`'s (`ReferenceOptions`):
    ``world``, ``world_size=2``, ``steps=3``, ``optimizer=sgd_momentum``,
    ``forward=squares_mean``, ``contract``, ``reference``.

    Raises:
        LawViolation: a rank's state is further from float32 training than
            the precision's rounding explains (a missing unscale or scale, ...),
            or loss scaling skipped every update.
        UsageError: ``strategy`` applies no precision, or as `check_data_parallel_step`.
        TypeError: a keyword the law does not take.
    """
    given = settings("check_precision", options, ReferenceOptions)
    if compute_dtype(strategy) == torch.float32:
        raise UsageError(
            f"check_precision: strategy {getattr(strategy, 'name', strategy)!r} computes in "
            "float32 already; apply with_precision(strategy, ...) first, or use "
            "check_data_parallel_step."
        )
    terms = given.terms()
    _check(
        "precision-close-to-float32", strategy, module, batch, given,
        plan=_Plan(max(given.steps, terms.sync_every + 1), None, manual=False,
                   synced_init=terms.synced_init),
        contract=terms,
        hint_for_law="An update that never unscales the gradients (\"16-mixed\"), a backward "
        "that never scales them, or a wrap that casts the wrong way breaks this law.",
        adjust_reference=without_precision,
        needs_an_update=True,
    )  # fmt: skip


def _master_dtypes(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, batch: Any, forward: Forward
) -> dict[str, str]:
    model = strategy.wrap(fresh_copy(module), ctx)
    optimizer = sgd_momentum(model.parameters())
    strategy.backward(strategy.step(model, own_share(batch, ctx), ctx, forward=forward), model, ctx)
    strategy.update(optimizer, model, ctx)
    kept = {f"model.{n}": p.dtype for n, p in unwrap(model).named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    for parameter, slots in root_optimizer(optimizer).state.items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                kept[f"optimizer.{names.get(id(parameter), '?')}.{slot}"] = value.dtype
    return {key: str(dtype) for key, dtype in kept.items() if dtype != torch.float32}


def check_master_weights(
    strategy: StrategyLike, module: torch.nn.Module, batch: Any, **options: Unpack[LossOptions]
) -> None:
    """Law ``float32-master-weights``: under a mixed precision the optimizer steps float32.

    A ``-mixed`` precision (``with_precision``'s, or an ``fsdp()`` ``mp_policy``
    with a low ``param_dtype``) computes the forward in the low dtype, but
    keeps the parameters the optimizer updates, and its state, in float32.
    A module given in bfloat16 (a checkpoint loaded as it was published) must
    be upcast by ``wrap``; one that stays in bfloat16 loses every update
    smaller than half its last place. ``**options`` (`LossOptions`): ``world``,
    ``world_size=2``, ``forward=squares_mean``.

    Raises:
        LawViolation: after wrap and one update, a parameter or an optimizer
            slot is not float32 (a wrap whose upcast does nothing gives this).
        TypeError: a keyword the law does not take.
    """
    given = settings("check_master_weights", options, LossOptions)
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    for rank, low in enumerate(
        run_on(given.world, given.ranks, _master_dtypes, strategy, module, batch, given.forward)
    ):
        if low:
            shown = ", ".join(f"{k} is {v}" for k, v in list(low.items())[:3])
            raise LawViolation(
                "float32-master-weights",
                strategy,
                inputs,
                f"rank {rank}: after wrap and one update, {shown}; a mixed precision keeps "
                "the weights the optimizer steps in float32 (a wrap whose upcast of a "
                "low-precision module does nothing gives this: module.float() returns the "
                "module, tensor.float() a copy)",
            )
