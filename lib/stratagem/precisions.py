"""The precision a run computes in: the typed slot where precision meets the fields it concerns.

``with_precision`` puts a `PrecisionState` in ``ctx.extras["precision"]`` at
setup; whatever else must know the precision reads it back with
`precision_of`, never by looking into another layer of the record. FSDP's
wrap (the built-in one or a user's own) takes its mixed-precision policy from
`PrecisionState.fsdp_policy`, and clipping unscales through it, whatever
order the combinators were applied in. A user's own precision combinator
that fills the same slot is met the same way.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Literal, get_args

import attrs
import torch

from stratagem.errors import CombinatorError

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from stratagem.env import Context

__all__ = [
    "AUTOCAST_DTYPES",
    "BATCH_NORMS",
    "DTYPES",
    "PRECISIONS",
    "Precision",
    "PrecisionState",
    "check_fsdp_policy",
    "is_mixed",
    "precision_of",
]

Precision = Literal["32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

DTYPES = {
    "32-true": torch.float32,
    "64-true": torch.float64,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
}


AUTOCAST_DTYPES = {name: dtype for name, dtype in DTYPES.items() if name.endswith("-mixed")}
"""The ``-mixed`` precisions and the dtype each autocasts to: one lookup tells both."""


def is_mixed(precision: str) -> bool:
    """Whether ``precision`` keeps float32 parameters and computes in a lower dtype (``-mixed``)."""
    return precision.endswith("-mixed")


@attrs.define
class PrecisionState:
    """Per-run precision state, kept in ``ctx.extras["precision"]``.

    Attributes:
        precision: the precision's name, e.g. ``"bf16-mixed"``.
        scaler: the ``GradScaler`` of ``"16-mixed"`` (None otherwise); save it
            with your checkpoint (``{"scaler": ctx.extras["precision"].scaler}``).
        unscaled: whether this step's gradients were already unscaled (by clipping).
        skipped: optimizer steps skipped so far because a gradient was not finite
            (``"16-mixed"``: an overflow, or a NaN/inf loss); see docs/faults.md.
    """

    precision: str
    scaler: torch.amp.GradScaler | None = None
    unscaled: bool = False
    skipped: int = 0

    @property
    def dtype(self) -> torch.dtype:
        """The dtype this precision computes in."""
        return DTYPES[self.precision]

    @property
    def mixed(self) -> bool:
        """Whether parameters stay float32 and only the computation runs in ``dtype``."""
        return is_mixed(self.precision)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this step's gradients once, before anything reads them.

        ``optimizer`` is the real optimizer, under any hooks.
        """
        if self.scaler is not None and not self.unscaled:
            self.scaler.unscale_(optimizer)
            self.unscaled = True

    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP's policy for this precision: ``None`` unless mixed.

        Parameters are gathered and used in the low precision (half the traffic
        and memory of the unsharded parameters); gradients are reduced and kept
        in float32, so the sum over ranks loses nothing.
        """
        if not self.mixed:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy  # seconds to import: FSDP only

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)


def precision_of(ctx: Context) -> PrecisionState | None:
    """Return the run's `PrecisionState`, or None when no precision was applied.

    Example:
        >>> import stratagem as sg
        >>> ctx = sg.with_precision(sg.single_device("cpu"), "bf16-mixed").setup(sg.Env())
        >>> precision_of(ctx).dtype, precision_of(sg.single_device("cpu").setup(sg.Env()))
        (torch.bfloat16, None)
    """
    state = ctx.extras.get("precision")
    return state if isinstance(state, PrecisionState) else None


# Norms keep float32 statistics, which batch_norm does not mix with a low-precision weight.
BATCH_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
)


def check_fsdp_policy(module: Any, state: PrecisionState, name: str) -> None:
    """Refuse a wrapped module whose FSDP groups ignore a mixed precision's policy.

    A wrap that calls ``fully_shard`` itself (grouped modules, per-group
    resharding) must pass ``mp_policy=precision_of(ctx).fsdp_policy()``;
    without it FSDP gathers and reduces in float32 and the precision is silently
    half applied. BatchNorm groups may keep float32, as the built-in wrap does.

    Raises:
        CombinatorError: a sharded group computes in another dtype than ``state``'s.
    """
    fsdp_imported = "torch.distributed.fsdp" in sys.modules  # nothing is sharded before that
    if not (state.mixed and fsdp_imported and isinstance(module, torch.nn.Module)):
        return
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for path, sub in module.named_modules():
        if not isinstance(sub, FSDPModule) or isinstance(sub, BATCH_NORMS):
            continue
        own = getattr(fully_shard.state(sub), "_mp_policy", None)  # type: ignore[attr-defined]
        dtype = getattr(own, "param_dtype", None)
        if dtype != state.dtype:
            where = f"module {path!r}" if path else "the root module"
            raise CombinatorError(
                f"{name}: {state.precision!r} needs FSDP to gather parameters in "
                f"{state.dtype}, but {where} was sharded with param_dtype={dtype} (a wrap that "
                "calls fully_shard itself); pass mp_policy=precision_of(ctx).fsdp_policy() "
                "to fully_shard (from stratagem.precisions import precision_of)."
            )
