"""stratagem: PyTorch training strategies as frozen records of plain functions.

The public surface; everything here is re-exported from a private module.

The re-exports are lazy (PEP 562): ``import stratagem`` loads no submodule,
and the first use of a name loads the module that defines it. A training
script pays for what it uses, and ``python -m stratagem --help`` or a rank that
only needs ``launch`` start fast. Type checkers read the imports below.
"""

from __future__ import annotations as _annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from stratagem.checkpoint.entries import per_rank as per_rank
    from stratagem.checkpoint.entries import unwrap as unwrap
    from stratagem.checkpoint.resuming import resume_or_start as resume_or_start
    from stratagem.combinators.accumulation import accumulate as accumulate
    from stratagem.combinators.checked import checked as checked
    from stratagem.combinators.checkpointing import (
        with_activation_checkpointing as with_activation_checkpointing,
    )
    from stratagem.combinators.clipping import with_clipping as with_clipping
    from stratagem.combinators.compiled import compiled as compiled
    from stratagem.combinators.context_parallel import context_parallel as context_parallel
    from stratagem.combinators.expert_parallel import expert_parallel as expert_parallel
    from stratagem.combinators.float8 import float8_linears as float8_linears
    from stratagem.combinators.float8 import with_float8 as with_float8
    from stratagem.combinators.precision import with_precision as with_precision
    from stratagem.combinators.tensor_parallel import tensor_parallel as tensor_parallel
    from stratagem.combinators.tracing import ChromeTraceSink as ChromeTraceSink
    from stratagem.combinators.tracing import JsonLinesSink as JsonLinesSink
    from stratagem.combinators.tracing import ListSink as ListSink
    from stratagem.combinators.tracing import TraceEvent as TraceEvent
    from stratagem.combinators.tracing import chrome_trace as chrome_trace
    from stratagem.combinators.tracing import traced as traced
    from stratagem.devices import DeviceFallbackWarning as DeviceFallbackWarning
    from stratagem.devices import DeviceSpec as DeviceSpec
    from stratagem.env import Context as Context
    from stratagem.env import Env as Env
    from stratagem.env import MeshNames as MeshNames
    from stratagem.env import detect_env as detect_env
    from stratagem.errors import CheckpointError as CheckpointError
    from stratagem.errors import CollectiveCallError as CollectiveCallError
    from stratagem.errors import CollectiveMismatchError as CollectiveMismatchError
    from stratagem.errors import CombinatorError as CombinatorError
    from stratagem.errors import DryRunError as DryRunError
    from stratagem.errors import EnvError as EnvError
    from stratagem.errors import LaunchError as LaunchError
    from stratagem.errors import Preempted as Preempted
    from stratagem.errors import RankError as RankError
    from stratagem.errors import StratagemError as StratagemError
    from stratagem.errors import StrategyFieldError as StrategyFieldError
    from stratagem.errors import UsageError as UsageError
    from stratagem.fields import ReduceOp as ReduceOp
    from stratagem.launching import Spawn as Spawn
    from stratagem.launching import launch as launch
    from stratagem.launching import spawned as spawned
    from stratagem.planning.collectives import CollectiveCount as CollectiveCount
    from stratagem.planning.dry_run import dry_run as dry_run
    from stratagem.planning.report import DryRun as DryRun
    from stratagem.preemption import on_preemption as on_preemption
    from stratagem.ray_launching import RayLaunch as RayLaunch
    from stratagem.ray_launching import ray_launcher as ray_launcher
    from stratagem.replicas import broadcast_optimizer_state as broadcast_optimizer_state
    from stratagem.script import joined as joined
    from stratagem.seeding import seed_everything as seed_everything
    from stratagem.sharding import ShardedLoader as ShardedLoader
    from stratagem.sharding import ShardSampler as ShardSampler
    from stratagem.sharding import StreamStride as StreamStride
    from stratagem.strategies.allreduce import allreduce_grads as allreduce_grads
    from stratagem.strategies.allreduce import allreduce_grads_spawn as allreduce_grads_spawn
    from stratagem.strategies.ddp import ddp as ddp
    from stratagem.strategies.ddp import ddp_spawn as ddp_spawn
    from stratagem.strategies.dp import dp as dp
    from stratagem.strategies.fsdp import fsdp as fsdp
    from stratagem.strategies.fsdp import fsdp_spawn as fsdp_spawn
    from stratagem.strategies.fsdp import hsdp as hsdp
    from stratagem.strategies.fsdp_groups import ShardGroup as ShardGroup
    from stratagem.strategies.fsdp_groups import shard_group as shard_group
    from stratagem.strategies.fsdp_units import above_parameters as above_parameters
    from stratagem.strategies.fsdp_units import every_module_of as every_module_of
    from stratagem.strategies.pipeline import pipeline as pipeline
    from stratagem.strategies.single import single_device as single_device
    from stratagem.strategy import Strategy as Strategy
    from stratagem.strategy import StrategyLike as StrategyLike
    from stratagem.throughput import Rates as Rates
    from stratagem.throughput import peak_flops as peak_flops
    from stratagem.throughput import rates as rates
    from stratagem.throughput import step_flops as step_flops
    from stratagem.training import clip_grad_norm as clip_grad_norm
    from stratagem.training import move_to_device as move_to_device

__version__ = "0.1.0"

# Where each public name lives, by module; the TYPE_CHECKING imports above must agree
# (tests/test_structure.py checks).
_NAMES_BY_MODULE: dict[str, tuple[str, ...]] = {
    "stratagem.checkpoint.entries": ("per_rank", "unwrap"),
    "stratagem.checkpoint.resuming": ("resume_or_start",),
    "stratagem.combinators.accumulation": ("accumulate",),
    "stratagem.combinators.checked": ("checked",),
    "stratagem.combinators.checkpointing": ("with_activation_checkpointing",),
    "stratagem.combinators.clipping": ("with_clipping",),
    "stratagem.combinators.compiled": ("compiled",),
    "stratagem.combinators.context_parallel": ("context_parallel",),
    "stratagem.combinators.expert_parallel": ("expert_parallel",),
    "stratagem.combinators.float8": ("float8_linears", "with_float8"),
    "stratagem.combinators.precision": ("with_precision",),
    "stratagem.combinators.tensor_parallel": ("tensor_parallel",),
    "stratagem.combinators.tracing": (
        "chrome_trace",
        "ChromeTraceSink",
        "JsonLinesSink",
        "ListSink",
        "traced",
        "TraceEvent",
    ),
    "stratagem.devices": ("DeviceFallbackWarning", "DeviceSpec"),
    "stratagem.env": ("Context", "detect_env", "Env", "MeshNames"),
    "stratagem.errors": (
        "CheckpointError",
        "CollectiveCallError",
        "CollectiveMismatchError",
        "CombinatorError",
        "DryRunError",
        "EnvError",
        "LaunchError",
        "Preempted",
        "RankError",
        "StratagemError",
        "StrategyFieldError",
        "UsageError",
    ),
    "stratagem.fields": ("ReduceOp",),
    "stratagem.launching": ("launch", "Spawn", "spawned"),
    "stratagem.planning.collectives": ("CollectiveCount",),
    "stratagem.planning.dry_run": ("dry_run",),
    "stratagem.planning.report": ("DryRun",),
    "stratagem.preemption": ("on_preemption",),
    "stratagem.ray_launching": ("ray_launcher", "RayLaunch"),
    "stratagem.replicas": ("broadcast_optimizer_state",),
    "stratagem.script": ("joined",),
    "stratagem.seeding": ("seed_everything",),
    "stratagem.sharding": ("ShardedLoader", "ShardSampler", "StreamStride"),
    "stratagem.strategies.allreduce": ("allreduce_grads", "allreduce_grads_spawn"),
    "stratagem.strategies.ddp": ("ddp", "ddp_spawn"),
    "stratagem.strategies.dp": ("dp",),
    "stratagem.strategies.fsdp": ("fsdp", "fsdp_spawn", "hsdp"),
    "stratagem.strategies.fsdp_groups": ("shard_group", "ShardGroup"),
    "stratagem.strategies.fsdp_units": ("above_parameters", "every_module_of"),
    "stratagem.strategies.pipeline": ("pipeline",),
    "stratagem.strategies.single": ("single_device",),
    "stratagem.strategy": ("Strategy", "StrategyLike"),
    "stratagem.throughput": ("peak_flops", "Rates", "rates", "step_flops"),
    "stratagem.training": ("clip_grad_norm", "move_to_device"),
}
_WHERE = {name: module for module, names in _NAMES_BY_MODULE.items() for name in names}

__all__ = sorted(_WHERE)  # each name is written twice: in _NAMES_BY_MODULE and the imports


# Subpackages a script reaches as attributes (``sg.checkpoint.latest(...)``): with
# eager imports they were loaded as a side effect; lazily, they load on first use.
_SUBPACKAGES = frozenset({"checkpoint", "combinators", "strategies", "testing"})


def __getattr__(name: str) -> _typing.Any:
    module = _WHERE.get(name)
    if module is not None:
        value = getattr(_importlib.import_module(module), name)
    elif name in _SUBPACKAGES:
        value = _importlib.import_module(f"stratagem.{name}")
    else:
        raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
