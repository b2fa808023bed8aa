"""Device meshes of a joined world: the shape a shard size asks for, the setup that adds one.

``fsdp()`` shards over a 1-D mesh of every rank, or over a 2-D ``(replicate,
shard)`` mesh for hybrid sharding. ``torch.distributed.device_mesh`` is
imported where it is used, never by ``import stratagem``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

from stratagem.env import Context, Env, check_env
from stratagem.errors import UsageError
from stratagem.fields import SetupFn
from stratagem.process_group import JoinProcessGroup
from stratagem.validators import field, is_int, require

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["JoinMesh", "ShardSize", "device_mesh", "mesh_shape"]

ShardSize = int | Literal["world", "node"]
"""Ranks per shard group: ``"world"`` (all), ``"node"`` (the ranks of a node), or a number."""


def _is_shard_size(value: object) -> bool:
    return value in ("world", "node") if isinstance(value, str) else is_int(value, 1)


_SHARD_SIZES = "'world', 'node' or a positive int"
_SHARD_SIZE = field(_is_shard_size, "'{name}'", _SHARD_SIZES)


def mesh_shape(env: Env, shard_size: ShardSize = "world") -> tuple[int, ...]:
    """Return the mesh shape for ``shard_size``: ``(world,)``, or ``(replicas, shard_size)``.

    Raises:
        UsageError: the shard groups do not divide the world evenly.

    Example:
        >>> mesh_shape(Env(world_size=8, local_world_size=4), "node")
        (2, 4)
    """
    require(_is_shard_size(shard_size), "'shard_size'", _SHARD_SIZES, shard_size)
    world = env.world_size
    by_name = {"world": world, "node": env.local_world_size}
    size = shard_size if isinstance(shard_size, int) else by_name[shard_size]
    if world % size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        what = f"{size} ranks per node" if shard_size == "node" else f"{size} ranks"
        raise UsageError(
            f"fsdp: shard_size={shard_size!r} ({what}) does not divide the world of {world} "
            f"ranks into equal shard groups; use one of {divisors}, or shard_size='world'."
        )
    return (world,) if size == world else (world // size, size)


def device_mesh(ctx: Context, shard_size: ShardSize = "world") -> DeviceMesh:
    """Build the device mesh of a joined world: 1-D (shard over all), or 2-D ``(replicate, shard)``.

    Raises:
        UsageError: the shard groups do not divide the world (see `mesh_shape`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(ctx.env, shard_size)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)


@attrs.frozen(kw_only=True)
class JoinMesh:
    """Setup field: run ``join`` (join the process group), then add ``ctx.extras["mesh"]``."""

    join: SetupFn = attrs.field(factory=JoinProcessGroup)
    shard_size: ShardSize = attrs.field(default="world", validator=_SHARD_SIZE)

    def __call__(self, env: Env) -> Context:
        check_env(env, "setup")
        mesh_shape(env, self.shard_size)  # a world that does not factor fails before joining
        ctx = self.join(env)
        return ctx.with_extras(mesh=device_mesh(ctx, self.shard_size))
