"""``with_precision``: module dtype, autocast in ``step``, loss scaling for ``"16-mixed"``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from stratagem import collectives
from stratagem.combinators._base import CombinatorError, check_strategy, gradients
from stratagem.env import Context, Env, check_context
from stratagem.errors import UsageError
from stratagem.fields import (
    BackwardFn,
    BackwardInStep,
    ForwardFn,
    SetupFn,
    StepFn,
    UpdateFn,
    WrapFn,
)
from stratagem.optimizer_hooks import OptimizerHook, root_optimizer
from stratagem.precisions import (
    AUTOCAST_DTYPES,
    DTYPES,
    PRECISIONS,
    Precision,
    PrecisionState,
    check_fsdp_policy,
    is_mixed,
    precision_of,
)
from stratagem.strategy import Strategy, applied
from stratagem.training import check_loss, check_optimizer, move_batch
from stratagem.trees import map_tensors
from stratagem.validators import require

__all__ = ["PrecisionSetup", "PrecisionStep", "PrecisionWrap", "with_precision"]


def _check_device(precision: str, device: torch.device) -> None:
    if is_mixed(precision) and not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise UsageError(
            f"precision {precision!r} needs autocast, which is not available on device "
            f"{str(device)!r}; use '32-true' or a '-true' precision there."
        )
    if device.type == "cuda" and "bf16" in precision and not torch.cuda.is_bf16_supported():
        raise UsageError(
            f"precision {precision!r} needs bfloat16, which device {str(device)!r} does not "
            "support; use '16-mixed'."
        )


@attrs.frozen
class PrecisionSetup:
    """Setup: check the device can run the precision; create the per-run state."""

    inner: SetupFn
    precision: str

    def __call__(self, env: Env) -> Context:
        ctx = self.inner(env)
        _check_device(self.precision, ctx.device)
        scaler = torch.amp.GradScaler(ctx.device.type) if self.precision == "16-mixed" else None
        return ctx.with_extras(precision=PrecisionState(self.precision, scaler))


@attrs.frozen
class PrecisionWrap:
    """Wrap: the module in the precision's dtype (``-true``) before the inner wrap.

    A ``-mixed`` precision leaves the module float32; after the inner wrap,
    every FSDP group must gather in the precision's dtype (the built-in wrap
    takes its policy from the context; a user's own must too).
    """

    inner: WrapFn
    precision: str

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        if not is_mixed(self.precision) and isinstance(module, torch.nn.Module):
            module = module.to(DTYPES[self.precision])
        wrapped = self.inner(module, ctx)
        state = precision_of(ctx)
        if state is not None:
            check_fsdp_policy(wrapped, state, "with_precision")
        return wrapped


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    # The batch walk of move_batch: a NamedTuple or dataclass batch is cast like a tuple.
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


@attrs.frozen
class PrecisionStep:
    """Step: the inner step under autocast (``-mixed``) or on a batch of the dtype (``-true``)."""

    inner: StepFn
    precision: str

    def __call__(
        self, module: torch.nn.Module, batch: Any, ctx: Context, *, forward: ForwardFn | None = None
    ) -> Any:
        if ctx.__class__ is not Context:  # every step runs this: one test, usually
            check_context(ctx, "step")
        autocast = AUTOCAST_DTYPES.get(self.precision)
        if autocast is not None:
            with torch.autocast(ctx.device_type, dtype=autocast):
                return self.inner(module, batch, ctx, forward=forward)
        dtype = DTYPES[self.precision]
        if dtype != torch.float32:
            batch = _cast_floats(move_batch(batch, ctx.device), dtype)
        return self.inner(module, batch, ctx, forward=forward)


def _state(ctx: Context, function: str) -> PrecisionState:
    state = precision_of(check_context(ctx, function))
    if state is None:
        raise UsageError(
            "with_precision: ctx has no precision state; pass the Context that this strategy's "
            "setup returned (launch does this)."
        )
    return state


@attrs.frozen
class ScaledBackward:
    """Backward of ``"16-mixed"``: backpropagate the loss multiplied by the scaler's scale."""

    inner: BackwardFn

    def __call__(self, loss: torch.Tensor, module: torch.nn.Module, ctx: Context) -> None:
        check_loss(loss, "backward")
        scaler = _state(ctx, "backward").scaler
        self.inner(scaler.scale(loss) if scaler is not None else loss, module, ctx)


@attrs.frozen
class ScaledUpdate:
    """Update of ``"16-mixed"``: unscale, skip the step on overflow, adjust the scale."""

    inner: UpdateFn

    def __call__(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context
    ) -> None:
        check_optimizer(optimizer, "update")  # the inner update checks the rest, in its order
        state = _state(ctx, "update")

        def on_step(step: Callable[[], Any]) -> Any:
            state.unscale(root_optimizer(optimizer))
            finite = _all_finite(gradients(optimizer), ctx)
            # An overflow (or a NaN loss) skips the step, as GradScaler does; the scale backs off.
            result = step() if finite else None
            state.skipped += not finite
            if state.scaler is not None:
                state.scaler.update()
            state.unscaled = False
            return result

        self.inner(OptimizerHook(optimizer, on_step), module, ctx)  # type: ignore[arg-type]


def _all_finite(grads: list[torch.Tensor], ctx: Context) -> bool:
    """Whether every gradient is finite, on every rank that holds a shard of it.

    Replicated gradients (DDP's, averaged) are the same everywhere; sharded ones
    (FSDP's, tensor parallel's DTensors) are checked shard by shard, so the ranks
    agree in one small reduction, as ``ShardedGradScaler`` does: one rank
    skipping a step the others take would leave the shards at different steps.
    """
    sharded = any(hasattr(g, "to_local") for g in grads)
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads] if sharded else grads
    finite = not local or bool(torch.stack([g.isfinite().all() for g in local]).all())
    if not sharded or not collectives.is_distributed(ctx):
        return finite
    flag = torch.tensor([0.0 if finite else 1.0], device=local[0].device if local else ctx.device)
    return collectives.reduce(flag, "max", ctx).item() == 0.0


def with_precision(strategy: Strategy, precision: Precision) -> Strategy:
    """Train in a numeric precision: module dtype, autocast, loss scaling.

    The precisions: ``"32-true"``, ``"64-true"``, ``"bf16-mixed"``,
    ``"bf16-true"``, ``"16-mixed"``, ``"16-true"``.

    Fields touched: ``setup`` (device check, per-run `PrecisionState` in
    ``ctx.extras["precision"]``), ``wrap`` (module dtype for ``-true``; under
    ``fsdp()``, its ``mp_policy`` for ``-mixed``),
    ``step`` (autocast for ``-mixed``, batch dtype for ``-true``), and for
    ``"16-mixed"`` ``backward`` (loss scaling) and ``update`` (unscale, skip
    on overflow, scale update).

    Under FSDP, a ``-mixed`` precision also reaches the wrap, through the
    context rather than the record: FSDP's wrap reads
    ``precision_of(ctx).fsdp_policy()``, ``MixedPrecisionPolicy(param_dtype=<its
    dtype>, reduce_dtype=torch.float32)``, so parameters are gathered and used
    in the low precision (half the traffic and memory of the unsharded
    parameters) and gradients are reduced and kept in float32 (BatchNorm
    layers are groups of their own that keep float32 parameters, beside their
    float32 statistics). A wrap of the user's own that calls ``fully_shard``
    must pass that policy; one that does not is refused at ``wrap``, never
    half applied. The order of combinators does not matter. Autocast stays in
    ``step`` as well, so the operations it keeps in float32 (softmax, norms,
    losses) still run in float32 and the step-autocast law holds on every
    strategy. ``"16-mixed"`` keeps its ``GradScaler``, which works on the
    sharded gradients (every rank skips an overflowing step together).

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, or ``precision`` is unknown.
        CombinatorError: the strategy already has a precision, or
            (``"16-mixed"``) its step runs the backward (a pipeline); at
            ``wrap``, FSDP groups that ignore the policy, or an
            ``fsdp(mp_policy=...)`` beside a ``-mixed`` precision.

    Example:
        >>> import stratagem as sg
        >>> strategy = sg.with_precision(sg.single_device("cpu"), "bf16-mixed")
        >>> ctx = strategy.setup(sg.Env())
        >>> model = strategy.wrap(torch.nn.Linear(2, 2), ctx)
        >>> strategy.step(model, torch.ones(1, 2), ctx).dtype
        torch.bfloat16
    """
    check_strategy(strategy, "with_precision")
    known = isinstance(precision, str) and precision in PRECISIONS
    wanted = f"one of {', '.join(map(repr, PRECISIONS))}"
    require(known, "with_precision: 'precision'", wanted, precision)
    existing = applied(strategy, PrecisionSetup)
    if existing is not None:
        raise CombinatorError(
            f"with_precision: strategy {strategy.name!r} already has precision "
            f"{existing.precision!r}; apply with_precision once."
        )
    if precision == "16-mixed" and applied(strategy, BackwardInStep) is not None:
        raise CombinatorError(
            f"with_precision: strategy {strategy.name!r} runs the backward in its step (a "
            "pipeline's schedule), so the loss scaling of '16-mixed' would reach no gradient; "
            "use 'bf16-mixed' (no loss scaling) or '16-true'."
        )
    changes: dict[str, Any] = {
        "name": f"{strategy.name}+{precision}",
        "setup": PrecisionSetup(strategy.setup, precision),
        "wrap": PrecisionWrap(strategy.wrap, precision),
        "step": PrecisionStep(strategy.step, precision),
    }
    if precision == "16-mixed":
        changes["backward"] = ScaledBackward(strategy.backward)
        changes["update"] = ScaledUpdate(strategy.update)
    return attrs.evolve(strategy, **changes)
