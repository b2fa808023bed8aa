"""benchmarks/gpu_check: refuses in one line without CUDA; its cases run on the CPU; on CUDA, all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def gpu_check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")
def test_without_cuda_it_refuses_in_one_line_and_runs_nothing():
    done = gpu_check()
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "no CUDA device here" in done.stderr and "nothing was run" in done.stderr


@pytest.mark.slow
def test_its_cases_run_on_the_cpu_and_print_one_table():
    done = gpu_check("--device", "cpu", "--only", "single", "round_trip", "loss_scale_skip")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [
        line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| single",
        "| loss_scale_skip",
        "| round_trip",
    ]  # in the script's order, not the command line's
    assert all(" | ok | " in row for row in rows[1:])


@pytest.mark.slow
def test_a_failing_case_is_a_row_and_a_non_zero_exit():
    done = gpu_check("--device", "cpu", "--only", "single", "--budget", "-1")
    assert done.returncode == 1
    assert "| single | FAIL | 0.0 | not started: out of time |" in done.stdout


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")
def test_every_cuda_case_passes():
    done = gpu_check(timeout=560)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
