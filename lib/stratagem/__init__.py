"""stratagem: PyTorch training strategies as frozen records of plain functions.

The public surface; everything here is re-exported from a private module.
"""

from stratagem.checkpoint import CheckpointError as CheckpointError
from stratagem.checkpoint import unwrap as unwrap
from stratagem.combinators import CollectiveMismatchError as CollectiveMismatchError
from stratagem.combinators import CombinatorError as CombinatorError
from stratagem.combinators import JsonLinesSink as JsonLinesSink
from stratagem.combinators import ListSink as ListSink
from stratagem.combinators import TraceEvent as TraceEvent
from stratagem.combinators import accumulate as accumulate
from stratagem.combinators import checked as checked
from stratagem.combinators import compiled as compiled
from stratagem.combinators import traced as traced
from stratagem.combinators import with_clipping as with_clipping
from stratagem.combinators import with_precision as with_precision
from stratagem.devices import DeviceSpec as DeviceSpec
from stratagem.env import Context as Context
from stratagem.env import Env as Env
from stratagem.env import detect_env as detect_env
from stratagem.errors import EnvError as EnvError
from stratagem.errors import LaunchError as LaunchError
from stratagem.errors import RankError as RankError
from stratagem.errors import StratagemError as StratagemError
from stratagem.errors import StrategyFieldError as StrategyFieldError
from stratagem.errors import UsageError as UsageError
from stratagem.fields import ReduceOp as ReduceOp
from stratagem.launchers import launch as launch
from stratagem.sharding import ShardedLoader as ShardedLoader
from stratagem.sharding import ShardSampler as ShardSampler
from stratagem.spawn import Spawn as Spawn
from stratagem.strategies.allreduce import allreduce_grads as allreduce_grads
from stratagem.strategies.allreduce import allreduce_grads_spawn as allreduce_grads_spawn
from stratagem.strategies.allreduce import broadcast_optimizer_state as broadcast_optimizer_state
from stratagem.strategies.ddp import ddp as ddp
from stratagem.strategies.ddp import ddp_spawn as ddp_spawn
from stratagem.strategies.dp import dp as dp
from stratagem.strategies.fsdp import above_parameters as above_parameters
from stratagem.strategies.fsdp import clip_grad_norm as clip_grad_norm
from stratagem.strategies.fsdp import every_module_of as every_module_of
from stratagem.strategies.fsdp import fsdp as fsdp
from stratagem.strategies.fsdp import fsdp_spawn as fsdp_spawn
from stratagem.strategies.single import single_device as single_device
from stratagem.strategy import Strategy as Strategy
from stratagem.strategy import StrategyLike as StrategyLike
from stratagem.training import move_to_device as move_to_device

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CollectiveMismatchError",
    "CombinatorError",
    "Context",
    "DeviceSpec",
    "Env",
    "EnvError",
    "JsonLinesSink",
    "LaunchError",
    "ListSink",
    "RankError",
    "ReduceOp",
    "ShardSampler",
    "ShardedLoader",
    "Spawn",
    "StratagemError",
    "Strategy",
    "StrategyFieldError",
    "StrategyLike",
    "TraceEvent",
    "UsageError",
    "above_parameters",
    "accumulate",
    "allreduce_grads",
    "allreduce_grads_spawn",
    "broadcast_optimizer_state",
    "checked",
    "clip_grad_norm",
    "compiled",
    "ddp",
    "ddp_spawn",
    "detect_env",
    "dp",
    "every_module_of",
    "fsdp",
    "fsdp_spawn",
    "launch",
    "move_to_device",
    "single_device",
    "traced",
    "unwrap",
    "with_clipping",
    "with_precision",
]
