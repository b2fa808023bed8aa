"""The checkpoint refusals of issues 39 and 40, on a real two-rank gloo world.

Each was tested on one process (test_checkpoint_hardening); in a world every rank must refuse
at once, with nothing written, and none may hang waiting for another: dotted-name collisions,
crafted ``.metadata`` whose pieces leave a sharded tensor's other rank uncovered, and stale
locks beside a save.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg
from helpers import filled_linear
from stratagem.checkpoint import directory
from stratagem.errors import CheckpointError, UsageError
from stratagem.testing import World

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world():
    with World(2, timeout=60) as world:
        yield world


def save_colliding(strategy, ctx, path: str) -> tuple[str, float]:
    model = strategy.wrap(filled_linear(1), ctx)
    started = time.monotonic()
    try:
        strategy.save(path, {"model": model, "model.weight": 3}, ctx)
    except UsageError as error:
        return str(error), time.monotonic() - started
    return "saved", time.monotonic() - started


def test_dotted_name_collisions_are_refused_on_every_rank_with_nothing_written(world, tmp_path):
    results = world.run(save_colliding, sg.ddp(device="cpu"), str(tmp_path / "c"))
    for message, seconds in results:
        assert "'model' and 'model.weight'" in message and "rename one" in message, message
        assert seconds < 5
    assert os.listdir(tmp_path) == []


def save_sharded(strategy, ctx, path: str) -> None:
    strategy.save(path, {"model": strategy.wrap(filled_linear(5), ctx)}, ctx)


def load_sharded(strategy, ctx, path: str) -> tuple[str, bool]:
    from torch.distributed.tensor import DTensor

    model = strategy.wrap(filled_linear(3), ctx)
    try:
        strategy.load(path, {"model": model}, ctx)
    except CheckpointError as error:
        message = str(error)
    else:
        message = "loaded"
    weight = model.weight.to_local() if isinstance(model.weight, DTensor) else model.weight
    return message, bool(torch.all(weight == 3))


def test_metadata_leaving_one_rank_s_shard_uncovered_is_refused_on_every_rank(world, tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    path = tmp_path / "c"
    world.run(save_sharded, sg.fsdp(device="cpu"), str(path))
    metadata = directory.read_metadata(directory.Found(path, {}))
    weight = next(v for k, v in metadata.state_dict_metadata.items() if k.endswith("weight"))
    assert len(weight.chunks) == 2, weight.chunks  # one piece per rank's shard
    # Only rank 0's rows are declared: rank 1's shard would keep its live values.
    weight.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 4]))]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    text = json.loads((path / directory.MANIFEST).read_text())
    text["files"][".metadata"] = (path / ".metadata").stat().st_size
    (path / directory.MANIFEST).write_text(json.dumps(text))
    results = world.run(load_sharded, sg.fsdp(device="cpu"), str(path))
    for rank, (message, unchanged) in enumerate(results):
        assert "cover 8 of its 16 elements" in message, message
        assert unchanged, f"rank {rank}'s shard changed"


def save_beside_leftovers(strategy, ctx, directory_: str) -> None:
    model = strategy.wrap(filled_linear(2), ctx)
    strategy.save(os.path.join(directory_, "step_2"), {"model": model}, ctx)


def test_stale_locks_and_dead_saves_are_cleaned_by_a_two_rank_save(world, tmp_path):
    world.run(save_beside_leftovers, sg.ddp(device="cpu"), str(tmp_path))
    (tmp_path / "step_1.lock").write_text("pid 1 on gone")
    (tmp_path / "step_1.tmp-0123456789ab").mkdir()
    (tmp_path / "step_0.tmp-aaaaaaaaaaaa").mkdir()  # a prune that was killed
    os.rename(tmp_path / "step_2", tmp_path / "step_2_kept")
    world.run(save_beside_leftovers, sg.ddp(device="cpu"), str(tmp_path))
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["step_2", "step_2_kept"]
