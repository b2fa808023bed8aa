"""The reference of a data-parallel law: the same stack with its distribution removed.

``with_clipping(accumulate(ddp(), 2), max_norm=1.0)`` on N ranks is compared
with ``with_clipping(accumulate(single_device("cpu"), 2), max_norm=1.0)`` in
one process, on the whole batch: every layer is kept, stratagem's and the
user's alike (what it does to training is part of what the law checks), and
every base below them is replaced by ``single_device``'s. A layer whose
class says ``in_reference = False`` is left out: tracing (it records) and
tensor parallelism (it distributes), and a user's layer that distributes
(a communication hook, say).

A base of the user's own (a custom ``update`` that averages parameters, a
``wrap`` that casts) is replaced too: the law then checks that it trains as
one process does, which is what data parallelism promises. A strategy that
promises something else says so with a `Contract` (local SGD:
``sync_every``), or passes its own ``reference=``.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from stratagem.combinators.accumulation import AccumulationSetup
from stratagem.combinators.precision import PrecisionSetup
from stratagem.layers import in_reference, peel, rebased
from stratagem.precisions import AUTOCAST_DTYPES
from stratagem.strategies.ddp import WrapDDP
from stratagem.strategies.fsdp_units import WrapFSDP
from stratagem.strategies.single import single_device
from stratagem.strategy import FIELD_SIGNATURES, Strategy, StrategyLike, applied
from stratagem.testing.contract import Buffers, Contract

__all__ = ["buffers_rule", "undistributed"]


def undistributed(strategy: StrategyLike, *, every: int | None = None) -> Strategy:
    """Return ``strategy``'s combinator layers over ``single_device("cpu")``.

    Args:
        strategy: a record, usually combinators over a built-in.
        every: the micro-batches per step the ranks resolved for ``accumulate``
            (a function of the world size must give the reference the ranks' count).

    Example:
        >>> import stratagem as sg
        >>> clipped = sg.with_clipping(sg.ddp(), max_norm=1.0)
        >>> undistributed(clipped).update.inner is sg.single_device().update
        True
    """
    plain = single_device("cpu")
    changes: dict[str, Any] = {}
    peeled = {name: peel(getattr(strategy, name)) for name in FIELD_SIGNATURES}
    # A layer that holds another field (accumulate's step, the no_sync it enters) is re-pointed
    # by the record itself to the reference's field of that name when the reference is built.
    for name in FIELD_SIGNATURES:
        kept = [layer for layer in peeled[name][0] if in_reference(layer)]
        if every is not None:
            kept = [
                attrs.evolve(layer, every=every) if isinstance(layer, AccumulationSetup) else layer
                for layer in kept
            ]
        changes[name] = rebased(kept, getattr(plain, name))
    if _norms_in_float32(strategy):
        changes["wrap"] = NormsInFloat32(changes["wrap"])
    return attrs.evolve(
        plain, name=f"{getattr(strategy, 'name', 'strategy')} on one process", **changes
    )


def _norms_in_float32(strategy: StrategyLike) -> bool:
    """Whether ``strategy``'s fsdp wrap computes BatchNorm in float32 under a low ``mp_policy``."""
    fsdp = applied(strategy, WrapFSDP)
    if fsdp is None:
        return False
    param_dtype = getattr(fsdp.mp_policy, "param_dtype", None)
    if param_dtype is None:  # a mixed precision gives fsdp its policy at wrap, from the context
        precision = applied(strategy, PrecisionSetup)
        param_dtype = AUTOCAST_DTYPES.get(precision.precision) if precision is not None else None
    return param_dtype is not None and param_dtype != torch.float32


def _inputs_in_float32(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)  # fmt: skip


@attrs.frozen
class NormsInFloat32:
    """Reference wrap: every BatchNorm takes float32 inputs, as under fsdp's mixed precision.

    Under a low-precision ``mp_policy`` each BatchNorm is an FSDP group of its
    own that computes in float32 (its inputs cast up); autocast alone would run
    it in the low dtype, a difference of the stack, not of its distribution.
    """

    inner: Any

    def __call__(self, module: torch.nn.Module, ctx: Any) -> torch.nn.Module:
        wrapped: torch.nn.Module = self.inner(module, ctx)
        for norm in wrapped.modules():
            if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):  # noqa: SLF001
                norm.register_forward_pre_hook(_inputs_in_float32)
        return wrapped


def buffers_rule(strategy: StrategyLike, contract: Contract) -> Buffers:
    """Return what ``strategy`` does with buffers: the contract's word, or read off its wrap."""
    if contract.buffers is not None:
        return contract.buffers
    layers, base = peel(strategy.wrap)
    del layers
    if isinstance(base, WrapDDP) and base.options.broadcast_buffers:
        return "broadcast"
    return "per-rank"
