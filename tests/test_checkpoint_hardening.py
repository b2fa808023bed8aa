"""Checkpoints against lost errors, skewed clocks, half-applied loads and crafted files (issues 39, 40).

Every case is real: real saves and loads, files crafted on disk as an attacker
would write them, a subprocess running as another user, a lock held by a live
process. Each refusal is one line that names the input, the value and the fix,
and writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg
from helpers import LIB
from stratagem.checkpoint import directory
from stratagem.errors import CheckpointError, UsageError


def single() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def model_of(value: float, size: int = 4) -> torch.nn.Linear:
    model = torch.nn.Linear(size, size)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(-value)
    return model


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text.strip(), text
    return text


def manifest_of(path: Path) -> dict:
    return json.loads((path / directory.MANIFEST).read_text())


def rewrite_manifest(path: Path, **changes: object) -> None:
    manifest = manifest_of(path) | changes
    (path / directory.MANIFEST).write_text(json.dumps(manifest))


def rewrite_metadata(path: Path, edit) -> None:
    metadata = directory.read_metadata(directory.Found(path, {}))
    edit(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = manifest_of(path)
    manifest["files"][".metadata"] = (path / ".metadata").stat().st_size
    (path / directory.MANIFEST).write_text(json.dumps(manifest))


def listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.fixture(autouse=True)
def no_stage_hook():
    yield
    directory.stage_hook = directory._ignore


# ----------------------------------------------------------- a background save's error is kept


def failing_at_written(stage: str) -> None:
    if stage == "written":
        raise OSError(5, "Input/output error")


def test_an_unwaited_background_failure_is_raised_by_the_next_save_naming_both_paths(tmp_path):
    ctx = single()
    directory.stage_hook = failing_at_written
    handle = sg.checkpoint.save(tmp_path / "a", {"model": model_of(1)}, ctx, blocking=False)
    assert handle is not None
    deadline = time.monotonic() + 30
    while not handle.done():  # ended, unseen: wait() would report the error
        assert time.monotonic() < deadline
        time.sleep(0.01)
    directory.stage_hook = directory._ignore
    # Still the disk's error, so `except OSError` holds.
    with pytest.raises(OSError, match="Input/output error") as caught:
        sg.checkpoint.save(tmp_path / "b", {"model": model_of(2)}, ctx)
    text = one_line(caught.value)
    assert str(tmp_path / "a") in text and str(tmp_path / "b") in text, text
    assert "Input/output error" in text and "save again" in text, text
    assert listing(tmp_path) == [], "the failed save left files, or the next save was made"
    # Once raised, the error is reported: the save after it is made.
    sg.checkpoint.save(tmp_path / "b", {"model": model_of(2)}, ctx)
    assert sg.checkpoint.latest(tmp_path) == tmp_path / "b"


# ------------------------------------------------------------ resume_or_start given a checkpoint


def test_resume_or_start_given_a_checkpoint_s_own_path_refuses_naming_the_parent(tmp_path):
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())
    sg.checkpoint.save(tmp_path / "step_10", {"model": model_of(1), "step": 10}, ctx)
    before = listing(tmp_path / "step_10")
    with pytest.raises(UsageError) as caught:
        sg.resume_or_start(tmp_path / "step_10", {"model": model_of(0), "step": 0}, strategy, ctx)
    text = one_line(caught.value)
    assert f"'{tmp_path / 'step_10'}'" in text and f"'{tmp_path}'" in text, text
    assert listing(tmp_path / "step_10") == before


def test_a_save_inside_a_checkpoint_is_refused(tmp_path):
    ctx = single()
    sg.checkpoint.save(tmp_path / "step_10", {"model": model_of(1)}, ctx)
    before = listing(tmp_path / "step_10")
    with pytest.raises(CheckpointError) as caught:
        sg.checkpoint.save(tmp_path / "step_10" / "step_20", {"model": model_of(2)}, ctx)
    text = one_line(caught.value)
    assert f"'{tmp_path / 'step_10'}'" in text and "is a checkpoint" in text, text
    assert listing(tmp_path / "step_10") == before


# ----------------------------------------------------------------------------- clock skew


def test_latest_follows_the_order_of_saves_not_a_skewed_clock(tmp_path):
    ctx = single()
    sg.checkpoint.save(tmp_path / "step_10", {"model": model_of(10), "step": 10}, ctx)
    # The first job's clock ran an hour ahead of the next jobs'.
    ahead = manifest_of(tmp_path / "step_10")["saved_at_ns"] + 3600 * 10**9
    rewrite_manifest(tmp_path / "step_10", saved_at_ns=ahead)
    sg.checkpoint.save(tmp_path / "step_20", {"model": model_of(20), "step": 20}, ctx)
    assert sg.checkpoint.latest(tmp_path) == tmp_path / "step_20"
    sg.checkpoint.save(tmp_path / "step_30", {"model": model_of(30), "step": 30}, ctx, keep_last=2)
    assert sg.checkpoint.latest(tmp_path) == tmp_path / "step_30"
    assert listing(tmp_path) == ["step_20", "step_30"], "pruning kept the skewed old one"


def test_checkpoints_without_a_sequence_still_order_by_time(tmp_path):
    ctx = single()
    for step in (1, 2):
        sg.checkpoint.save(tmp_path / f"step_{step}", {"model": model_of(step)}, ctx)
    for step in (1, 2):  # as an older version of stratagem wrote them
        manifest = manifest_of(tmp_path / f"step_{step}")
        manifest.pop("sequence", None)
        (tmp_path / f"step_{step}" / directory.MANIFEST).write_text(json.dumps(manifest))
    assert sg.checkpoint.latest(tmp_path) == tmp_path / "step_2"
    sg.checkpoint.save(tmp_path / "step_0", {"model": model_of(0)}, ctx)  # the newest save
    assert sg.checkpoint.latest(tmp_path) == tmp_path / "step_0"


# ------------------------------------------------------------- a load that fails touches nothing


def rng_stored_as(path: Path, ctx: sg.Context, value: object) -> None:
    """Save a checkpoint whose RNG state is ``value`` (as a tampered or foreign file holds it)."""
    from stratagem.checkpoint import entries

    real = entries.capture_rng
    entries.capture_rng = lambda device: value
    try:
        sg.checkpoint.save(path, {"model": model_of(7)}, ctx)
    finally:
        entries.capture_rng = real


MALFORMED_RNG = {
    "a list for a dict": [1, 2, 3],
    "a wrong-size torch state": "torch-short",
    "a wrong Python format": "python-bad",
    "a wrong NumPy format": "numpy-bad",
}


def malformed(kind: str) -> object:
    from stratagem.checkpoint.entries import capture_rng

    state = capture_rng(torch.device("cpu"))
    if kind == "torch-short":
        state["torch"] = state["torch"][:100]
    elif kind == "python-bad":
        state["python"] = (3, torch.tensor([1, 2, 3]), None)
    elif kind == "numpy-bad":
        state["numpy"] = ("MT19937", torch.tensor([1, 2]), 0, 0, 0.0)
    else:
        return kind
    return state


@pytest.mark.parametrize("case", list(MALFORMED_RNG))
def test_a_malformed_rng_state_fails_the_load_before_the_model_changes(tmp_path, case):
    ctx = single()
    rng_stored_as(tmp_path / "c", ctx, malformed(MALFORMED_RNG[case]))
    live = model_of(3)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError) as caught:
        sg.checkpoint.load(tmp_path / "c", {"model": live}, ctx)
    text = one_line(caught.value)
    assert "RNG state" in text and "rng=False" in text, text
    assert torch.all(live.weight == 3), "the live weights changed before the load failed"
    assert torch.equal(torch.get_rng_state(), before), "the live RNG changed"
    sg.checkpoint.load(tmp_path / "c", {"model": live}, ctx, rng=False)  # the fix works
    assert torch.all(live.weight == 7)


# ----------------------------------------------------------------- crafted metadata (issue 40)


def saved_linear(path: Path) -> None:
    sg.checkpoint.save(path, {"model": model_of(5)}, single())


def weight_item(metadata):
    return next(v for k, v in metadata.state_dict_metadata.items() if k.endswith("weight"))


def test_metadata_whose_pieces_do_not_cover_a_tensor_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    saved_linear(tmp_path / "c")

    def half(metadata):
        weight_item(metadata).chunks = [
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 4]))
        ]

    rewrite_metadata(tmp_path / "c", half)
    live = model_of(3)
    with pytest.raises(CheckpointError, match="cover 8 of its 16 elements") as caught:
        sg.checkpoint.load(tmp_path / "c", {"model": live}, single())
    assert "model/weight" in one_line(caught.value) or "weight" in str(caught.value)
    assert torch.all(live.weight == 3) and torch.all(live.bias == -3)


def test_metadata_whose_pieces_overlap_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    saved_linear(tmp_path / "c")

    def twice(metadata):
        item = weight_item(metadata)
        item.chunks = [
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 2])),
            ChunkStorageMetadata(offsets=torch.Size([0, 1]), sizes=torch.Size([4, 2])),
        ]  # 16 elements in all, column 1 twice and column 3 never
        fqn = next(k for k, v in metadata.state_dict_metadata.items() if v is item)
        first = next(i for i in metadata.storage_data if i.fqn == fqn)
        metadata.storage_data[MetadataIndex(fqn, [0, 1])] = metadata.storage_data[first]

    rewrite_metadata(tmp_path / "c", twice)
    with pytest.raises(CheckpointError, match="overlap"):
        sg.checkpoint.load(tmp_path / "c", {"model": model_of(3)}, single())


@pytest.mark.parametrize(
    ("size", "match"),
    [((1 << 22, 1 << 20), "declares .* bytes"), ((4, -4), "negative")],
    ids=["16 TiB", "negative"],
)
def test_metadata_declaring_impossible_sizes_is_refused_by_load_and_describe(tmp_path, size, match):
    saved_linear(tmp_path / "c")

    def huge(metadata):
        weight_item(metadata).size = torch.Size(size)

    rewrite_metadata(tmp_path / "c", huge)
    for attempt in (
        lambda: sg.checkpoint.load(tmp_path / "c", {"model": model_of(3)}, single()),
        lambda: sg.checkpoint.describe(tmp_path / "c"),
    ):
        with pytest.raises(CheckpointError, match=match) as caught:
            attempt()
        one_line(caught.value)


def test_a_huge_plain_value_declared_in_metadata_is_refused_before_allocating(tmp_path):
    sg.checkpoint.save(tmp_path / "c", {"step": 3}, single())

    def huge(metadata):
        item = next(v for k, v in metadata.state_dict_metadata.items() if k.startswith("step"))
        item.size = torch.Size([1 << 44])
        item.chunks[0].sizes = torch.Size([1 << 44])

    rewrite_metadata(tmp_path / "c", huge)
    with pytest.raises(CheckpointError, match="declares .* bytes"):
        sg.checkpoint.describe(tmp_path / "c")


# ------------------------------------------------------------------ crafted manifests


@pytest.mark.parametrize("world", [10**9, -3, 0, True, 2.0])
def test_a_manifest_s_world_size_out_of_bounds_is_refused_at_once(tmp_path, world):
    saved_linear(tmp_path / "c")
    rewrite_manifest(tmp_path / "c", world_size=world)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="world_size") as caught:
        sg.checkpoint.describe(tmp_path / "c")
    assert time.monotonic() - start < 5
    assert repr(world) in one_line(caught.value)


def test_a_manifest_nested_thousands_deep_is_refused(tmp_path):
    saved_linear(tmp_path / "c")
    text = (tmp_path / "c" / directory.MANIFEST).read_text()
    (tmp_path / "c" / directory.MANIFEST).write_text(
        text[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    with pytest.raises(CheckpointError, match="nested") as caught:
        sg.checkpoint.describe(tmp_path / "c")
    one_line(caught.value)
    assert sg.checkpoint.latest(tmp_path) is None


@pytest.mark.parametrize("when", [10**30, -(10**20), 253402300800 * 10**9])
def test_a_saved_at_out_of_range_is_refused(tmp_path, when):
    saved_linear(tmp_path / "c")
    rewrite_manifest(tmp_path / "c", saved_at_ns=when)
    with pytest.raises(CheckpointError, match="saved_at_ns") as caught:
        sg.checkpoint.describe(tmp_path / "c")
    assert str(when) in one_line(caught.value)


@pytest.mark.slow
def test_the_cli_refuses_a_far_future_saved_at_in_one_line(tmp_path):
    saved_linear(tmp_path / "c")
    rewrite_manifest(tmp_path / "c", saved_at_ns=10**30)
    done = cli("checkpoint", str(tmp_path / "c"))
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "saved_at_ns" in done.stderr


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(LIB))
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "stratagem", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------------------ entry names


@pytest.mark.parametrize(
    ("names", "shown"),
    [(("model", "model.weight"), "'model' and 'model.weight'"), (("a.b", "a"), "'a' and 'a.b'")],
)
def test_entry_names_that_collide_once_dotted_are_refused_at_save(tmp_path, names, shown):
    state = {names[0]: model_of(1), names[1]: 3}
    with pytest.raises(UsageError) as caught:
        sg.checkpoint.save(tmp_path / "c", state, single())
    text = one_line(caught.value)
    assert shown in text and "rename one" in text, text
    assert listing(tmp_path) == []


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "model/weight", "a\\b"])
def test_entry_names_with_path_separators_are_refused_at_save(tmp_path, name):
    with pytest.raises(UsageError) as caught:
        sg.checkpoint.save(tmp_path / "c", {name: 1}, single())
    assert repr(name) in one_line(caught.value)
    assert listing(tmp_path) == []


def crafted_with_entry(path: Path, name: str) -> None:
    """A checkpoint whose manifest renames the value entry 'other' to ``name`` (crafted)."""
    sg.checkpoint.save(path, {"model": model_of(1), "other": 42}, single())

    def rename(metadata):  # DCP's key of the value, in each of the three places it is
        metadata.planner_data[name] = (name,)
        del metadata.planner_data["other"]
        metadata.state_dict_metadata[name] = metadata.state_dict_metadata.pop("other")
        for index in list(metadata.storage_data):
            if index.fqn == "other":
                info = metadata.storage_data.pop(index)
                metadata.storage_data[dataclasses.replace(index, fqn=name)] = info

    rewrite_metadata(path, rename)
    manifest = manifest_of(path)
    manifest["entries"][name] = manifest["entries"].pop("other")
    (path / directory.MANIFEST).write_text(json.dumps(manifest))


def test_the_cli_keeps_an_entry_named_like_a_module_key_apart(tmp_path):
    crafted_with_entry(tmp_path / "c", "model/weight")
    shown = str(sg.checkpoint.describe(tmp_path / "c"))
    lines = shown.splitlines()
    model_at = lines.index("  model (module)")
    model_block = lines[model_at + 1 : model_at + 3]
    assert model_block == ["    bias: float32[4]", "    weight: float32[4, 4]"], shown
    assert "  'model/weight' (value)" in lines, shown
    assert "    = 42" in lines, shown


@pytest.mark.slow
def test_the_cli_quotes_an_entry_name_that_looks_like_a_path(tmp_path):
    crafted_with_entry(tmp_path / "c", "../../etc/passwd")
    done = cli("checkpoint", str(tmp_path / "c"))
    assert done.returncode == 0, done.stderr
    assert "  '../../etc/passwd' (value)" in done.stdout.splitlines(), done.stdout


# ------------------------------------------------- digit runs of thousands (crafted keys)

THOUSANDS = "1" * 5000  # int() refuses more than 4,300 digits: a ValueError, not a refusal


def test_a_rank_key_of_thousands_of_digits_fails_the_load_as_a_checkpoint_error(tmp_path):
    ctx = single()
    sg.checkpoint.save(tmp_path / "c", {"model": model_of(1), "seen": sg.per_rank(3)}, ctx)
    rewrite_metadata(
        tmp_path / "c", lambda m: m.planner_data.update({"seen.0": ("seen", THOUSANDS)})
    )
    model = model_of(2)
    with pytest.raises(CheckpointError, match=r"lists rank 0's value 'seen' but holds no data"):
        sg.checkpoint.load(tmp_path / "c", {"model": model, "seen": sg.per_rank(0)}, ctx)
    assert torch.equal(model.weight, model_of(2).weight)  # refused before anything changed
    lines = str(sg.checkpoint.describe(tmp_path / "c")).splitlines()  # and shown as it is
    assert lines[lines.index("  seen (per_rank_value)") + 1].strip().startswith(THOUSANDS)


def test_describe_shows_an_entry_named_with_thousands_of_digits(tmp_path):
    crafted_with_entry(tmp_path / "c", f"n{THOUSANDS}")
    lines = str(sg.checkpoint.describe(tmp_path / "c")).splitlines()
    assert f"  n{THOUSANDS} (value)" in lines


def test_describe_orders_keys_by_the_value_of_their_numbers(tmp_path):
    model = torch.nn.Sequential(*(torch.nn.Linear(1, 1, bias=False) for _ in range(11)))
    sg.checkpoint.save(tmp_path / "c", {"model": model}, single())
    lines = str(sg.checkpoint.describe(tmp_path / "c")).splitlines()
    shown = [line.split(":")[0].strip() for line in lines if line.endswith("float32[1, 1]")]
    assert shown == [f"{index}.weight" for index in range(11)]  # 2 before 10, as numbers


# ------------------------------------------------------------------- locks and leftovers


def test_stale_locks_and_dead_saves_beside_a_commit_are_cleaned(tmp_path):
    ctx = single()
    sg.checkpoint.save(tmp_path / "step_1", {"model": model_of(1)}, ctx)
    # A save to step_2 killed mid-write: its lock file and temporary directory remain.
    (tmp_path / "step_2.lock").write_text("pid 1 on gone")
    (tmp_path / "step_2.tmp-0123456789ab").mkdir()
    (tmp_path / "step_2.tmp-0123456789ab" / "__0_0.distcp").write_bytes(b"x" * 100)
    # A pruned checkpoint whose removal was killed, as this version leaves it.
    (tmp_path / "step_0.tmp-aaaaaaaaaaaa").mkdir()
    # The user's own files, named like ours but not made by a save: never touched.
    (tmp_path / "notes.lock").write_text("my notes")
    (tmp_path / "data.tmp-x").mkdir()
    # A save to step_9 that is live: its lock is held by a running process.
    live = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)",
            str(tmp_path / "step_9.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stdout is not None and live.stdout.readline() == "held\n"
        (tmp_path / "step_9.tmp-bbbbbbbbbbbb").mkdir()
        sg.checkpoint.save(tmp_path / "step_3", {"model": model_of(3)}, ctx)
        assert listing(tmp_path) == [
            "data.tmp-x",
            "notes.lock",
            "step_1",
            "step_3",
            "step_9.lock",
            "step_9.tmp-bbbbbbbbbbbb",
        ], "stale leftovers stayed, or a live save's files were removed"
    finally:
        live.kill()
        live.wait()
        live.stdout.close()


def test_pruning_renames_before_it_removes_so_a_killed_prune_leaves_no_lookalike(tmp_path):
    ctx = single()
    sg.checkpoint.save(tmp_path / "step_1", {"model": model_of(1)}, ctx)

    def killed(stage: str) -> None:
        if stage == "discarding":
            raise KeyboardInterrupt  # the removal stops half way

    directory.stage_hook = killed
    with pytest.raises(KeyboardInterrupt):
        sg.checkpoint.save(tmp_path / "step_2", {"model": model_of(2)}, ctx, keep_last=1)
    directory.stage_hook = directory._ignore
    assert "step_1" not in listing(tmp_path), "a half-removed checkpoint kept a checkpoint's name"
    sg.checkpoint.save(tmp_path / "step_3", {"model": model_of(3)}, ctx, keep_last=2)
    assert listing(tmp_path) == ["step_2", "step_3"]


def test_a_lock_file_that_is_a_link_is_refused_in_one_line(tmp_path):
    (tmp_path / "c.lock").symlink_to(tmp_path / "c.lock")  # a loop
    with pytest.raises(CheckpointError) as caught:
        sg.checkpoint.save(tmp_path / "c", {"model": model_of(1)}, single())
    text = one_line(caught.value)
    assert f"'{tmp_path / 'c.lock'}'" in text and "symbolic link" in text and "remove" in text
    assert listing(tmp_path) == ["c.lock"]


# ------------------------------------------------------------------------- bad save paths


@pytest.mark.parametrize("where", ["file", "loop"])
def test_a_file_or_a_link_loop_as_the_parent_is_refused_in_one_line(tmp_path, where):
    parent = tmp_path / "run"
    if where == "file":
        parent.write_text("not a directory")
    else:
        parent.symlink_to(parent)
    with pytest.raises(CheckpointError) as caught:
        sg.checkpoint.save(parent / "step_1", {"model": model_of(1)}, single())
    text = one_line(caught.value)
    assert f"'{parent}'" in text and "not a directory" in text, text
    assert listing(tmp_path) == ["run"]


@pytest.mark.parametrize("where", ["file", "loop"])
def test_a_file_or_a_link_loop_as_the_run_directory_is_refused_by_resume(tmp_path, where):
    strategy = sg.single_device("cpu")
    run = tmp_path / "run"
    if where == "file":
        run.write_text("not a directory")
    else:
        run.symlink_to(run)
    with pytest.raises(UsageError) as caught:
        sg.resume_or_start(run, {"model": model_of(1)}, strategy, strategy.setup(sg.Env()))
    assert f"'{run}'" in one_line(caught.value)


def test_a_save_path_with_a_nul_byte_is_refused(tmp_path):
    with pytest.raises(UsageError, match="NUL") as caught:
        sg.checkpoint.save(f"{tmp_path}/a\0b", {"model": model_of(1)}, single())
    one_line(caught.value)
    assert listing(tmp_path) == []


@dataclasses.dataclass
class BytesPath:
    """A path-like whose ``__fspath__`` gives bytes, as ``os.PathLike[bytes]`` may."""

    path: bytes

    def __fspath__(self) -> bytes:
        return self.path


@pytest.mark.parametrize("nul", [False, True])
@pytest.mark.parametrize("call", ["save", "latest", "exists", "describe"])
def test_a_path_like_of_bytes_is_refused_naming_the_argument(tmp_path, call, nul):
    path = BytesPath(os.fsencode(tmp_path / ("a\0b" if nul else "c")))
    calls = {
        "save": lambda: sg.checkpoint.save(path, {"model": model_of(1)}, single()),
        "latest": lambda: sg.checkpoint.latest(path),
        "exists": lambda: sg.checkpoint.exists(path),
        "describe": lambda: sg.checkpoint.describe(path),
    }
    name = "directory" if call == "latest" else "path"
    with pytest.raises(UsageError, match=rf"{call}: '{name}' must be .*str") as caught:
        calls[call]()
    one_line(caught.value)
    assert listing(tmp_path) == []


@pytest.mark.slow
def test_a_directory_of_another_user_is_refused_in_one_line(tmp_path):
    # As root, permission bits do not bind: the save runs in a user namespace (unshare -U),
    # where the directory's owner (uid 65534) is not mapped, so root's override does not apply.
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to run a save that the directory's owner forbids")
    owned = Path(tempfile.mkdtemp(prefix="owned-"))
    try:
        os.chown(owned, 65534, 65534)
        owned.chmod(0o755)  # another user's, writable only by that user
        script = (
            "import torch, stratagem as sg, sys\n"
            "ctx = sg.single_device('cpu').setup(sg.Env())\n"
            "try:\n"
            "    sg.checkpoint.save(sys.argv[1], {'model': torch.nn.Linear(2, 2)}, ctx)\n"
            "except sg.checkpoint.CheckpointError as error:\n"
            "    print(error)\n"
        )
        done = subprocess.run(
            ["unshare", "-U", sys.executable, "-W", "error", "-c", script, str(owned / "step_1")],
            env=dict(os.environ, PYTHONPATH=str(LIB)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if "unshare:" in done.stderr:
            pytest.skip(f"no user namespace here: {done.stderr.strip()}")
        assert done.returncode == 0, done.stderr
        text = done.stdout.strip()
        assert "\n" not in text and f"'{owned}'" in text and "permission" in text, text
        assert listing(owned) == []
    finally:
        for leftover in owned.iterdir():
            leftover.unlink()
        owned.rmdir()


# --------------------------------------------------------------------------- PendingSave.wait


@pytest.mark.parametrize("timeout", [1e308, 1e10])
def test_a_wait_longer_than_threads_allow_is_refused(tmp_path, timeout):
    handle = sg.checkpoint.save(tmp_path / "c", {"model": model_of(1)}, single(), blocking=False)
    assert handle is not None
    with pytest.raises(UsageError, match="at most") as caught:
        handle.wait(timeout)
    assert repr(timeout) in one_line(caught.value)
    handle.wait()
