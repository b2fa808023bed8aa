"""The tolerance each law needs, derived from the precision a stack computes in.

A stack says which precision it applied (``with_precision``'s setup layer, a
layer whose class declares ``compute_dtype`` as ``with_float8``'s does, or the
``mp_policy`` of an ``fsdp()`` wrap), so a user checking
``with_precision(ddp(), "bf16-mixed")`` writes no `Contract` for it. Each law
compares something different, and needs its own margin:

- ``wrap-preserves``: one forward through the wrapped module against the plain
  module in float32; in a low precision every output is rounded to it (a few
  units of its epsilon).
- ``data-parallel-step``, ``accumulation``, ``ranks-in-sync``: the ranks against
  the same stack on one process, both in the precision; only the order of sums
  differs, but each step rounds in the low precision, and under a ``-true``
  precision the parameters and optimizer state are stored in it (one unit of
  the last place, flipped by a difference in the last bit of a gradient).
- ``precision-close-to-float32``: the stack against the same stack without its
  precision, in float32, for a few steps: the precision's own error, which is
  what a missing unscale (updates 65536 times too large) or a missing scale
  (65536 times too small) leaves far behind.

A layer whose class declares ``reorders_model_sums = True`` (context
parallelism's step: attention over gathered keys, per share of the queries)
computes the model's own sums in another order than one process does, not only
the gradient average; AdamW's first update is about ``lr`` times the
gradient's sign, so an element whose gradient is near zero moves where the
order changes its last bits. Its reference laws get four times float32's
margins, and in a low precision the margin of ``precision-close-to-float32``
(measured: one element of ``k.weight`` by ``2 * lr`` under bf16 on fsdp x cp).

A `Contract` that names ``rtol`` or ``atol`` overrides the derived value.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.combinators.precision import (
    PrecisionSetup,
    PrecisionStep,
    PrecisionWrap,
    ScaledBackward,
    ScaledUpdate,
)
from stratagem.layers import peel, rebased
from stratagem.precisions import DTYPES, is_mixed
from stratagem.strategies.fsdp_units import WrapFSDP
from stratagem.strategy import FIELD_SIGNATURES, Strategy, StrategyLike, applied

__all__ = [
    "FLOAT32",
    "OUTLIERS",
    "compute_dtype",
    "law_outliers",
    "law_tolerances",
    "mixed_precision",
    "without_precision",
]

FLOAT32: tuple[float, float] = (1e-4, 1e-5)
"""``(rtol, atol)`` of the training laws in float32: sums in another order, over a few steps."""

_WRAP_FLOAT32: tuple[float, float] = (0.0, 1e-5)
_PRECISION_LAYERS = (PrecisionSetup, PrecisionWrap, PrecisionStep, ScaledBackward, ScaledUpdate)

# Multiples of the compute dtype's epsilon, (rtol, atol), measured on the built-ins with
# every precision and the kit's default modules (2 and 4 ranks): every built-in passes with
# half of each, most with a quarter or less (the rounding of a "-true" step passes at half).
_EPS_MULTIPLES: dict[tuple[str, bool], tuple[float, float]] = {
    ("wrap-preserves", True): (2.0, 2.0),
    ("wrap-preserves", False): (2.0, 2.0),
    ("reference", True): (1.0, 1.0),
    ("reference", False): (8.0, 8.0),
    ("precision-close-to-float32", True): (4.0, 4.0),
    ("precision-close-to-float32", False): (8.0, 8.0),
}
_REFERENCE_LAWS = ("data-parallel-step", "accumulation", "ranks-in-sync")
# float32 margins, multiplied, for a stack that reorders the model's own sums: measured on
# fsdp x cp2 with a 32-wide attention block, AdamW moved one element 1.13e-5 (atol 1e-5).
_REORDERED_FLOAT32 = 4.0


def _applied_precision(strategy: StrategyLike) -> PrecisionSetup | None:
    found = applied(strategy, PrecisionSetup)
    return found if isinstance(found, PrecisionSetup) else None


def _reorders_model_sums(strategy: StrategyLike) -> bool:
    return any(
        getattr(type(layer), "reorders_model_sums", False) is True
        for name in FIELD_SIGNATURES
        for layer in peel(getattr(strategy, name))[0]
    )


def _declared(strategy: StrategyLike) -> torch.dtype | None:
    """Return the dtype a layer of ``strategy`` declares (class attribute ``compute_dtype``)."""
    for name in FIELD_SIGNATURES:
        layers, _ = peel(getattr(strategy, name))
        for layer in layers:
            dtype = getattr(type(layer), "compute_dtype", None)
            if isinstance(dtype, torch.dtype):
                return dtype
    return None


def compute_dtype(strategy: StrategyLike) -> torch.dtype:
    """Return the dtype ``strategy`` computes in: its precision's, fsdp's ``param_dtype``, float32.

    Example:
        >>> import stratagem as sg
        >>> compute_dtype(sg.with_precision(sg.ddp(), "bf16-mixed"))
        torch.bfloat16
        >>> compute_dtype(sg.ddp())
        torch.float32
    """
    precision = _applied_precision(strategy)
    if precision is not None:
        return DTYPES[precision.precision]
    declared = _declared(strategy)
    if declared is not None:
        return declared
    fsdp = applied(strategy, WrapFSDP)
    policy = getattr(fsdp, "mp_policy", None)
    param_dtype = getattr(policy, "param_dtype", None)
    return param_dtype if isinstance(param_dtype, torch.dtype) else torch.float32


def mixed_precision(strategy: StrategyLike) -> bool:
    """Whether the parameters stay float32 (autocast, or fsdp's policy) under a low dtype."""
    precision = _applied_precision(strategy)
    return is_mixed(precision.precision) if precision is not None else True


OUTLIERS = 0.01
"""The fraction of a tensor's elements a reference law lets fall outside its tolerance in a
low precision: AdamW's first update is about ``lr`` times the gradient's sign, so an element
whose gradient is near zero moves by ``2 * lr`` when rounding flips that sign (one element of
1,536 in a mixture of experts under ``fsdp()`` bf16-mixed). Averaging gradients wrongly moves
far more than 1 % (under SGD, nearly every element)."""


def law_outliers(strategy: StrategyLike, law: str) -> float:
    """Return the fraction of each tensor's elements ``law`` lets fall outside its tolerance.

    Example:
        >>> import stratagem as sg
        >>> law_outliers(sg.ddp(), "data-parallel-step")
        0.0
        >>> law_outliers(sg.with_precision(sg.ddp(), "bf16-mixed"), "data-parallel-step")
        0.01
    """
    low = torch.finfo(compute_dtype(strategy)).eps > torch.finfo(torch.float32).eps
    return OUTLIERS if low and law in _REFERENCE_LAWS else 0.0


def law_tolerances(strategy: StrategyLike, law: str) -> tuple[float, float]:
    """Return ``(rtol, atol)`` for ``law`` on ``strategy``, from the dtype it computes in.

    Example:
        >>> import stratagem as sg
        >>> law_tolerances(sg.ddp(), "data-parallel-step")
        (0.0001, 1e-05)
        >>> law_tolerances(sg.with_precision(sg.ddp(), "16-mixed"), "wrap-preserves")
        (0.001953125, 0.001953125)
    """
    dtype = compute_dtype(strategy)
    kind = "reference" if law in _REFERENCE_LAWS else law
    reordered = kind == "reference" and _reorders_model_sums(strategy)
    if torch.finfo(dtype).eps <= torch.finfo(torch.float32).eps:
        if reordered:
            return (_REORDERED_FLOAT32 * FLOAT32[0], _REORDERED_FLOAT32 * FLOAT32[1])
        return _WRAP_FLOAT32 if kind == "wrap-preserves" else FLOAT32
    if reordered:
        kind = "precision-close-to-float32"
    eps = float(torch.finfo(dtype).eps)
    rtol, atol = _EPS_MULTIPLES.get((kind, mixed_precision(strategy)), (4.0, 4.0))
    return (max(rtol * eps, FLOAT32[0]), max(atol * eps, FLOAT32[1]))


def without_precision(strategy: StrategyLike) -> Strategy:
    """Return ``strategy`` with every layer ``with_precision`` added taken off (float32 again).

    The law ``precision-close-to-float32`` compares a stack's training with
    this record's. Other layers (clipping, accumulation) stay as they were.
    """
    fields: dict[str, Any] = {}
    for name in FIELD_SIGNATURES:
        layers, base = peel(getattr(strategy, name))
        kept = [
            layer
            for layer in layers
            if not (isinstance(layer, _PRECISION_LAYERS) or hasattr(type(layer), "compute_dtype"))
        ]
        fields[name] = rebased(kept, base)
    return Strategy(name=f"{getattr(strategy, 'name', 'strategy')} in float32", **fields)
