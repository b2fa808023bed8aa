"""Laws every strategy must obey, as plain functions to call from your own tests.

Each raises `LawViolation` (an ``AssertionError``) naming the law, the
strategy, the input and the difference found. Laws that need several ranks
take a `World` (``world=``) or start one for the call. The keywords the laws
share (``world``, ``world_size``, ``forward``, ``optimizer``, ``contract``,
``steps``, ``reference``) are typed and given their defaults once, in
`stratagem.testing.laws.options`; a law takes its group of them as
``**options`` (`RunOptions`, `LossOptions`, `TrainingOptions`,
`ReferenceOptions`) and refuses, with a ``TypeError`` naming those it takes,
a keyword it does not take. A law of your own is
built from the same parts: `run_on` (a function on every rank, results in
rank order), `snapshot` (a module's and optimizer's whole state by key),
`first_difference` (by key, with tolerances) and `LawViolation`.
"""

from stratagem.testing.laws._core import LawViolation as LawViolation
from stratagem.testing.laws._core import run_on as run_on
from stratagem.testing.laws.checkpoint import check_checkpoint_resume as check_checkpoint_resume
from stratagem.testing.laws.checkpoint import (
    check_checkpoint_round_trip as check_checkpoint_round_trip,
)
from stratagem.testing.laws.checkpoint import check_checkpoint_strict as check_checkpoint_strict
from stratagem.testing.laws.collective_counts import (
    check_collective_counts as check_collective_counts,
)
from stratagem.testing.laws.collective_counts import (
    expected_collectives as expected_collectives,
)
from stratagem.testing.laws.collectives import check_broadcast as check_broadcast
from stratagem.testing.laws.collectives import check_gather as check_gather
from stratagem.testing.laws.collectives import check_reduce as check_reduce
from stratagem.testing.laws.collectives import check_reduce_idempotent as check_reduce_idempotent
from stratagem.testing.laws.collectives import (
    check_single_rank_identities as check_single_rank_identities,
)
from stratagem.testing.laws.options import LossOptions as LossOptions
from stratagem.testing.laws.options import ReferenceOptions as ReferenceOptions
from stratagem.testing.laws.options import RunOptions as RunOptions
from stratagem.testing.laws.options import TrainingOptions as TrainingOptions
from stratagem.testing.laws.options import adamw as adamw
from stratagem.testing.laws.options import sgd as sgd
from stratagem.testing.laws.options import sgd_momentum as sgd_momentum
from stratagem.testing.laws.oracles import (
    check_combinator_arithmetic as check_combinator_arithmetic,
)
from stratagem.testing.laws.parallel import check_accumulation as check_accumulation
from stratagem.testing.laws.parallel import check_data_parallel_step as check_data_parallel_step
from stratagem.testing.laws.pipeline_schedule import (
    check_pipeline_schedule as check_pipeline_schedule,
)
from stratagem.testing.laws.precision import check_master_weights as check_master_weights
from stratagem.testing.laws.precision import check_precision as check_precision
from stratagem.testing.laws.sharding import check_shard_partition as check_shard_partition
from stratagem.testing.laws.state import first_difference as first_difference
from stratagem.testing.laws.state import snapshot as snapshot
from stratagem.testing.laws.sync import check_ranks_in_sync as check_ranks_in_sync
from stratagem.testing.laws.tensor_parallel import SplitOptions as SplitOptions
from stratagem.testing.laws.tensor_parallel import check_tensor_parallel as check_tensor_parallel
from stratagem.testing.laws.tensor_parallel import tensor_parallel_run as tensor_parallel_run
from stratagem.testing.laws.training import check_no_sync as check_no_sync
from stratagem.testing.laws.training import check_purity as check_purity
from stratagem.testing.laws.training import check_step_autocast as check_step_autocast
from stratagem.testing.laws.training import check_wrap as check_wrap

__all__ = [
    "LawViolation",
    "LossOptions",
    "ReferenceOptions",
    "RunOptions",
    "SplitOptions",
    "TrainingOptions",
    "adamw",
    "check_accumulation",
    "check_broadcast",
    "check_checkpoint_resume",
    "check_checkpoint_round_trip",
    "check_checkpoint_strict",
    "check_collective_counts",
    "check_combinator_arithmetic",
    "check_data_parallel_step",
    "check_gather",
    "check_master_weights",
    "check_no_sync",
    "check_pipeline_schedule",
    "check_precision",
    "check_purity",
    "check_ranks_in_sync",
    "check_reduce",
    "check_reduce_idempotent",
    "check_shard_partition",
    "check_single_rank_identities",
    "check_step_autocast",
    "check_tensor_parallel",
    "check_wrap",
    "expected_collectives",
    "first_difference",
    "run_on",
    "sgd",
    "sgd_momentum",
    "snapshot",
    "tensor_parallel_run",
]
