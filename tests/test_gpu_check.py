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


def table_rows(stdout: str) -> list[list[str]]:
    """The table's rows (not its header), each as its cells."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


@pytest.mark.slow
def test_its_cases_run_on_the_cpu_and_print_one_table():
    done = gpu_check(
        "--device", "cpu", "--only", "single", "round_trip", "float8", "loss_scale_skip"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = table_rows(done.stdout)
    # in the script's order, not the command line's
    assert [row[0] for row in rows] == ["single", "loss_scale_skip", "float8", "round_trip"]
    assert "laws passed" in rows[2][3] and "emulated" in rows[2][3], rows[2]
    assert all(row[1] == "ok" for row in rows)


@pytest.mark.slow
def test_the_quick_cpu_run_covers_worlds_saves_resumes_and_the_gpt_step():
    """The prepared script as a GPU host runs it, on gloo ranks and a tiny GPT: all rows ok."""
    done = gpu_check("--device", "cpu", "--quick", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = table_rows(done.stdout)
    assert all(row[1] == "ok" for row in rows), done.stdout
    names = [row[0] for row in rows]
    kinds = ("ddp", "fsdp", "hsdp", "allreduce_grads", "pipeline")
    assert [name for name in names if name.startswith("world_")] == [
        f"world_{kind}_2" for kind in kinds
    ]
    for row in rows:
        if row[0].startswith("world_"):  # both save modes resumed bit for bit, on 2 gloo ranks
            assert "2 ranks, gloo on cpu" in row[3]
            assert "(blocking, background)" in row[3] and "bit for bit" in row[3]
    steps = {row[0]: row[3] for row in rows if row[0].startswith("gpt_step: ")}
    for side in ("by hand", "stratagem"):
        assert "ms/step" in steps[f"gpt_step: {side}, eager"]
        assert "MFU n/a" in steps[f"gpt_step: {side}, eager"]  # no bf16 peak for a CPU
    assert "1.000x by hand" in steps["gpt_step: by hand, eager"]
    for side in ("Lightning Fabric", "Accelerate"):  # ran, or said why not
        detail = steps[f"gpt_step: {side}, eager"]
        assert "ms/step" in detail or detail.startswith("skipped: "), detail
    assert names[-1] == "suite"
    assert rows[-1][3].startswith("skipped: ")  # the suite runs on the CPU only when asked


def test_peaks_are_known_by_device_name_and_unknown_ones_give_no_mfu():
    from benchmarks.gpt_step import peak_of as peak

    assert peak("NVIDIA H200") == 989.0
    assert peak("NVIDIA H100 80GB HBM3") == 989.0
    assert peak("NVIDIA H100 PCIe") == 756.0
    assert peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak("Tesla V100-SXM2-16GB") is None  # no bf16 tensor cores: MFU "n/a"


def test_world_sizes_and_pipeline_stages_fit_the_host():
    from benchmarks import gpu_worlds

    assert gpu_worlds.world_sizes("cpu") == [2]
    for size in (1, 2, 3, 8):
        stages = gpu_worlds.stages(size)
        assert len(stages) == size
        names = [name for stage in stages for name in stage]
        assert names == [str(i) for i in range(len(gpu_worlds.build(size)))]
        assert all(len(stage) >= 2 for stage in stages)
        assert gpu_worlds.microbatches(size) >= size


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


def test_a_cut_suite_run_is_counted_from_its_progress_lines():
    from benchmarks.gpu_check import _progress

    output = "bringing up nodes...\n..s.x [ 40%]\n.F.X.E [100%]\nwarnings summary\n"
    assert _progress(output) == (7, 2)  # passed (an xpass too), failed (an error too)
