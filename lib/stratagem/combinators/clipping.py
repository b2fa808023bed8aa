"""``with_clipping``: clip gradients by norm or by value just before the optimizer steps."""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch

from stratagem.combinators._base import check_once, check_strategy
from stratagem.env import Context, Env, check_context
from stratagem.errors import UsageError
from stratagem.fields import SetupFn, UpdateFn
from stratagem.optimizer_hooks import OptimizerHook, root_optimizer
from stratagem.parts import part_of
from stratagem.precisions import precision_of
from stratagem.strategy import Strategy
from stratagem.training import check_optimizer, check_update, clip_norm_, update
from stratagem.validators import is_number, require

__all__ = ["ClipState", "with_clipping"]


@attrs.define
class ClipState:
    """Per-run clipping state in ``ctx.extras["clipping"]``.

    Attributes:
        norm: the total gradient norm before the last clip (by-norm clipping), as
            the tensor the clipper returned, or None before the first step.
    """

    # A tensor, not a float: float() on every step would wait for the device each time.
    norm: torch.Tensor | None = None

    @property
    def last_norm(self) -> float | None:
        """``norm`` as a float (None before the first step)."""
        return None if self.norm is None else float(self.norm)


@attrs.frozen
class ClipSetup:
    """Setup: add the per-run `ClipState`."""

    inner: SetupFn

    def __call__(self, env: Env) -> Context:
        return self.inner(env).with_extras(clipping=ClipState())


def _dead() -> None:
    return None


# The last (optimizer, module) pair whose one parameter list was found in the module's order:
# weak references, and the list's id and length. The usual loop then reuses the optimizer's own
# list after four tests instead of walking the module every step.
_IN_ORDER: list[Any] = [_dead, _dead, 0, -1]


def _parameters(optimizer: Any, module: object) -> list[torch.Tensor]:
    """Return the optimizer's parameters in ``module.parameters()`` order, then the rest."""
    # The order of the norm's sum shows in its last bits: the module's order is the one a
    # hand-written loop uses (clip_grad_norm_(model.parameters(), ...)), so theirs match ours.
    root = root_optimizer(optimizer)
    groups = root.param_groups
    held = groups[0]["params"] if len(groups) == 1 else [p for g in groups for p in g["params"]]
    known, module_known, held_id, length = _IN_ORDER
    same = known() is root and module_known() is module and held_id == id(held)
    if same and length == len(held):
        # The list of last step, which was in the module's order; returned live, so a parameter
        # swapped into it since is clipped too.
        return held
    if not isinstance(module, torch.nn.Module):
        return list(held)
    in_module: list[torch.Tensor] = list(module.parameters())
    if len(in_module) == len(held) and all(map(operator.is_, in_module, held)):
        if len(groups) == 1:
            with contextlib.suppress(TypeError):  # an optimizer-like object without weakrefs
                _IN_ORDER[:] = [weakref.ref(root), weakref.ref(module), id(held), len(held)]
        return in_module  # the usual case, compared in one go
    ids = set(map(id, held))
    ordered = [p for p in in_module if id(p) in ids]
    seen = set(map(id, ordered))
    return ordered + [p for p in held if id(p) not in seen]


@attrs.frozen
class ClipUpdate:
    """Update: unscale (under ``"16-mixed"``), clip, then the inner update's own step."""

    inner: UpdateFn
    max_norm: float | None
    max_value: float | None
    norm_type: float

    def __call__(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context
    ) -> None:
        if self.inner is update:
            check_update(optimizer, module, ctx)
            # The plain update is step, then zero_grad: clipping before it is clipping inside
            # its step, without a hook around the optimizer (a tenth of a tiny step's time).
            self.clip(optimizer, module, ctx)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return
        # The inner update checks the rest, in its own order (fsdp's optimizer-before-wrap first).
        check_optimizer(optimizer, "update")
        check_context(ctx, "update")

        def on_step(step: Callable[[], Any]) -> Any:  # the inner update's optimizer step
            self.clip(optimizer, module, ctx)
            return step()

        self.inner(OptimizerHook(optimizer, on_step), module, ctx)  # type: ignore[arg-type]

    def clip(self, optimizer: Any, module: torch.nn.Module, ctx: Context) -> None:
        """Unscale (under ``"16-mixed"``), then clip the gradients ``optimizer`` will apply."""
        extras = ctx.extras
        precision = precision_of(ctx) if "precision" in extras else None
        if precision is not None:  # clip what the optimizer will see, not scaled values
            precision.unscale(root_optimizer(optimizer))
        parameters = _parameters(optimizer, module)
        if self.max_norm is not None:
            part = part_of(module)  # a pipeline's stages: the whole module's norm
            split_over = None if part is None else part.group
            norm = clip_norm_(parameters, self.max_norm, self.norm_type, split_over)
            state = extras.get("clipping")
            if isinstance(state, ClipState):
                state.norm = norm
        if self.max_value is not None:
            torch.nn.utils.clip_grad_value_(parameters, self.max_value)


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    require(
        is_number(value, above=0), f"with_clipping: '{name}'", "a positive finite number", value
    )
    return float(value)


def with_clipping(
    strategy: Strategy,
    *,
    max_norm: float | None = None,
    max_value: float | None = None,
    norm_type: float = 2.0,
) -> Strategy:
    """Clip gradients before each optimizer step: to norm ``max_norm``, or each to ``max_value``.

    Fields touched: ``setup`` (a `ClipState` in ``ctx.extras["clipping"]``,
    whose ``last_norm`` is the norm before clipping) and ``update``: clipping
    runs inside the optimizer step of the inner update, so gradients are
    clipped after they are synchronised (DDP, all-reduce strategies) and
    unscaled (``"16-mixed"``, in whichever order the combinators were applied).
    The norm is summed over the optimizer's parameters in the module's order
    (``module.parameters()``, then any the module does not hold), so it equals
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` of a
    hand-written loop bit for bit, whatever order the optimizer lists them in.

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, neither bound is given, or a
            bound or ``norm_type`` is not positive.
        CombinatorError: the strategy is already clipped.
    """
    check_strategy(strategy, "with_clipping")
    norm = _positive("max_norm", max_norm)
    value = _positive("max_value", max_value)
    if norm is None and value is None:
        raise UsageError(
            "with_clipping: give max_norm (clip by total norm) or max_value (by value)."
        )
    # inf is a norm too (the largest entry): only NaN and what is not above 0 are refused.
    positive = is_number(norm_type, above=0, finite=False)
    require(positive, "with_clipping: 'norm_type'", "positive", norm_type)
    check_once(strategy, ClipUpdate, "with_clipping", "is already clipped")
    return attrs.evolve(
        strategy,
        name=f"{strategy.name}+clip",
        setup=ClipSetup(strategy.setup),
        update=ClipUpdate(strategy.update, norm, value, float(norm_type)),
    )
