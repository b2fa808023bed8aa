"""Untrusted checkpoints: edited to carry code, it is refused, not run; truncated, a clear error.

Each attack edits a real checkpoint the way an attacker with write access
would, manifest included, so that the check under test is the one that stops it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import directory, entries
from stratagem.checkpoint.directory import MANIFEST
from stratagem.errors import CheckpointError


class Payload:
    """Pickles as a call to os.system: loading it unrestricted would create ``pwned``."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.fixture
def ctx() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where Payload would leave its mark


def pwned() -> bool:
    return Path("pwned").exists()


def trained() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return {"model": model, "optim": optimizer, "step": 3}


def fresh() -> dict[str, object]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.5)}


def resize_in_manifest(path: Path) -> None:
    """Make the manifest agree with edited files (sizes and checksums), as an attacker would."""
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"] = {name: (path / name).stat().st_size for name in manifest["files"]}
    manifest["checksums"] = {
        name: zlib.crc32((path / name).read_bytes()) for name in manifest.get("checksums", {})
    }
    (path / MANIFEST).write_text(json.dumps(manifest))


def saved(tmp_path: Path, ctx: sg.Context) -> Path:
    path = tmp_path / "ckpt"
    sg.checkpoint.save(path, trained(), ctx, checksums=True)  # the attacker rewrites them too
    return path


def assert_refused_and_untouched(path: Path, ctx: sg.Context, match: str) -> None:
    state = fresh()
    before = [p.detach().clone() for p in state["model"].parameters()]
    with pytest.raises(CheckpointError, match=match):
        sg.checkpoint.load(path, state, ctx)
    with pytest.raises(CheckpointError, match=match):
        sg.checkpoint.describe(path)
    assert not pwned()
    after = list(state["model"].parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a partial load"


def test_a_metadata_file_replaced_by_a_malicious_pickle_is_refused(tmp_path, ctx):
    path = saved(tmp_path, ctx)
    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    resize_in_manifest(path)
    assert_refused_and_untouched(
        path, ctx, r"\.metadata cannot be read safely .*refused to load posix\.system"
    )


def test_a_payload_hidden_inside_real_metadata_is_refused(tmp_path, ctx):
    path = saved(tmp_path, ctx)
    metadata = directory.read_metadata(directory.Found(path, {}))
    metadata.storage_meta = Payload()  # deep inside an otherwise valid object
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    resize_in_manifest(path)
    assert_refused_and_untouched(path, ctx, r"refused to load posix\.system")


def test_a_plain_value_replaced_by_a_malicious_pickle_is_refused(tmp_path, ctx, monkeypatch):
    def unchecked(value, what):  # the attacker's writer: no safety check
        buffer = io.BytesIO()
        torch.save(Payload() if what == "the value 'step'" else value, buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    monkeypatch.setattr(entries, "encode", unchecked)
    path = saved(tmp_path, ctx)
    monkeypatch.undo()
    assert_refused_and_untouched(
        path, ctx, r"the value 'step' in the checkpoint is not a plain value"
    )


def test_an_optimizer_setting_replaced_by_a_malicious_pickle_is_refused(tmp_path, ctx, monkeypatch):
    # DCP stores non-tensor items (here an optimizer's lr) as pickles it would load unrestricted.
    real = entries.live_state

    def tampered(entry, **options):
        state = real(entry, **options)
        if entry.kind == "optimizer":
            state["param_groups"][0]["lr"] = Payload()
        return state

    monkeypatch.setattr(entries, "live_state", tampered)
    path = saved(tmp_path, ctx)
    monkeypatch.undo()
    assert_refused_and_untouched(path, ctx, r"the value 'optim\.param_groups\.0\.lr' .*was refused")


def test_a_truncated_data_file_is_a_clear_error(tmp_path, ctx):
    path = saved(tmp_path, ctx)
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert_refused_and_untouched(
        path, ctx, r"__0_0\.distcp has \d+ bytes, \d+ when written \(truncated\?\)"
    )


def test_a_truncated_data_file_with_a_matching_manifest_is_a_clear_error(tmp_path, ctx):
    path = saved(tmp_path, ctx)
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    resize_in_manifest(path)
    assert_refused_and_untouched(path, ctx, r"lies outside __0_0\.distcp")


def test_truncated_metadata_is_a_clear_error(tmp_path, ctx):
    path = saved(tmp_path, ctx)
    metadata = path / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    resize_in_manifest(path)
    assert_refused_and_untouched(path, ctx, r"\.metadata cannot be read safely")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda path: (path / MANIFEST).unlink(), "has no stratagem.json"),
        (lambda path: (path / MANIFEST).write_text("{"), "stratagem.json is not valid JSON"),
        (lambda path: (path / ".metadata").unlink(), r"\.metadata is missing"),
    ],
    ids=["no manifest", "bad manifest", "no metadata"],
)
def test_a_checkpoint_missing_parts_is_a_clear_error(tmp_path, ctx, edit, message):
    path = saved(tmp_path, ctx)
    edit(path)
    assert_refused_and_untouched(path, ctx, message)


def test_a_manifest_pointing_outside_the_checkpoint_is_refused(tmp_path, ctx):
    path = saved(tmp_path, ctx)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["../../etc/passwd"] = 1
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert_refused_and_untouched(path, ctx, r"lists a file outside it")


def test_unsafe_plain_values_are_refused_when_saving(tmp_path, ctx):
    for value, shown in (
        (Payload(), "posix.system"),
        (lambda: 0, "lambda"),
        ({"f": print}, "print"),
    ):
        with pytest.raises(
            sg.UsageError,
            match=rf"save: the value 'bad' cannot be stored as a plain value.*{shown}",
        ):
            sg.checkpoint.save(tmp_path / "c", {"bad": value}, ctx)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
