"""Weights in shared formats, one process: .pt and safetensors out and in, and hostile files refused.

The worlds (ddp, fsdp on 3 ranks, FSDP x TP) are in test_checkpoint_weights_worlds.py.
"""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch as safetensors_torch  # the reference reader, installed by nox -s tests
import torch

import stratagem as sg
from stratagem.checkpoint import CheckpointError, safetensor_files


@pytest.fixture
def ctx() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2, bias=False)
    )
    model(torch.randn(4, 3))  # the running statistics move: buffers are weights too
    return model


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    ours, theirs = a.state_dict(), b.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("name", ["weights.pt", "weights.safetensors", "sharded"])
def test_an_export_imports_into_another_module_bit_for_bit(tmp_path, ctx, name):
    source, target = net(0), net(1)
    sg.checkpoint.export_weights(tmp_path / name, source, ctx)
    sg.checkpoint.import_weights(tmp_path / name, target, ctx)
    assert_same(source, target)


def test_a_wrapped_module_exports_the_plain_names(tmp_path, ctx):
    source = net(0)
    sg.checkpoint.export_weights(tmp_path / "w.pt", torch.nn.DataParallel(source), ctx)
    saved = torch.load(tmp_path / "w.pt", weights_only=True)
    assert saved.keys() == source.state_dict().keys()  # no module. prefix


def test_our_safetensors_and_the_packages_read_each_other(tmp_path, ctx):
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(7),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
    }
    ours = tmp_path / "ours.safetensors"
    safetensor_files.write(ours, tensors, {"format": "pt"})
    theirs_read = safetensors_torch.load_file(ours)
    safetensors_torch.save_file(tensors, tmp_path / "theirs.safetensors")
    ours_read = safetensor_files.read(tmp_path / "theirs.safetensors")
    for read in (theirs_read, ours_read):
        assert read.keys() == tensors.keys()
        for key, value in tensors.items():
            assert read[key].dtype == value.dtype and torch.equal(read[key], value), key


def test_a_sharded_export_splits_by_size_and_indexes_every_tensor(tmp_path, ctx):
    source = net(0)
    sg.checkpoint.export_weights(tmp_path / "out", source, ctx, shard_bytes=64)
    index = json.loads((tmp_path / "out" / safetensor_files.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["weight_map"].keys() == source.state_dict().keys()
    total = sum(v.numel() * v.element_size() for v in source.state_dict().values())
    assert index["metadata"]["total_size"] == total
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [*files, safetensor_files.INDEX]
    )


def test_a_file_that_does_not_match_changes_nothing_and_names_every_difference(tmp_path, ctx):
    other = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.BatchNorm1d(6))
    sg.checkpoint.export_weights(tmp_path / "w.safetensors", other, ctx)
    target = net(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        sg.checkpoint.import_weights(tmp_path / "w.safetensors", target, ctx)
    message = str(caught.value)
    assert "missing 2.weight" in message
    assert "0.weight is [6, 3] in the file, [5, 3] in the module" in message
    assert "Nothing was loaded" in message
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_pt_file_that_would_run_code_is_refused(tmp_path, ctx):
    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"0.weight": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"cannot read .*evil\.pt as torch\.save weights"):
        sg.checkpoint.import_weights(tmp_path / "evil.pt", net(0), ctx)


def test_a_pt_file_holding_a_training_state_names_the_fix(tmp_path, ctx):
    torch.save({"model": net(0).state_dict(), "step": 3}, tmp_path / "state.pt")
    with pytest.raises(CheckpointError, match=r"not \{name: tensor\}.*state\['model'\]"):
        sg.checkpoint.import_weights(tmp_path / "state.pt", net(0), ctx)


def test_load_of_a_weights_file_or_export_points_at_import_weights(tmp_path, ctx):
    sg.checkpoint.export_weights(tmp_path / "w.pt", net(0), ctx)
    sg.checkpoint.export_weights(tmp_path / "out", net(0), ctx)
    for path in (tmp_path / "w.pt", tmp_path / "out"):
        with pytest.raises(CheckpointError, match=r"sg\.checkpoint\.import_weights\(path"):
            sg.checkpoint.load(path, {"model": net(0)}, ctx)


def test_an_export_never_writes_over_an_existing_directory(tmp_path, ctx):
    sg.checkpoint.export_weights(tmp_path / "out", net(0), ctx)
    with pytest.raises(sg.UsageError, match=r"exists; export into a new directory"):
        sg.checkpoint.export_weights(tmp_path / "out", net(1), ctx)
    target = net(2)
    sg.checkpoint.import_weights(tmp_path / "out", target, ctx)
    assert_same(net(0), target)  # the first export is whole


def test_a_file_export_replaces_the_old_file_whole_and_leaves_no_temporary(tmp_path, ctx):
    sg.checkpoint.export_weights(tmp_path / "w.safetensors", net(0), ctx)
    sg.checkpoint.export_weights(tmp_path / "w.safetensors", net(1), ctx)
    target = net(2)
    sg.checkpoint.import_weights(tmp_path / "w.safetensors", target, ctx)
    assert_same(net(1), target)
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"shard_bytes": 0}, r"'shard_bytes' must be a positive int or None \(got 0, an int\)"),
        ({"shard_bytes": 10}, r"shards a directory export, but w\.pt is one pt file"),
    ],
)
def test_bad_arguments_are_named(tmp_path, ctx, arguments, match):
    with pytest.raises(sg.UsageError, match=match):
        sg.checkpoint.export_weights(tmp_path / "w.pt", net(0), ctx, **arguments)


def test_a_module_that_is_not_one_is_named(tmp_path, ctx):
    with pytest.raises(
        sg.UsageError, match=r"import_weights: 'module' must be a torch\.nn\.Module"
    ):
        sg.checkpoint.import_weights(tmp_path / "w.pt", {"0.weight": 1}, ctx)


# Crafted files: each header lies in one way; each is refused before a tensor is made.


def crafted(tmp_path, header: object, data: bytes = b"", size: int | None = None):
    raw = json.dumps(header).encode()
    path = tmp_path / "crafted.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if size is None else size) + raw + data)
    return path


def entry(begin: int, end: int, shape=(1,), dtype="F32") -> dict[str, object]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    ("header", "data", "size", "match"),
    [
        ({}, b"", 2**62, r"header claims 4611686018427387904 bytes, but the file holds"),
        ([1, 2], b"", None, r"header is a JSON list, not an object"),
        ({"a": entry(-4, 0)}, b"", None, r"data_offsets \[-4, 0\], not \[begin, end\]"),
        ({"a": entry(8, 4)}, bytes(8), None, r"data_offsets \[8, 4\], not \[begin, end\]"),
        ({"a": entry(0, 4, shape=(-1,))}, bytes(4), None, r"shape \[-1\], not a list of sizes"),
        (
            {"a": entry(0, 2**40, shape=(2**38,))},
            bytes(4),
            None,
            r"cover 1099511627776 bytes of data, but the file holds 4",
        ),
        ({"a": entry(0, 8, shape=(1,))}, bytes(8), None, r"spans 8 bytes, but F32 \[1\] takes 4"),
        (
            {"a": entry(0, 8, shape=(2,)), "b": entry(4, 8)},
            bytes(8),
            None,
            r"'b' \(bytes 4-8\) overlaps 'a'",
        ),
        ({"a": entry(4, 8)}, bytes(8), None, r"'a' \(bytes 4-8\) leaves a gap after the header"),
        ({"a": entry(0, 4, dtype="F128")}, bytes(4), None, r"dtype 'F128', not one of"),
        ({"a": {"dtype": "F32"}}, b"", None, r"'a' is not \{dtype, shape, data_offsets\}"),
        ({"__metadata__": {"k": 1}}, b"", None, r"__metadata__ is not an object of strings"),
    ],
)
def test_a_crafted_safetensors_header_is_refused_with_what_is_wrong(
    tmp_path, ctx, header, data, size, match
):
    path = crafted(tmp_path, header, data, size)
    with pytest.raises(CheckpointError, match=match):
        sg.checkpoint.import_weights(path, net(0), ctx)


def test_a_header_that_is_not_json_is_refused(tmp_path, ctx):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"\xff{{{")
    with pytest.raises(CheckpointError, match=r"header is not JSON"):
        sg.checkpoint.import_weights(path, net(0), ctx)


def test_an_index_naming_a_file_outside_its_directory_is_refused(tmp_path, ctx):
    (tmp_path / "out").mkdir()
    index = {"weight_map": {"0.weight": "../elsewhere.safetensors"}}
    (tmp_path / "out" / safetensor_files.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"which is not a file name in"):
        sg.checkpoint.import_weights(tmp_path / "out", net(0), ctx)
