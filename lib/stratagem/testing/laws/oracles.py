"""Law ``combinator-arithmetic``: a stack's combinators do what plain torch does by hand.

The reference of ``data-parallel-step`` is the same stack on one process: a
combinator's own arithmetic is on both sides, so a wrong one agrees with
itself (``accumulate(normalize="sum")`` on a mean loss steps k times too far
on the ranks and in the reference alike). This law's oracle contains no
stratagem code: a plain module in float32 and a plain torch optimizer, which

- for ``accumulate``: backpropagates the mean of the k micro-batches' losses
  of every rank once, then steps (for a mean loss, one step on their
  concatenation: each micro-batch's forward runs alone, so batch statistics
  are per micro-batch, as on the ranks);
- for ``with_clipping``: calls ``torch.nn.utils.clip_grad_norm_`` (or
  ``clip_grad_value_``) on those gradients before the step;
- for a precision (``with_precision``, an ``fsdp()`` ``mp_policy``): computes
  in float32; the ranks must be within that precision's tolerance of it
  (`stratagem.testing.tolerances.law_tolerances`).

Activation checkpointing and ``torch.compile`` change no arithmetic: the
oracle is the plain step for them. Parameters are compared on every rank,
after every update.
"""

from __future__ import annotations

import copy
from typing import Any, Unpack

import torch

from stratagem.combinators.accumulation import AccumulationState
from stratagem.combinators.clipping import ClipUpdate
from stratagem.errors import UsageError
from stratagem.strategy import StrategyLike, applied
from stratagem.testing.laws._core import (
    LawViolation,
    holds_part,
    keyed_parameters,
    own_share,
    run_on,
    share,
    summarize,
)
from stratagem.testing.laws.options import (
    Forward,
    LawSettings,
    OptimizerFactory,
    TrainingOptions,
    settings,
    sgd,
)
from stratagem.testing.laws.parallel import (
    _agreed_skips,
    _check_inputs,
    _skipped,
    backward_in_step,
)
from stratagem.testing.laws.state import first_difference
from stratagem.testing.tolerances import FLOAT32, compute_dtype, law_tolerances
from stratagem.validators import is_int, require

__all__ = ["check_combinator_arithmetic"]

LAW = "combinator-arithmetic"
_DEFAULTS = LawSettings(optimizer=sgd)


def _rank(
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: Any,
    updates: int,
    make_optimizer: OptimizerFactory,
    forward: Forward,
) -> dict[str, Any]:
    if holds_part(ctx) or backward_in_step(strategy):
        raise UsageError(
            "laws: combinator-arithmetic trains the whole module with the user's backward; "
            "check a pipeline with the other training laws."
        )
    model = strategy.wrap(copy.deepcopy(module), ctx)
    optimizer = make_optimizer(model.parameters())
    window = ctx.extras.get("accumulation")
    micro = window.every if isinstance(window, AccumulationState) else 1
    mine = own_share(batch, ctx)
    pieces = [share(mine, micro, i) for i in range(micro)]
    states, skipped = [keyed_parameters(model)], [_skipped(ctx)]
    for _ in range(updates):
        for piece in pieces:  # the user's loop under accumulate: update after every micro-batch
            strategy.backward(strategy.step(model, piece, ctx, forward=forward), model, ctx)
            strategy.update(optimizer, model, ctx)
        states.append(keyed_parameters(model))
        skipped.append(_skipped(ctx))
    return {"micro": micro, "parts": ctx.data_parallel[1], "states": states, "skipped": skipped}


def _oracle(
    module: torch.nn.Module,
    batch: Any,
    parts: int,
    micro: int,
    updates: int,
    clip: ClipUpdate | None,
    make_optimizer: OptimizerFactory,
    forward: Forward,
    skips: frozenset[int],
) -> list[dict[str, torch.Tensor]]:
    """Plain torch in float32: one step per update on the mean of every micro-batch's loss."""
    model = copy.deepcopy(module).float()
    optimizer = make_optimizer(model.parameters())
    pieces = [share(share(batch, parts, r), micro, i) for r in range(parts) for i in range(micro)]
    states = [keyed_parameters(model)]
    for update in range(1, updates + 1):
        loss = torch.stack([forward(model, piece).float() for piece in pieces]).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        if clip is not None and clip.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip.max_norm, clip.norm_type)
        if clip is not None and clip.max_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip.max_value)
        if update not in skips:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        states.append(keyed_parameters(model))
    return states


def check_combinator_arithmetic(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    *,
    updates: int = 2,
    **options: Unpack[TrainingOptions],
) -> None:
    """Law ``combinator-arithmetic``: the stack trains as plain torch does its combinators by hand.

    See the module's docstring for the oracle. ``forward`` must return a mean
    over samples (the oracle averages the micro-batches' losses).

    Args:
        strategy: the stack under test (accumulate, clipping, precision over any base).
        module: the module to train; every rank starts from it.
        batch: its length a multiple of the world size times accumulate's k.
        updates: optimizer steps, each compared.
        **options: `TrainingOptions`: ``world`` (None: a `World` of
            ``world_size=2`` ranks is started), ``optimizer=sgd`` (plain SGD),
            ``forward=squares_mean`` (a mean over samples), ``contract``
            (its ``rtol`` / ``atol`` override the tolerances derived from the precision).

    Raises:
        LawViolation: a rank's parameters differ from the oracle's.
        UsageError: the inputs cannot test the law (a pipeline, a batch the ranks cannot share).
        TypeError: a keyword the law does not take.
    """
    law = "check_combinator_arithmetic"
    given = settings(law, options, TrainingOptions, own=["updates"], defaults=_DEFAULTS)
    require(is_int(updates, 1), f"{law}: 'updates'", "a positive int", updates)
    terms, size, optimizer, forward = given.terms(), given.ranks, given.optimizer, given.forward
    _check_inputs(module, batch, size, forward)
    runs = run_on(given.world, size, _rank, strategy, module, batch, updates, optimizer, forward)
    micro, parts = runs[0]["micro"], runs[0]["parts"]
    clip = applied(strategy, ClipUpdate)
    inputs = (
        f"module={summarize(module)}, batch={summarize(batch)}, updates={updates}, "
        f"micro-batches={micro}, optimizer={getattr(optimizer, '__name__', optimizer)}, "
        f"clipping={None if clip is None else (clip.max_norm, clip.max_value, clip.norm_type)}"
    )
    skips = _agreed_skips(LAW, strategy, inputs, [run["skipped"] for run in runs])
    expected = _oracle(module, batch, parts, micro, updates, clip, optimizer, forward, skips)
    low = compute_dtype(strategy) != torch.float32
    derived = law_tolerances(strategy, "precision-close-to-float32") if low else FLOAT32
    rtol, atol = terms.tolerances(derived)
    for rank, run in enumerate(runs):
        for update, (found, wanted) in enumerate(zip(run["states"], expected, strict=True)):
            difference = first_difference(found, wanted, rtol=rtol, atol=atol)
            if difference is None:
                continue
            when = "after wrap" if update == 0 else f"after update {update}"
            raise LawViolation(
                LAW,
                strategy,
                inputs,
                f"{when}, rank {rank}: {difference.describe('plain torch')} (rtol {rtol:g}, "
                f"atol {atol:g}); plain torch averages the {micro * parts} micro-batches' "
                "mean losses, clips with clip_grad_norm_ and steps in float32. A combinator "
                "whose own arithmetic is wrong (accumulate(normalize='sum') on a mean loss "
                "steps k times too far; clipping on the wrong norm; a precision that never "
                "unscales) breaks this law.",
            )
