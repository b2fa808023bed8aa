"""Checkpoints among links, special files, full disks and flipped bits.

Each case is real: symbolic links on disk, a FIFO and ``/dev/zero`` in place of
the manifest, a tmpfs too small for the save (mounted in a private mount
namespace with ``unshare``), a bit flipped in a tensor file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg
from helpers import LIB
from stratagem.checkpoint import directory
from stratagem.errors import CheckpointError


def single() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def state_of(version: int, size: int = 16) -> dict[str, object]:
    model = torch.nn.Linear(size, size)
    with torch.no_grad():
        model.weight.fill_(version)
        model.bias.fill_(-version)
    return {"model": model, "version": version}


def loaded_version(path: Path, size: int = 16) -> int:
    model = torch.nn.Linear(size, size)
    version = sg.checkpoint.load(path, {"model": model}, single())["version"]
    assert torch.all(model.weight == version), "a mixed checkpoint"
    return int(version)


# ------------------------------------------------------------------------------- links


def test_pruning_never_deletes_through_a_link(tmp_path):
    elsewhere = tmp_path / "other-run" / "ckpt"
    sg.checkpoint.save(elsewhere, state_of(9), single())
    run = tmp_path / "run"
    sg.checkpoint.save(run / "step-1", state_of(1), single())
    (run / "latest").symlink_to(run / "step-1", target_is_directory=True)
    (run / "from-other-run").symlink_to(elsewhere, target_is_directory=True)
    (run / "step-2.old-0123456789ab").symlink_to(elsewhere, target_is_directory=True)
    for step in (2, 3, 4):
        sg.checkpoint.save(run / f"step-{step}", state_of(step), single(), keep_last=1)
    assert loaded_version(elsewhere) == 9, "a checkpoint outside the run was pruned"
    assert (elsewhere / directory.MANIFEST).is_file()
    assert sorted(p.name for p in run.iterdir()) == [
        "from-other-run",
        "latest",
        "step-2.old-0123456789ab",
        "step-4",
    ]
    assert sg.checkpoint.latest(run) == run / "step-4"  # links are not listed


def test_a_save_to_a_link_is_refused_and_what_it_points_at_is_kept(tmp_path):
    real = tmp_path / "real"
    sg.checkpoint.save(real, state_of(1), single())
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"'.*link' is a symbolic link; .*Save to the direc"):
        sg.checkpoint.save(link, state_of(2), single())
    assert link.is_symlink() and loaded_version(real) == 1
    assert loaded_version(link) == 1  # loading reads through a link
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


# ------------------------------------------------------------------------------- special files

LOAD_AND_DESCRIBE = """
import sys, torch, stratagem as sg
path = sys.argv[1]
for call in (
    lambda: sg.checkpoint.load(path, {"model": torch.nn.Linear(16, 16)}, sg.single_device("cpu").setup(sg.Env())),
    lambda: sg.checkpoint.describe(path),
):
    try:
        call()
        print("loaded")
    except Exception as error:
        print(type(error).__name__, error)
"""


@pytest.mark.slow
@pytest.mark.parametrize("special", ["fifo", "link to /dev/zero"])
def test_a_manifest_that_is_not_a_file_is_refused_at_once(tmp_path, special):
    path = tmp_path / "ckpt"
    sg.checkpoint.save(path, state_of(1), single())
    manifest = path / directory.MANIFEST
    manifest.unlink()
    if special == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.symlink_to("/dev/zero")
    env = {**os.environ, "PYTHONPATH": str(LIB)}
    runs = [
        [sys.executable, "-c", LOAD_AND_DESCRIBE, str(path)],
        [sys.executable, "-m", "stratagem", "checkpoint", str(path)],
    ]
    for command in runs:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        out = done.stdout + done.stderr
        assert "stratagem.json is not a manifest" in out, out
        assert "loaded" not in done.stdout


# ------------------------------------------------------------------------------- bits


def test_a_flipped_bit_in_a_tensor_file_is_an_error_not_a_wrong_weight(tmp_path):
    path = tmp_path / "ckpt"
    sg.checkpoint.save(path, state_of(1, size=64), single(), checksums=True)
    metadata = directory.read_metadata(directory.Found(path, {}))
    index = next(i for i in metadata.storage_data if i.fqn == "model.weight")
    info = metadata.storage_data[index]
    data = path / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x10  # one bit in the middle of the weight's bytes
    data.write_bytes(bytes(raw))
    model = torch.nn.Linear(64, 64)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match the checksum"):
        sg.checkpoint.load(path, {"model": model}, single())
    assert torch.equal(model.weight, before), "a partial load"


def test_checksums_are_asked_for(tmp_path):
    path = tmp_path / "ckpt"
    sg.checkpoint.save(path, state_of(3), single())
    assert "checksums" not in json.loads((path / directory.MANIFEST).read_text())
    assert loaded_version(path) == 3
    sg.checkpoint.save(path, state_of(4), single(), checksums=True)
    sums = json.loads((path / directory.MANIFEST).read_text())["checksums"]
    assert sorted(sums) == [".metadata", "__0_0.distcp"]
    assert loaded_version(path) == 4
    with pytest.raises(sg.UsageError, match=r"save: 'checksums' must be True or False"):
        sg.checkpoint.save(path, state_of(3), single(), checksums="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- full disk

FULL_DISK = """
import json, os, sys, torch, stratagem as sg
from stratagem.checkpoint import directory
mount, case = sys.argv[1], sys.argv[2]
ctx = sg.single_device("cpu").setup(sg.Env())
def state(version, size):
    model = torch.nn.Linear(size, size)
    with torch.no_grad():
        model.weight.fill_(version)
    return {"model": model, "version": version}
def free():
    status = os.statvfs(mount)
    return status.f_bavail * status.f_frsize
path = os.path.join(mount, "ckpt")
sg.checkpoint.save(path, state(1, 16), ctx)
def attempt(size):
    stages = []
    directory.stage_hook = stages.append
    try:
        sg.checkpoint.save(path, state(2, size), ctx)
        return "saved", stages
    except Exception as error:
        return f"{type(error).__name__}: {error}", stages
if case == "manifest":
    # Room for this save's files but not its manifest: from too little room, a page more at a time.
    before = free()
    sg.checkpoint.save(os.path.join(mount, "trial"), state(2, 64), ctx)
    needed = before - free()
    directory.discard(directory.Path(mount, "trial"))
    page = os.statvfs(mount).f_frsize
    filler_size = free() - needed + 2 * page
    for _ in range(16):
        with open(os.path.join(mount, "filler"), "wb") as filler:
            filler.write(b"x" * filler_size)
        message, stages = attempt(64)
        if "written" in stages:
            break
        filler_size -= page
else:
    message, stages = attempt(1024)  # 4 MiB of weights on a 1 MiB disk
directory.stage_hook = lambda stage: None
model = torch.nn.Linear(16, 16)
version = sg.checkpoint.load(path, {"model": model}, ctx)["version"]
print(json.dumps({"message": message, "stages": stages, "version": version,
                  "weights": float(model.weight.mean()),
                  "left": sorted(n for n in os.listdir(mount) if n not in ("ckpt", "filler"))}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["data", "manifest"])
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path, case):
    mount = tmp_path / "disk"
    mount.mkdir()
    program = tmp_path / "full_disk.py"
    program.write_text(FULL_DISK)
    script = f"mount -t tmpfs -o size=1m stratagem-test {mount} && exec {sys.executable} {program} {mount} {case}"
    env = {**os.environ, "PYTHONPATH": str(LIB)}
    done = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    message = result["message"]
    assert message.startswith("CheckpointError: save: the disk holding"), message
    assert "is full" in message and "the previous checkpoint at" in message, message
    assert "is intact" in message and "Free some space" in message, message
    assert (result["version"], result["weights"]) == (1, 1.0)  # the previous one, whole
    assert result["left"] == [], "the failed save left files behind"
    if case == "manifest":
        assert "written" in result["stages"] and "manifest" not in result["stages"], result


# ------------------------------------------------------------------------------- two ranks


def save_flip_and_load(strategy, ctx, path: str) -> tuple[list[str], str]:
    """fsdp on 2 ranks: save with checksums, flip a bit in rank 1's file, load on both."""
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(64, 64), ctx)
    sg.checkpoint.save(path, {"model": model}, ctx, checksums=True)
    names = sorted(json.loads((Path(path) / directory.MANIFEST).read_text())["checksums"])
    sg.collectives.barrier(ctx)
    if ctx.rank == 0:
        data = Path(path) / "__1_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    sg.collectives.barrier(ctx)
    try:
        sg.checkpoint.load(path, {"model": model}, ctx)
    except CheckpointError as error:
        return names, str(error)
    return names, "loaded"


@pytest.mark.slow
def test_checksums_on_two_ranks_cover_every_rank_s_file(tmp_path):
    results = sg.launch(
        save_flip_and_load, sg.fsdp_spawn(device="cpu"), devices=2, args=(str(tmp_path / "ckpt"),)
    )
    for names, outcome in results:
        assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert "__1_0.distcp does not match the checksum" in outcome, outcome
