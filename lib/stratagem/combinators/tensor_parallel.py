"""``tensor_parallel``: split layers over a ``"tp"`` mesh dimension, under a sharding strategy.

``tensor_parallel(fsdp(), plan, size=2)`` is FSDP x TP: the mesh gains a last
dimension ``"tp"`` of ``size`` consecutive ranks, ``wrap`` applies the plan with
``parallelize_module`` on it and then shards over the data-parallel dimensions
only, and every rank of a tensor-parallel group takes the same batches
(``shard`` deals by `Context.data_parallel`). It substitutes ``setup``'s mesh
and ``wrap``: it goes on ``fsdp()``, on either side of the other combinators
(the plan splits the layers before FSDP shards them in either order).
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from stratagem.combinators._base import check_strategy, mesh_under, with_mesh
from stratagem.env import Context
from stratagem.errors import UsageError, describe, with_submodules
from stratagem.fields import WrapFn
from stratagem.meshes import mesh_with
from stratagem.replicas import copy_rank0
from stratagem.strategy import Strategy
from stratagem.validators import is_int, require

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Plan", "TensorParallelWrap", "tensor_parallel"]

Plan = Mapping[str, Any] | Callable[[torch.nn.Module, Any], torch.nn.Module]
"""Module paths (``fnmatch`` patterns, as ``parallelize_module`` takes) to ``ParallelStyle``
objects (``ColwiseParallel()``, ``RowwiseParallel()``, ``SequenceParallel()``), or a
function ``(module, tp_mesh) -> module`` that parallelises the module itself."""

NOT_ON_A_MESH = (
    "tensor_parallel: {name!r} does not build a device mesh (its setup is {setup}); tensor "
    "parallelism adds a 'tp' dimension to the mesh of fsdp()'s setup (JoinMesh), whose wrap "
    "(or a wrap of your own, sharding over ctx.data_mesh) shards each tensor-parallel part "
    "over the data-parallel ranks: tensor_parallel(sg.fsdp(), plan, size=2)."
)


def _check_plan(plan: object) -> Plan:
    if callable(plan) and not isinstance(plan, Mapping):
        return plan
    from torch.distributed.tensor.parallel import ParallelStyle

    require(
        isinstance(plan, Mapping) and bool(plan),
        "tensor_parallel: 'plan'",
        "a non-empty mapping of module paths to ParallelStyle objects, or a function "
        "(module, tp_mesh) -> module",
        plan,
    )
    assert isinstance(plan, Mapping)
    for path, style in plan.items():
        require(isinstance(path, str), "tensor_parallel: a key of 'plan'", "a module path", path)
        if not isinstance(style, ParallelStyle):
            raise UsageError(
                f"tensor_parallel: plan[{path!r}] must be a ParallelStyle such as "
                f"ColwiseParallel() or RowwiseParallel() (got {describe(style)})."
            )
    return plan


def _check_paths(plan: Mapping[str, Any], module: torch.nn.Module) -> None:
    names = [name for name, _ in module.named_modules() if name]
    missing = [p for p in plan if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if missing:
        raise UsageError(
            f"wrap: the tensor-parallel plan names {missing}, which match no submodule of "
            f"{with_submodules(module)}; use their paths, as model.named_modules() gives them."
        )


@attrs.frozen
class TensorParallelWrap:
    """Wrap field: copy rank 0's module to every rank, apply the plan on ``"tp"``, then ``inner``.

    ``"tp"`` is the role: the dimension is the one ``ctx.mesh_names.tp`` names.

    The copy comes first so that every tensor-parallel group splits the same
    weights (``parallelize_module`` splits each rank's own copy).
    """

    inner: WrapFn
    plan: Plan
    async_tp: bool = False
    in_reference: ClassVar[bool] = False  # it distributes: the reference trains the whole module

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        require(isinstance(module, torch.nn.Module), "wrap: 'module'", "a torch.nn.Module", module)
        mesh, names = mesh_with(ctx, "tp", "wrap", "tensor_parallel")
        tp = mesh[names.tp]
        if self.async_tp:
            _enable_async_tp(ctx, tp)
        copy_rank0(module, ctx)
        if isinstance(self.plan, Mapping):
            _check_paths(self.plan, module)
            # Copies: parallelize_module writes into the styles it is given (src_data_rank).
            styles = {path: copy.deepcopy(style) for path, style in self.plan.items()}
            module = parallelize_module(module, tp, styles)
        else:
            module = self.plan(module, tp)
            require(
                isinstance(module, torch.nn.Module),
                "wrap: the tensor-parallel plan function",
                "to return the module",
                module,
            )
        return self.inner(module, ctx)


def _enable_async_tp(ctx: Context, tp_mesh: DeviceMesh) -> None:
    """Let inductor fuse each all-gather or reduce-scatter of ``"tp"`` with its matmul.

    Symmetric memory for the group, and inductor's micro-pipeline pass (a
    process-wide setting, as torchtitan sets it); it takes effect in code that
    ``torch.compile`` compiles, so the strategy must be `compiled` too.

    Raises:
        UsageError: the ranks do not train on CUDA, where symmetric memory lives.
    """
    if ctx.device.type != "cuda":
        raise UsageError(
            f"wrap: tensor_parallel(async_tp=True) overlaps the 'tp' collectives with the "
            f"matmuls through CUDA symmetric memory, but this rank trains on {ctx.device}; "
            "drop async_tp, or train on CUDA devices with NCCL."
        )
    import torch._inductor.config as inductor
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor._micro_pipeline_tp = True  # noqa: SLF001
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def tensor_parallel(
    strategy: Strategy, plan: Plan, *, size: int = 2, async_tp: bool = False
) -> Strategy:
    """Split the layers ``plan`` names over ``size`` ranks; shard the rest of the world as before.

    Fields touched: ``setup`` (the mesh gains a last dimension ``"tp"`` of
    ``size`` consecutive ranks; ``ctx.data_parallel`` is then the world over
    it) and ``wrap`` (`TensorParallelWrap` before ``fsdp``'s own, which shards
    over the data-parallel dimensions). ``shard`` already deals batches by
    ``ctx.data_parallel``, so the ranks of a tensor-parallel group train on
    the same batches. Gradients of the split layers are reduced by the
    DTensor operations themselves.

    Any ``wrap`` composes that shards over ``ctx.data_mesh`` (``fsdp()``'s own,
    or one of yours: modules grouped, resharding per group).

    Args:
        strategy: an ``fsdp()`` strategy (any ``shard_size``: HSDP x TP on a 3-D
            mesh), its ``wrap`` possibly substituted.
        plan: module paths to ``ParallelStyle`` objects, or a function
            ``(module, tp_mesh) -> module``.
        size: ranks per tensor-parallel group; must divide the world.
        async_tp: overlap each ``"tp"`` all-gather and reduce-scatter with its
            matmul (torch's micro-pipelined TP over CUDA symmetric memory);
            CUDA and `compiled` only, so the wrap refuses it on other devices.

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, ``plan`` or ``size`` is malformed.
        CombinatorError: ``strategy``'s setup builds no mesh (no ``fsdp()``
            ``JoinMesh`` under its layers), or it is already tensor parallel.
    """
    check_strategy(strategy, "tensor_parallel")
    checked_plan = _check_plan(plan)
    require(is_int(size, 2), "tensor_parallel: 'size'", "an int of at least 2", size)
    require(isinstance(async_tp, bool), "tensor_parallel: 'async_tp'", "a bool", async_tp)
    under = mesh_under(strategy, "tensor_parallel", TensorParallelWrap, NOT_ON_A_MESH)
    # Over other layers it is the outermost wrap, so the plan splits the layers before their
    # wraps run; under them it runs after theirs, which keep the paths the plan names (a cast,
    # composable checkpointing). FSDP's sharding comes last in either order.
    wrap = TensorParallelWrap(strategy.wrap, checked_plan, async_tp)
    return with_mesh(strategy, under, f"tp{size}", {"tensor_parallel": size}, wrap=wrap)
