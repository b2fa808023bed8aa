"""``stratagem dry-run MODULE:FUNCTION``: the dry-run table from the command line, and its refusals."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from stratagem.cli.main import main

PLAN = textwrap.dedent(
    """
    import torch
    import stratagem as sg

    def model():
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))

    def plan(world_size):
        return {
            "strategy": sg.fsdp(device="cpu", shard_when=sg.every_module_of(torch.nn.Linear)),
            "model": model,
            "batch": torch.ones(4, 64),
            "forward": lambda m, b: m(b).sum(),
        }

    def not_a_mapping(world_size):
        return 3
    """
)


@pytest.fixture
def plans(tmp_path, monkeypatch):
    (tmp_path / "my_plans.py").write_text(PLAN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_prints_one_table_per_world_size(plans, capsys):
    assert main(["dry-run", "my_plans:plan", "--world-size", "8", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "dry run: fsdp, rank 0 of 8 (simulated)" in printed
    assert "dry run: fsdp, rank 0 of 1024 (simulated)" in printed
    assert printed.count("reduce_scatter") == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("my_plans", "is not MODULE:FUNCTION"),
        ("no_such_module:plan", "cannot import 'no_such_module'"),
        ("my_plans:missing", "has no function 'missing'"),
        ("my_plans:not_a_mapping", "must return a mapping with strategy, model and batch"),
    ],
)
def test_a_bad_spec_is_one_line_and_exit_code_2(plans, capsys, spec, message):
    assert main(["dry-run", spec]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


@pytest.mark.slow
def test_runs_as_a_command_from_the_directory_of_the_plan(plans):
    done = subprocess.run(
        [sys.executable, "-m", "stratagem", "dry-run", "my_plans:plan", "--world-size", "64"],
        cwd=plans,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "rank 0 of 64" in done.stdout and "all_gather" in done.stdout
