"""Device meshes of a joined world: the shape a shard size asks for, the setup that adds one.

``fsdp()`` shards over a 1-D mesh of every rank, or over a 2-D ``(replicate,
shard)`` mesh for hybrid sharding. ``torch.distributed.device_mesh`` is
imported where it is used, never by ``import stratagem``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

from stratagem.env import Context, Env, MeshNames, check_context, check_env, mesh_names
from stratagem.errors import UsageError
from stratagem.fields import SetupFn
from stratagem.process_group import JoinProcessGroup
from stratagem.validators import field, is_int, positive_int, require

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "JoinMesh",
    "ShardSize",
    "device_mesh",
    "flattened_data_mesh",
    "mesh_dims",
    "mesh_shape",
    "mesh_with",
]

DEFAULT_NAMES = MeshNames()

ShardSize = int | Literal["world", "node"]
"""Ranks per shard group: ``"world"`` (all), ``"node"`` (the ranks of a node), or a number."""


def _is_shard_size(value: object) -> bool:
    return value in ("world", "node") if isinstance(value, str) else is_int(value, 1)


_SHARD_SIZES = "'world', 'node' or a positive int"
_SHARD_SIZE = field(_is_shard_size, "'{name}'", _SHARD_SIZES)


def mesh_dims(
    env: Env,
    shard_size: ShardSize = "world",
    tensor_parallel: int = 1,
    replicate: int | None = None,
    names: MeshNames = DEFAULT_NAMES,
    context_parallel: int = 1,
    expert_parallel: int = 1,
) -> tuple[tuple[str, int], ...]:
    """Return the named dimensions of the mesh: data-parallel ones, ``("cp", n)``, ``("tp", n)``.

    The dimensions are called as ``names`` says (`MeshNames`, by role).

    The tensor-parallel groups are ``tensor_parallel`` consecutive ranks (the
    fastest links), the context-parallel groups the ``context_parallel``
    next-fastest (torchtitan's order); the world over them is the
    data-parallel world, which ``shard_size`` splits as for ``fsdp()``;
    ``replicate``, if given, is the number of shard groups this must give
    (`hsdp`'s check of its arguments). ``expert_parallel`` splits each shard
    group into ``("shard", n / ep)`` and ``("ep", ep)``: expert-parallel ranks
    are data-parallel ranks (torchtitan borrows them from ``dp_shard``).

    Raises:
        UsageError: the groups do not divide the world evenly, or experts are
            split beside hybrid sharding or context parallelism (not built).

    Example:
        >>> mesh_dims(Env(world_size=8, local_world_size=8), 2, tensor_parallel=2)
        (('replicate', 2), ('shard', 2), ('tp', 2))
    """
    require(_is_shard_size(shard_size), "'shard_size'", _SHARD_SIZES, shard_size)
    require(is_int(tensor_parallel, 1), "'tensor_parallel'", "a positive int", tensor_parallel)
    require(is_int(context_parallel, 1), "'context_parallel'", "a positive int", context_parallel)
    require(is_int(expert_parallel, 1), "'expert_parallel'", "a positive int", expert_parallel)
    world = data = env.world_size
    for what, size in (("tensor", tensor_parallel), ("context", context_parallel)):
        if data % size:
            leaves = f"the {data} ranks that tensor_parallel={tensor_parallel} leaves"
            where = f"the world of {data} ranks" if data == world else leaves
            raise UsageError(
                f"{what}_parallel: size={size} does not divide {where} into equal "
                f"{what}-parallel groups; use one of "
                f"{[d for d in range(1, data + 1) if data % d == 0]}."
            )
        data //= size
    model = tensor_parallel * context_parallel
    by_name = {"world": data, "node": max(1, env.local_world_size // model)}
    size = shard_size if isinstance(shard_size, int) else by_name[shard_size]
    if data % size:
        divisors = [d for d in range(1, data + 1) if data % d == 0]
        what = f"{size} ranks per node" if shard_size == "node" else f"{size} ranks"
        over = f"{world} ranks" if model == 1 else f"{data} data-parallel ranks"
        raise UsageError(
            f"fsdp: shard_size={shard_size!r} ({what}) does not divide the world of {over} "
            f"into equal shard groups; use one of {divisors}, or shard_size='world'."
        )
    if replicate is not None and replicate * size != data:
        raise UsageError(
            f"hsdp: replicate={replicate} x shard={size} is {replicate * size} ranks, but the "
            f"world has {data} data-parallel ranks; choose sizes whose product is {data}."
        )
    replicated = ((names.replicate, data // size),) if size < data else ()
    dims = (*replicated, (names.shard, size))
    if expert_parallel > 1:
        dims = _split_experts(dims, expert_parallel, context_parallel, names)
    parallel = ((names.cp, context_parallel), (names.tp, tensor_parallel))
    return dims + tuple((name, size) for name, size in parallel if size > 1)


def _split_experts(
    dims: tuple[tuple[str, int], ...], ep: int, cp: int, names: MeshNames
) -> tuple[tuple[str, int], ...]:
    """Split the shard dimension of ``dims`` into ``shard`` and ``ep`` (consecutive ranks)."""
    (*replicated, (shard, size)) = dims
    if replicated or cp > 1:
        beside = "hybrid sharding (hsdp)" if replicated else "context_parallel"
        raise UsageError(
            f"expert_parallel: experts split beside {beside} are not built yet; use "
            "expert_parallel(sg.fsdp(), experts=...)."
        )
    if size % ep:
        raise UsageError(
            f"expert_parallel: size={ep} does not divide the shard group of {size} ranks "
            f"into equal expert-parallel groups; use one of "
            f"{[d for d in range(2, size + 1) if size % d == 0]}."
        )
    return ((shard, size // ep), (names.ep, ep))


def mesh_shape(env: Env, shard_size: ShardSize = "world") -> tuple[int, ...]:
    """Return the mesh shape for ``shard_size``: ``(world,)``, or ``(replicas, shard_size)``.

    Raises:
        UsageError: the shard groups do not divide the world evenly.

    Example:
        >>> mesh_shape(Env(world_size=8, local_world_size=4), "node")
        (2, 4)
    """
    return tuple(size for _, size in mesh_dims(env, shard_size))


def device_mesh(
    ctx: Context,
    shard_size: ShardSize = "world",
    tensor_parallel: int = 1,
    names: MeshNames = DEFAULT_NAMES,
    context_parallel: int = 1,
    expert_parallel: int = 1,
) -> DeviceMesh:
    """Build the device mesh of a joined world from its `mesh_dims`.

    Raises:
        UsageError: the groups do not divide the world (see `mesh_dims`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    dims = mesh_dims(
        ctx.env, shard_size, tensor_parallel, None, names, context_parallel, expert_parallel
    )
    dim_names, shape = zip(*dims, strict=True)
    return init_device_mesh(ctx.device.type, shape, mesh_dim_names=dim_names)


def flattened_data_mesh(mesh: DeviceMesh, names: MeshNames, beside: str) -> DeviceMesh:
    """Return the mesh FSDP shards over: ``shard`` and ``beside`` (``cp`` or ``ep``) as one.

    ``(replicate, shard_<beside>)`` for hybrid sharding, else
    ``(shard_<beside>,)``: the gradients of a sequence's ranks (``cp``), or of
    ranks whose experts differ (``ep``), average with the shard group's.
    """
    # torch has no public flatten yet; torchtitan flattens its dp_shard_cp the same way.
    dims, flat = mesh.mesh_dim_names or (), f"{names.shard}_{beside}"
    if names.replicate not in dims:
        return mesh[(names.shard, beside)]._flatten(flat)  # noqa: SLF001
    replicas = mesh.size(dims.index(names.replicate))
    every = mesh[(names.replicate, names.shard, beside)]._flatten()  # noqa: SLF001
    return every._unflatten(  # noqa: SLF001
        0, (replicas, every.size() // replicas), (names.replicate, flat)
    )


def mesh_with(
    ctx: Context, role: Literal["tp", "cp", "ep", "pp"], field: str, strategy: str
) -> tuple[DeviceMesh, MeshNames]:
    """Return ``ctx``'s mesh and its `MeshNames`, refusing a mesh without ``role``'s dimension.

    Raises:
        UsageError: ``ctx`` is not a `Context`, or has no such mesh: it is not
            what ``strategy``'s setup returned (``field`` names the field that needs it).
    """
    names = check_context(ctx, field).mesh_names
    dim: str = getattr(names, role)
    mesh: DeviceMesh | None = ctx.mesh
    if mesh is None or dim not in (mesh.mesh_dim_names or ()):
        raise UsageError(
            f"{field}: ctx has no mesh with a {dim!r} dimension; pass the Context that the "
            f"{strategy} strategy's setup returned."
        )
    return mesh, names


@attrs.frozen(kw_only=True)
class JoinMesh:
    """Setup field: run ``join`` (join the process group), then add ``ctx.extras["mesh"]``.

    The mesh's dimensions are `mesh_dims` of ``shard_size``,
    ``context_parallel`` and ``tensor_parallel``, checked against the world
    before joining, and called as ``names`` says (``ctx.extras["mesh_names"]``,
    read as ``ctx.mesh_names``).
    """

    join: SetupFn = attrs.field(factory=JoinProcessGroup)
    shard_size: ShardSize = attrs.field(default="world", validator=_SHARD_SIZE)
    tensor_parallel: int = attrs.field(default=1, validator=positive_int("JoinMesh({name}=...)"))
    replicate: int | None = attrs.field(
        default=None, validator=positive_int("hsdp({name}=...)", optional="None")
    )
    context_parallel: int = attrs.field(default=1, validator=positive_int("JoinMesh({name}=...)"))
    expert_parallel: int = attrs.field(default=1, validator=positive_int("JoinMesh({name}=...)"))

    names: MeshNames = attrs.field(default=DEFAULT_NAMES, converter=mesh_names)

    def __call__(self, env: Env) -> Context:
        check_env(env, "setup")
        # before joining:
        cp, ep, names = self.context_parallel, self.expert_parallel, self.names
        mesh_dims(env, self.shard_size, self.tensor_parallel, self.replicate, names, cp, ep)
        ctx = self.join(env)
        mesh = device_mesh(ctx, self.shard_size, self.tensor_parallel, names, cp, ep)
        if cp == 1 and ep == 1:
            return ctx.with_extras(mesh=mesh, mesh_names=names)
        data_mesh = flattened_data_mesh(mesh, names, names.ep if ep > 1 else names.cp)
        return ctx.with_extras(mesh=mesh, mesh_names=names, data_mesh=data_mesh)
