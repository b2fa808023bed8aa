"""pytest fixtures of the kit.

Enable them in a ``conftest.py`` with
``pytest_plugins = ["stratagem.testing.pytest_plugin"]``.
``stratagem_world`` is one 2-rank `World` for the whole session (started on
first use), so property tests across modules share its ranks;
``stratagem_world_of(size)`` gives a session-wide `World` of any size (the
2-rank one for 2), so the same laws run on 4 ranks as well.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from stratagem.testing.world import World

__all__ = ["stratagem_world", "stratagem_world_of"]


@pytest.fixture(scope="session")
def _stratagem_worlds() -> Iterator[dict[int, World]]:
    worlds: dict[int, World] = {}
    try:
        yield worlds
    finally:
        for world in worlds.values():
            world.close()


@pytest.fixture(scope="session")
def stratagem_world_of(_stratagem_worlds: dict[int, World]) -> Callable[[int], World]:
    """Return ``world_of(size)``: a running `World` of ``size`` ranks, one per size a session."""

    def world_of(size: int) -> World:
        if size not in _stratagem_worlds:
            world = World(size)
            world.start()
            _stratagem_worlds[size] = world
        return _stratagem_worlds[size]

    return world_of


@pytest.fixture(scope="session")
def stratagem_world(stratagem_world_of: Callable[[int], World]) -> World:
    """Return a running 2-rank `World`, closed at the end of the session."""
    return stratagem_world_of(2)
