"""`dry_run`: one optimizer step of a user's stack on a simulated world of N ranks, in this process.

The model is built on the meta device and wrapped there, then made of fake
tensors (``FakeTensorMode``): shapes, dtypes and devices without storage, so a
162M-parameter model at 1,024 ranks costs seconds and no memory. The world is
torch's ``fake`` process group (`simulated_world`), which the strategy's own
setup joins. What one rank holds is read from its tensors; its peak, by
category, from torch's ``MemTracker``; its collectives from the dispatcher
(`CollectiveRecorder`). The tracker and the recorder run in separate steps, as
one would see the other's bookkeeping.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from stratagem.env import Env
from stratagem.errors import DryRunError, StratagemError, UsageError
from stratagem.fields import ForwardFn, StrategyLike
from stratagem.planning.collectives import CollectiveRecorder
from stratagem.planning.layout import read_layout
from stratagem.planning.report import DryRun
from stratagem.planning.simulated_world import simulated_world
from stratagem.strategy import not_a_strategy
from stratagem.trees import map_tensors
from stratagem.validators import is_int, require

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker

__all__ = ["OptimizerFactory", "dry_run"]

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer from the wrapped model's parameters."""

# MemTracker's categories, by the names a DryRun gives them.
_CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporary",
    "Other": "other",
}

T = TypeVar("T")


def adamw(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Build the default optimizer of a dry run: AdamW, two states per parameter."""
    return torch.optim.AdamW(parameters, lr=1e-3)


def dry_run(
    strategy: StrategyLike,
    model: Callable[[], torch.nn.Module],
    batch: object,
    *,
    world_size: int,
    forward: ForwardFn | None = None,
    optimizer: OptimizerFactory = adamw,
    micro_batches: int = 1,
    ranks_per_host: int = 8,
) -> DryRun:
    """Simulate one optimizer step of ``strategy`` on ``world_size`` ranks; say what rank 0 needs.

    Runs the strategy's own ``setup``, ``wrap``, ``step``, ``backward`` and
    ``update`` (built-ins and combinators alike) in this process, on a fake
    world and fake tensors: nothing is sent and the model is never allocated.
    Call it before joining a world (a script's ``__main__``, a notebook), not
    inside a launched function.

    Args:
        strategy: the stack to plan, e.g. ``sg.tensor_parallel(sg.fsdp(), plan)``.
        model: builds the model; called under ``torch.device("meta")``, so it
            must not name a device.
        batch: one rank's batch of one micro-batch, real tensors (their shapes
            and dtypes are what count; they are made fake before use).
        world_size: ranks in the simulated world.
        forward: the loss, as ``strategy.step`` takes it.
        optimizer: builds the optimizer from the wrapped parameters (AdamW).
        micro_batches: step/backward/update calls that make one optimizer step
            (``n`` under ``accumulate(strategy, n)``).
        ranks_per_host: ranks on each simulated host (the local world size).

    Returns:
        A `DryRun`: parameters and optimizer state held, peak memory by
        category, and the collectives of one optimizer step.

    Raises:
        UsageError: an argument is malformed, a process group is already
            initialised here, or the model factory made real tensors.
        DryRunError: a field or the model failed on fake tensors (a field
            that reads values: ``.item()``, printing, real I/O).

    Example:
        >>> import torch, stratagem as sg
        >>> plan = sg.dry_run(sg.fsdp(device="cpu"), lambda: torch.nn.Linear(1024, 1024),
        ...                   torch.ones(8, 1024), world_size=64,
        ...                   forward=lambda m, b: m(b).sum())
        >>> plan.parameters  # (1024 * 1024 + 1024) / 64 float32s, rounded up per tensor
        65600
        >>> plan.count("all_gather"), plan.count("reduce_scatter")
        (1, 1)
    """
    # Heavy (fake tensors, FSDP's tools, DTensor): loaded by a dry run, not by `import stratagem`.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    if not isinstance(strategy, StrategyLike):
        raise UsageError(not_a_strategy(strategy, "dry_run"))
    require(callable(model), "dry_run: 'model'", "a function that builds the model", model)
    require(is_int(world_size, 1), "dry_run: 'world_size'", "a positive int", world_size)
    require(is_int(micro_batches, 1), "dry_run: 'micro_batches'", "a positive int", micro_batches)
    require(
        is_int(ranks_per_host, 1), "dry_run: 'ranks_per_host'", "a positive int", ranks_per_host
    )
    require(callable(optimizer), "dry_run: 'optimizer'", "a function of the parameters", optimizer)
    require(forward is None or callable(forward), "dry_run: 'forward'", "a function", forward)
    env = Env(
        rank=0,
        world_size=world_size,
        local_world_size=min(world_size, ranks_per_host),
        master_port=29500,  # never dialled: the simulated world has no store to meet at
    )

    def failed(phase: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except StratagemError:
            raise
        except Exception as error:  # the stack's own failure on fake tensors, reported whole
            raise DryRunError(_failure(strategy, phase, world_size, error)) from error

    with simulated_world(world_size):
        ctx = failed("setup", lambda: strategy.setup(env))
        module = _on_meta(model)
        try:  # on meta: FSDP and tensor parallelism shard there (not on fake tensors)
            wrapped: torch.nn.Module | None = strategy.wrap(module, ctx)
        except Exception:  # a wrap that needs tensors (ddp()); a real error recurs on fake ones
            wrapped, module = None, _on_meta(model)  # built afresh
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            if wrapped is None:
                failed("materialising", lambda: module.to_empty(device=ctx.device))
                wrapped = failed("wrap", lambda: strategy.wrap(module, ctx))
            else:
                failed("materialising", lambda: wrapped.to_empty(device=ctx.device))
            inputs = map_tensors(fake.from_tensor, batch)
            made = optimizer(wrapped.parameters())

            def step(tracker: MemTracker | None = None) -> None:
                for _ in range(micro_batches):
                    if tracker is not None:  # it follows one forward per module at a time
                        tracker.reset_mod_stats()
                    loss = strategy.step(wrapped, inputs, ctx, forward=forward)
                    strategy.backward(loss, wrapped, ctx)
                    strategy.update(made, wrapped, ctx)

            failed("step", step)  # a first step makes the optimizer state and any lazy buffers
            recorder = CollectiveRecorder()
            with recorder.recording():
                failed("step", step)
            tracker = MemTracker()
            tracker.track_external(wrapped, made)
            with tracker:
                failed("step", lambda: step(tracker))
            peak = tracker.get_tracker_snapshot("peak").get(ctx.device, {})
        return DryRun(
            strategy=strategy.name if isinstance(strategy.name, str) else repr(strategy),
            world_size=world_size,
            rank=0,
            micro_batches=micro_batches,
            parameters=sum(_local_bytes(p) for p in wrapped.parameters()),
            optimizer_state=sum(
                _local_bytes(v)
                for state in made.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ),
            peak={name: int(peak.get(key, 0)) for key, name in _CATEGORIES.items()},
            collectives=recorder.counts(),
            layout=read_layout(wrapped, ctx.mesh_names.tp),
        )


def _on_meta(model: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Build the model under ``torch.device("meta")``; refuse one that allocates anyway."""
    with torch.device("meta"):
        module = model()
    require(
        isinstance(module, torch.nn.Module),
        "dry_run: 'model'",
        "a function that returns a torch.nn.Module",
        module,
    )
    real = _real_tensors(module)
    if real:
        raise UsageError(
            f"dry_run: the model factory put {real} on a real device; dry_run builds it "
            "under torch.device('meta') and never allocates it: build it without naming "
            "a device (or a dtype-only .to())."
        )
    return module


def _real_tensors(module: torch.nn.Module) -> str:
    """Name the first tensors of ``module`` that are not on the meta device, or ''."""
    named = [*module.named_parameters(), *module.named_buffers()]
    real = [f"{name} ({t.device})" for name, t in named if not t.is_meta]
    if not real:
        return ""
    more = f" and {len(real) - 2} more" if len(real) > 2 else ""
    return ", ".join(real[:2]) + more


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    held = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return held.numel() * held.element_size()


def _failure(strategy: Any, phase: str, world_size: int, error: Exception) -> str:
    name = getattr(strategy, "name", "strategy")
    return (
        f"dry_run: {name}'s {phase} failed in a simulated world of {world_size} ranks, on fake "
        f"tensors ({type(error).__name__}: {str(error).strip().splitlines()[0][:300]}), "
        f"at {_where(error)}. A dry run runs every field on tensors without storage: code that "
        "reads values (.item(), printing, real I/O) cannot be simulated."
    )


def _where(error: Exception) -> str:
    """Name the last frame before torch's tensor machinery: the code that asked for a value."""
    frames = traceback.extract_tb(error.__traceback__)
    machinery = ("torch/_", "torch/utils/", "torch/overrides")
    asked = [
        f for f in frames if not any(part in f.filename.replace("\\", "/") for part in machinery)
    ]
    frame = (asked or frames)[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"
