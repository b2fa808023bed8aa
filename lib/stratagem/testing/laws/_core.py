"""What every law shares: the violation error, running on a world, comparing tensors."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from stratagem.checkpoint import unwrap
from stratagem.strategy import StrategyLike
from stratagem.testing.world import World
from stratagem.trees import map_tensors

__all__ = [
    "LawViolation",
    "full_parameters",
    "holds_part",
    "keyed_parameters",
    "max_difference",
    "on_device",
    "on_host",
    "own_share",
    "run_on",
    "same",
    "share",
    "summarize",
    "within",
]


class LawViolation(AssertionError):
    """A strategy broke a law.

    Attributes:
        law: the law's name, e.g. ``"reduce-arithmetic"``.
        strategy: the strategy's name.
        inputs: a short description of the input that broke it.
        difference: what was found, against what the law promises.
    """

    def __init__(
        self, law: str, strategy: StrategyLike | str, inputs: str, difference: str
    ) -> None:
        self.law = law
        named = isinstance(strategy, str)  # a law on something other than a strategy names it
        self.strategy = strategy if named else getattr(strategy, "name", type(strategy).__name__)
        self.inputs = inputs
        self.difference = difference
        super().__init__(
            f"law {law!r} broken by strategy {self.strategy!r}\n"
            f"  input: {inputs}\n"
            f"  found: {difference}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (self.law, self.strategy, self.inputs, self.difference))


def _rebuild(law: str, strategy: str, inputs: str, difference: str) -> LawViolation:
    error = LawViolation.__new__(LawViolation)
    error.law, error.strategy, error.inputs, error.difference = law, strategy, inputs, difference
    AssertionError.__init__(
        error,
        f"law {law!r} broken by strategy {strategy!r}\n  input: {inputs}\n  found: {difference}",
    )
    return error


def summarize(value: Any) -> str:
    """Describe an input briefly: tensors by shape and dtype, modules by class and size."""
    if isinstance(value, torch.Tensor):
        shown = f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}"
        if value.numel() <= 6:
            shown += f", values={value.tolist()}"
        return shown + ")"
    if isinstance(value, torch.nn.Module):
        count = sum(p.numel() for p in value.parameters())
        return f"{type(value).__name__}({count} parameters)"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(summarize(v) for v in value) + "]"
    return repr(value)


def on_host(tree: Any) -> Any:
    """Return ``tree`` with every tensor detached and on the CPU: what the laws compare.

    A strategy that trains on a GPU returns its results there; the laws compare
    them with values made on the CPU, so every comparison happens on the CPU.
    """
    return map_tensors(lambda t: t.detach().cpu(), tree)


def on_device(tree: Any, ctx: Any) -> Any:
    """Return ``tree`` with every tensor on ``ctx.device``: the kit's data follows the strategy."""
    return map_tensors(lambda t: t.to(ctx.device), tree)


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute elementwise difference (infinite when shapes differ), on the CPU."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values in the same shape and dtype, wherever each lives."""
    return a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu())


def within(ours: torch.Tensor, theirs: torch.Tensor, *, rtol: float, atol: float) -> bool:
    """Whether ``|ours - theirs| <= atol + rtol * |theirs|`` everywhere, compared on the CPU."""
    if ours.shape != theirs.shape:
        return False
    a, b = ours.detach().cpu().double(), theirs.detach().cpu().double()
    return bool(torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all())


def full_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter of the plain module, gathered whole when sharded (FSDP's DTensors)."""
    out = []
    for parameter in unwrap(module).parameters():
        data = parameter.detach()
        gather = getattr(data, "full_tensor", None)
        out.append((gather() if callable(gather) else data).cpu().clone())
    return out


def run_on(
    world: World | None,
    world_size: int,
    fn: Callable[..., Any],
    strategy: StrategyLike,
    *args: Any,
) -> list[Any]:
    """Run ``fn`` on ``world`` (or a `World` of ``world_size`` started for this call).

    Each rank moves its result's tensors to the CPU before sending them, so a
    law compares on the CPU whatever device the strategy trains on, and the
    parent process never touches a GPU.
    """
    hosted = _OnHost(fn)
    if world is not None:
        return world.run(hosted, strategy, *args)
    with World(world_size) as fresh:
        return fresh.run(hosted, strategy, *args)


@attrs.frozen
class _OnHost:
    """``fn`` with its result's tensors moved to the CPU (an attrs callable: it pickles)."""

    fn: Callable[..., Any]

    def __call__(self, *args: Any) -> Any:
        return on_host(self.fn(*args))


def fresh_copy(module: torch.nn.Module) -> torch.nn.Module:
    """Return an independent copy, so a law never trains the caller's module."""
    return copy.deepcopy(module)


def squares_mean(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Compute the laws' loss: the mean of squared outputs (a mean over samples)."""
    loss: torch.Tensor = module(batch).float().pow(2).mean()
    return loss


def first_mismatch(
    ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor], tolerance: float
) -> tuple[int, float] | None:
    """Index and size of the first pair further apart than ``tolerance``, or None."""
    if len(ours) != len(theirs):
        return -1, float("inf")
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        difference = max_difference(a, b)
        if not difference <= tolerance:
            return index, difference
    return None


def own_share(batch: Any, ctx: Any) -> Any:
    """Return this rank's part of ``batch`` (every tensor in it, on ``ctx.device``).

    The part is ``ctx.data_parallel``'s; the kit's data follows the strategy's device.

    The ranks of a tensor-parallel group hold parts of one model and take the same part.
    """
    index, size = ctx.data_parallel
    return map_tensors(lambda t: t.chunk(size)[index].to(ctx.device), batch)


def share(batch: Any, parts: int, index: int) -> Any:
    """Return part ``index`` of ``parts`` equal contiguous parts of every tensor in ``batch``."""
    return map_tensors(lambda t: t.chunk(parts)[index], batch)


def holds_part(ctx: Any) -> bool:
    """Whether this rank holds only part of the module's keys: a stage of a pipeline.

    A pipeline's ``wrap`` keeps this rank's stages, under the unsplit module's
    names; the laws then compare the keys it holds, and check that the ranks
    of one pipeline together hold every key once.
    """
    mesh = getattr(ctx, "mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    pp = ctx.mesh_names.pp if mesh is not None else "pp"
    return mesh is not None and pp in names and mesh[pp].size() > 1


def keyed_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the plain module by name, gathered whole when sharded, on the CPU."""
    out = {}
    for name, parameter in unwrap(module).named_parameters():
        data = parameter.detach()
        gather = getattr(data, "full_tensor", None)
        out[name] = (gather() if callable(gather) else data).cpu().clone()
    return out


def shares(batch: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Split a batch into ``world_size`` equal contiguous parts along the first dimension."""
    return list(batch.chunk(world_size))
