"""`Contract`: what a strategy promises the laws, so that they check exactly that."""

from __future__ import annotations

from typing import Literal, get_args

import attrs

from stratagem.validators import a_bool, choice, field, is_int, is_number

__all__ = ["Buffers", "Contract", "OptimizerState"]

Buffers = Literal["broadcast", "per-rank", "averaged"]
_BUFFERS: tuple[str, ...] = get_args(Buffers)
OptimizerState = Literal["replicated", "sharded", "per-rank"]
_OPTIMIZER_STATES: tuple[str, ...] = get_args(OptimizerState)


_OWNER = "Contract: '{name}'"
_FLAG = a_bool(_OWNER)
_TOLERANCE = field(
    lambda v: is_number(v) and v >= 0,
    _OWNER,
    "a finite number >= 0",
    optional="None (derived from the precision the strategy computes in)",
)
_BUFFERS_CHOICE = choice(_OWNER, _BUFFERS, subclasses=True, optional="None (read off the strategy)")
_STATE_CHOICE = choice(_OWNER, _OPTIMIZER_STATES, subclasses=True)
_SYNC_EVERY = field(
    lambda v: is_int(v, 1),
    _OWNER,
    "a positive int, the updates between two synchronisations of the parameters",
)


@attrs.frozen(kw_only=True)
class Contract:
    """What a strategy promises: the training laws check this, and only this.

    Attributes:
        sync_every: updates between two synchronisations. 1 (data parallelism):
            after every update each rank holds the reference's state. ``k > 1``
            (local SGD): each rank trains its own share for ``k`` updates, then
            the ranks average their parameters; the law's reference does the
            same, rank by rank, and compares every rank after every update.
        buffers: what happens to buffers (BatchNorm's running statistics):
            ``"broadcast"``, rank 0's are copied to every rank before the first
            forward of each optimizer step (``DistributedDataParallel``'s
            ``broadcast_buffers``); ``"per-rank"``, each rank keeps its own after
            wrap; ``"averaged"``, the ranks average their floating-point buffers
            with their parameters at every synchronisation (local SGD that
            averages BatchNorm's statistics every ``sync_every`` updates; under
            ``sync_every=1``, after every update). ``None`` reads it off the
            strategy (``"broadcast"`` under a ``ddp()`` wrap that broadcasts
            buffers, else ``"per-rank"``). A checkpoint saves replicated state
            once, from rank 0, so after a load every rank holds rank 0's
            buffers either way; the round-trip law checks exactly that.
        optimizer_state: ``"replicated"``, every rank holds the whole optimizer
            state; ``"sharded"`` (ZeRO-1), each rank holds the state of some
            parameters: each rank's slots must equal the reference's, and
            together the ranks must hold every slot. Checkpoints then keep each
            rank's optimizer state as its own. ``"per-rank"`` (local SGD at
            any ``sync_every``, 1 included): each rank steps its own optimizer
            on its own gradients and the ranks average only their parameters;
            the reference is then a replica per rank, on that rank's share,
            and each rank's whole state (its optimizer's included) must equal
            its replica's. ``sync_every > 1`` implies it.
        synced_init: the caller gives every rank the same module, so ``wrap``
            need not broadcast; the laws then start every rank from the same
            weights (by default rank ``r > 0`` starts from other weights, and
            ``wrap`` must give it rank 0's).
        rtol: relative tolerance of every comparison with the reference;
            None (the default) derives it from the precision the strategy
            computes in (`stratagem.testing.tolerances`): ``1e-4`` in float32
            (sums in another order differ in their last bits, and a few
            optimizer steps carry that on), a few units of bfloat16's or
            float16's epsilon under a precision that computes in them.
        atol: absolute tolerance of every comparison with the reference; None
            derives it as ``rtol`` is (``1e-5`` in float32).
        exact: demand bit-for-bit equality (``rtol`` and ``atol`` of 0).

    Example:
        >>> Contract(sync_every=4).tolerances()
        (0.0001, 1e-05)
    """

    sync_every: int = attrs.field(default=1, validator=_SYNC_EVERY)
    buffers: Buffers | None = attrs.field(default=None, validator=_BUFFERS_CHOICE)
    optimizer_state: OptimizerState = attrs.field(default="replicated", validator=_STATE_CHOICE)
    synced_init: bool = attrs.field(default=False, validator=_FLAG)
    rtol: float | None = attrs.field(default=None, validator=_TOLERANCE)
    atol: float | None = attrs.field(default=None, validator=_TOLERANCE)
    exact: bool = attrs.field(default=False, validator=_FLAG)

    @property
    def per_rank_optimizer(self) -> bool:
        """Whether each rank keeps optimizer state of its own (``"per-rank"``, or local SGD)."""
        return self.optimizer_state == "per-rank" or self.sync_every > 1

    def tolerances(self, derived: tuple[float, float] = (1e-4, 1e-5)) -> tuple[float, float]:
        """Return ``(rtol, atol)``: both 0 when ``exact``; else each as given, or ``derived``'s.

        ``derived`` is what the law derived from the strategy's precision
        (`stratagem.testing.tolerances.law_tolerances`); float32's by default.
        """
        if self.exact:
            return (0.0, 0.0)
        rtol = self.rtol if self.rtol is not None else derived[0]
        atol = self.atol if self.atol is not None else derived[1]
        return (float(rtol), float(atol))
