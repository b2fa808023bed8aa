"""The `stratagem` command refuses, before training, what it could not do, and prints safely (#23)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import local_ctx
from stratagem import checkpoint
from stratagem.cli.main import main
from test_cli import assert_one_line_error, command_env, stratagem_cli

SYNTHETIC_TRAIN = 1639  # samples in the training split of --data synthetic
SINGLE = ("demo", "--strategy", "single", "--data", "synthetic")


def test_a_batch_larger_than_the_data_set_is_refused_before_training():
    done = stratagem_cli(*SINGLE, "--batch-size", "5000")
    assert_one_line_error(done, "--batch-size 5000", "no optimizer step", f"{SYNTHETIC_TRAIN}")
    assert done.stdout == ""  # nothing trained, no table with a loss never computed


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--accumulate", "500"), ("--accumulate 500", "51 batches", "--accumulate 51 or less")),
        (
            ("--strategy", "ddp", "--devices", "2", "--batch-size", "1000"),
            ("--batch-size 1000", "2 rank(s)", "--batch-size 819 or less"),
        ),
    ],
)
def test_arguments_that_give_no_optimizer_step_are_refused(args, needles, capsys):
    assert main([*SINGLE, "--epochs", "1", *args]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert all(needle in captured.err for needle in needles), captured.err
    assert "final loss" not in captured.out


def test_the_largest_batch_the_refusal_suggests_trains_one_step(capsys):
    assert main([*SINGLE, "--epochs", "1", "--batch-size", str(SYNTHETIC_TRAIN)]) == 0
    assert "final loss" in capsys.readouterr().out


# ---------------------------------------------------------------- unwritable --checkpoint


def read_only_cli(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the command with ``directory`` read-only: a read-only bind mount as root, else chmod."""
    command = [sys.executable, "-W", "error", "-m", "stratagem", *args]
    if os.geteuid() == 0:  # root writes through permission bits: mount it read-only instead
        if shutil.which("unshare") is None:
            pytest.skip("root without unshare(1) cannot make a directory read-only")
        mount = 'mount --bind -o ro "$0" "$0" && exec "$@"'
        command = ["unshare", "-m", "sh", "-c", mount, str(directory), *command]
    else:
        directory.chmod(0o555)
    try:
        done = subprocess.run(
            command, env=command_env(), capture_output=True, text=True, timeout=120
        )
    finally:
        directory.chmod(0o755)
    if "mount:" in done.stderr or "unshare:" in done.stderr:
        pytest.skip(f"cannot mount a read-only directory here: {done.stderr.strip()}")
    return done


def test_a_checkpoint_in_a_read_only_directory_is_refused_before_training(tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    target = read_only / "ckpt"
    done = read_only_cli(read_only, *SINGLE, "--epochs", "1", "--checkpoint", str(target))
    assert_one_line_error(done, f"--checkpoint {target}", "cannot write", str(read_only))
    assert "epoch" not in done.stdout  # refused before the first epoch


def test_a_checkpoint_under_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    target = tmp_path / "notes.txt" / "ckpt"
    done = stratagem_cli(*SINGLE, "--epochs", "1", "--checkpoint", str(target))
    assert_one_line_error(done, f"--checkpoint {target}", "not a directory")
    assert "epoch" not in done.stdout


# ------------------------------------------------------------ what a checkpoint says is escaped

FORGED = "final loss 0.0000"
EVIL = {
    "\x1b[2J\x1b[Hmodel": torch.nn.Linear(2, 2),  # clears the screen where printed raw
    f"x\n{FORGED}": 1,  # a line of its own where printed raw
    "options": {"\x1b[31mkey\u202e": "value\x1b[0m"},
}


@pytest.mark.slow
def test_stratagem_checkpoint_escapes_the_names_it_prints(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.save(path, EVIL, local_ctx())
    done = stratagem_cli("checkpoint", str(path))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\u202e" not in done.stdout
    assert FORGED not in done.stdout.splitlines()  # no forged line
    assert "\\x1b[2J\\x1b[Hmodel (module)" in done.stdout
    assert f"x\\n{FORGED} (value)" in done.stdout
    assert "\\x1b[31mkey\\u202e = 'value\\x1b[0m'" in done.stdout


def test_demo_resume_escapes_the_values_it_reads_from_a_checkpoint(tmp_path, capsys):
    path = tmp_path / "ckpt"
    state = {"epoch": 1, "loss": 1.0, "data": "\x1b]0;owned\x07digits", "precision": "32-true"}
    checkpoint.save(path, state, local_ctx())
    assert main([*SINGLE, "--checkpoint", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "--data \\x1b]0;owned\\x07digits" in err
