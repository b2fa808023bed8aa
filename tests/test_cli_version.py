"""``stratagem --version`` prints the installed package's version and exits 0."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from stratagem.cli.main import main

VERSION = importlib.metadata.version("stratagem")


def test_version_is_printed_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr() == (f"stratagem {VERSION}\n", "")


def test_version_of_python_dash_m_stratagem():
    done = subprocess.run(
        [sys.executable, "-m", "stratagem", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"stratagem {VERSION}\n", "")


def test_a_command_is_still_required_without_version(capsys):
    assert main([]) == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err
