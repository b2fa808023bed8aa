"""A world of N ranks in this one process, over torch's ``fake`` process-group backend.

Nothing is sent: a fake all-gather gives every rank this rank's tensor, a
reduction leaves its tensor as it is. Setup joins it as any world
(`stratagem.process_group.is_simulated`), so the user's own strategy runs on it
unchanged, with its meshes, groups and hooks.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]  # exported at run time

from stratagem.errors import UsageError

__all__ = ["simulated_world"]


def _register_fake_backend(caller: str) -> None:
    """Make ``"fake"`` a backend ``init_process_group`` knows (torch registers it on import)."""
    if "fake" in dist.Backend._plugins:  # noqa: SLF001  # torch names its registered backends only here
        return
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  # registers "fake"
    except ImportError as error:  # a torch built without its testing package
        raise UsageError(
            f"{caller}: this torch has no fake process-group backend "
            f"(torch.testing._internal.distributed.fake_pg: {error}); install a full torch wheel."
        ) from error


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int = 0, caller: str = "dry_run") -> Iterator[None]:
    """Join a fake world of ``world_size`` ranks as ``rank``, and leave it on exit.

    ``caller`` names the function in the errors.

    Raises:
        UsageError: a process group is already initialised in this process.
    """
    if dist.is_initialized():
        raise UsageError(
            f"{caller}: a process group of {dist.get_world_size()} rank(s) is already "
            "initialised in this process, and it joins a simulated world of its own; "
            f"call {caller} before joining a world (or after destroy_process_group), or in a "
            "process of its own."
        )
    _register_fake_backend(caller)
    dist.init_process_group("fake", store=HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's sharding caches, which keep the meshes of a world that is gone.

    A cached result holds the mesh it was computed on; a later mesh equal to it
    (the same shape and names, in the next simulated world) would get the old
    one back, whose groups no longer exist: its collectives would resolve no
    group. A real world ends with its process, a simulated one ends here.
    """
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor ran: nothing cached
        return
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
