"""The README's commands run on any supported Python, or fail loudly: never "skipped", exit 0.

Reported by a newcomer: every nox session was pinned to 3.11, so on a machine whose only
Python was 3.12 ``nox -s demo`` and ``nox -s tests`` printed "Session ... skipped: Python
interpreter 3.11 not found." and exited 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOX = shutil.which("nox")
needs_nox = pytest.mark.skipif(NOX is None, reason="nox is not on PATH (pip install nox)")


def nox(*args: str, python: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [python, "-m", "nox"] if python else [NOX]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOX_")}
    return subprocess.run(
        [*command, "-f", str(ROOT / "noxfile.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@needs_nox
def test_every_session_runs_on_the_python_that_runs_nox():
    listed = nox("--json", "--list", "-s", "tests", "demo", "lint", "typecheck")
    assert listed.returncode == 0, listed.stderr
    pythons = {row["session"]: row["python"] for row in json.loads(listed.stdout)}
    assert {"tests", "demo", "lint", "typecheck"} <= set(pythons)
    assert {pythons[name] for name in ("tests", "demo", "lint", "typecheck")} == {None}


@needs_nox
def test_a_session_whose_interpreter_is_missing_fails():
    done = nox("-s", "lint", "--force-python", "3.99")
    assert done.returncode != 0
    assert "Python interpreter 3.99 not found" in done.stdout + done.stderr


def _other_python() -> str | None:
    """A supported Python other than this one that really runs (a pyenv shim may not)."""
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for version in ("3.12", "3.13", "3.11"):
        if version == mine:
            continue
        found = [shutil.which(f"python{version}"), *sorted(pyenv.glob(f"{version}*/bin/python3"))]
        for candidate in filter(None, found):
            runs = subprocess.run([str(candidate), "-c", "import venv"], capture_output=True)
            if runs.returncode == 0:
                return str(candidate)
    return None


@pytest.mark.slow
def test_a_session_runs_under_another_supported_python(tmp_path):
    # The lint session's install (ruff only) stands for all: the tests session's torch is a
    # multi-GB download on a Python whose wheel this machine does not hold.
    other = _other_python()
    if other is None:
        pytest.skip("no second supported Python on PATH (python3.12, python3.13)")
    venv = tmp_path / "venv"
    subprocess.run([other, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "nox"], capture_output=True, text=True, timeout=300
    )
    if installed.returncode != 0:
        pytest.skip(f"nox could not be installed for {other}: {installed.stderr[-300:]}")
    envs = tmp_path / "envs"
    done = nox("-s", "lint", "--install-only", "--envdir", str(envs), python=python, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "skipped" not in done.stdout + done.stderr
    made = subprocess.run(
        [str(envs / "lint" / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert (
        made
        == subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    )  # the session's venv is made from the Python that ran nox
    assert made != str(sys.version_info[:2])
