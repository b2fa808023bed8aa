"""Combinators: functions from a strategy to a strategy, each wrapping only the fields it must."""

from stratagem.combinators._base import CombinatorError as CombinatorError
from stratagem.combinators.accumulation import accumulate as accumulate
from stratagem.combinators.clipping import with_clipping as with_clipping
from stratagem.combinators.precision import with_precision as with_precision

__all__ = ["CombinatorError", "accumulate", "with_clipping", "with_precision"]
