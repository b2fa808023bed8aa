"""What the training laws say when the ranks together do not hold the reference's state.

`_uncovered` (sharded optimizer state) and `_misheld` (a pipeline's stages) read only the
snapshots, so their reports are checked here without a world.
"""

from __future__ import annotations

import torch

from stratagem.testing.laws.parallel import _misheld, _uncovered

ONE = torch.ones(1)
WHOLE = {"model.a": ONE, "model.b": ONE, "optimizer.a.momentum_buffer": ONE}


def test_sharded_optimizer_state_must_cover_every_slot():
    expected = [[WHOLE], [WHOLE]]
    halves = [[{"model.a": ONE, "model.b": ONE}], [{"model.a": ONE, "model.b": ONE}]]
    assert _uncovered([[WHOLE], [{"model.a": ONE, "model.b": ONE}]], expected, 0) is None
    found = _uncovered(halves, expected, 0)
    assert found is not None
    assert found.startswith("no rank holds the optimizer state ['optimizer.a.momentum_buffer']")


def test_a_pipelines_stages_hold_each_key_once():
    expected = [[WHOLE], [WHOLE]]
    parts = [(True, 0), (True, 0)]
    first, second = {"model.a": ONE}, {"model.b": ONE, "optimizer.a.momentum_buffer": ONE}
    assert _misheld([[first], [second]], expected, 0, parts) is None
    lost = _misheld([[first], [{"model.b": ONE}]], expected, 0, parts)
    assert lost is not None
    assert lost.startswith("among ranks [0, 1] (one pipeline), no rank holds ['optimizer.a.")
    twice = _misheld([[{**first, "model.b": ONE}], [second]], expected, 0, parts)
    assert twice is not None and "['model.b'] are held by several stages" in twice
    extra = _misheld([[{**first, "model.c": ONE}], [second]], expected, 0, parts)
    assert extra is not None and "['model.c'] are not in the reference" in extra
