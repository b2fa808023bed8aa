"""Combinators: functions from a strategy to a strategy, each wrapping only the fields it must."""

from stratagem.combinators._base import CombinatorError as CombinatorError
from stratagem.combinators.accumulation import accumulate as accumulate
from stratagem.combinators.checked import CollectiveMismatchError as CollectiveMismatchError
from stratagem.combinators.checked import Fingerprint as Fingerprint
from stratagem.combinators.checked import checked as checked
from stratagem.combinators.checkpointing import (
    with_activation_checkpointing as with_activation_checkpointing,
)
from stratagem.combinators.clipping import with_clipping as with_clipping
from stratagem.combinators.compiled import compiled as compiled
from stratagem.combinators.context_parallel import context_parallel as context_parallel
from stratagem.combinators.expert_parallel import expert_parallel as expert_parallel
from stratagem.combinators.float8 import with_float8 as with_float8
from stratagem.combinators.precision import with_precision as with_precision
from stratagem.combinators.tensor_parallel import tensor_parallel as tensor_parallel
from stratagem.combinators.tracing import JsonLinesSink as JsonLinesSink
from stratagem.combinators.tracing import ListSink as ListSink
from stratagem.combinators.tracing import TraceEvent as TraceEvent
from stratagem.combinators.tracing import traced as traced

__all__ = [
    "CollectiveMismatchError",
    "CombinatorError",
    "Fingerprint",
    "JsonLinesSink",
    "ListSink",
    "TraceEvent",
    "accumulate",
    "checked",
    "compiled",
    "context_parallel",
    "expert_parallel",
    "tensor_parallel",
    "traced",
    "with_activation_checkpointing",
    "with_clipping",
    "with_float8",
    "with_precision",
]
