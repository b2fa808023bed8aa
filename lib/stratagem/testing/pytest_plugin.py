"""pytest fixtures of the kit.

Enable them in a ``conftest.py`` with
``pytest_plugins = ["stratagem.testing.pytest_plugin"]``.
``stratagem_world`` is one 2-rank `World` for the whole session (started on
first use), so property tests across modules share its ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stratagem.testing.world import World

__all__ = ["stratagem_world"]


@pytest.fixture(scope="session")
def stratagem_world() -> Iterator[World]:
    """Yield a running 2-rank `World`, closed at the end of the session."""
    with World(2) as world:
        yield world
